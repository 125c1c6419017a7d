"""Copy flags: the compute stream of a captured call waits for the copy stream by polling device memory."""

import pytest
import torch

from engine.memory import copy_flags
from engine.memory.copy_flags import CopyFlags

needs_flags = pytest.mark.skipif(
    not (torch.cuda.is_available() and CopyFlags.available(torch.device("cuda"), wait=True)),
    reason="polling needs CUDA and a working Triton",
)
DELAY = 20_000_000  # torch.cuda._sleep cycles on the copy stream before its copy: about 10 ms


def test_no_polling_off_cuda_or_when_disabled(monkeypatch):
    assert not CopyFlags.available(torch.device("cpu"))
    monkeypatch.setattr(copy_flags, "ENABLED", False)
    assert not CopyFlags.available(torch.device("cuda", 0))


def delayed_copy_then_read(flags: CopyFlags, source: torch.Tensor, target: torch.Tensor,
                           seen: torch.Tensor, side: torch.cuda.Stream) -> None:
    """The copy stream sleeps, copies `source` into `target` and sets flag 0; the current stream polls it and
    then copies `target` into `seen`."""
    flags.reset()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(DELAY)
        target.copy_(source, non_blocking=True)
        flags.set_after_copy(0)
    flags.wait(0)
    seen.copy_(target)
    torch.cuda.current_stream().wait_stream(side)


@needs_flags
def test_the_compute_stream_reads_the_copy_only_after_its_flag():
    flags = CopyFlags(3, torch.device("cuda"))
    source = torch.arange(1 << 20, dtype=torch.int32).pin_memory()
    target = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    seen = torch.full_like(target, -1)
    side = torch.cuda.Stream()
    delayed_copy_then_read(flags, source, target, seen, side)
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), source)  # without the wait, `seen` would hold the zeros of `target`


@needs_flags
def test_a_captured_call_polls_again_on_every_replay():
    flags = CopyFlags(1, torch.device("cuda"))
    source = torch.zeros(1 << 20, dtype=torch.int32).pin_memory()
    target = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    seen = torch.zeros_like(target)
    side = torch.cuda.Stream()
    delayed_copy_then_read(flags, source, target, seen, side)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        delayed_copy_then_read(flags, source, target, seen, side)
    for value in (7, 11):
        source.fill_(value)
        target.zero_()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(seen == value)  # the reset flag held the read back until this replay's copy

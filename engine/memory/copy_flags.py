"""Waits of the compute stream for the copy stream through flags in device memory, for captured calls.

Inside a CUDA graph, the edges that make compute wait for the ring's copies (one per streamed segment) slow
the copies themselves: on the H200, a graph of the planner's SDXL plan at 388 MiB copied at 50 GB/s with
those edges and at 55 GB/s, the probe's rate, with compute polling flags instead
(bench/results/plan_replay_relays_cuda_20261130_s14.log; edges from compute to the copies, the ring's
waits, do not slow them; neither do edges leaving a small kernel or copy queued after each copy). So in a
captured call, each streamed segment's copy is followed on the copy stream by a 4-byte copy from pinned
memory that sets the segment's flag, and the compute stream polls that flag with a one-thread kernel
before the segment runs: the graph holds no edge from the copy branch to the compute branch but the join
at its end.

The poll is a Triton kernel. Where Triton is missing or fails (no compiler for its launcher, a device it
does not support), `CopyFlags.available` says no and the runner keeps the events.

Compiling and checking the kernel takes 0.7 to 1 s in a new process (Triton hashes its sources, compiles or
loads the kernel, and the check waits for a delayed flag), which the first image must not wait for: a runner
starts the check in a background thread when it first adopts a plan that streams (`warm_up`; a module that
stays resident never imports Triton), and until the check is done `available` says no, so that the calls
meanwhile wait for events. The check runs on streams of its own,
which never synchronize with a stream that the main thread is capturing.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

ENABLED = True  # poll flags in captured calls where Triton works (False: events everywhere)
_AVAILABLE: dict[int, bool] = {}  # CUDA device index -> whether a poll ran correctly there
_CHECKING: dict[int, threading.Thread] = {}  # CUDA device index -> the check running in the background
_LOCK = threading.Lock()


class CopyFlags:
    """One int32 flag per segment on a CUDA device, zeroed at a call's start and set after its copy."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.flags = torch.zeros(max(count, 1), dtype=torch.int32, device=device)
        self._one = torch.ones(1, dtype=torch.int32).pin_memory()

    def reset(self) -> None:
        """Zero every flag (on the current stream: the compute stream, before the call's first copy)."""
        self.flags.zero_()

    def set_after_copy(self, index: int) -> None:
        """Set flag `index` once the current stream's queued work is done (on the copy stream, after the
        segment's copy: a stream's copies complete in order)."""
        self.flags[index : index + 1].copy_(self._one, non_blocking=True)

    def wait(self, index: int) -> None:
        """Hold the current stream until flag `index` is set."""
        from engine.memory import flag_poll

        with torch.cuda.device(self.flags.device):  # Triton launches on the current device's stream
            flag_poll.poll(self.flags, index)

    @staticmethod
    def available(device: torch.device, wait: bool = False) -> bool:
        """Whether polling works on `device`: a CUDA device where the Triton poll compiled and waited for a
        flag that another stream set after a delay (checked once per device, in the background: False until
        the check is done, unless `wait`)."""
        if not ENABLED or device.type != "cuda":
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        with _LOCK:
            if index in _AVAILABLE:
                return _AVAILABLE[index]
        CopyFlags.warm_up(device)
        if wait:
            with _LOCK:
                thread = _CHECKING.get(index)
            if thread is not None:
                thread.join()
        with _LOCK:
            return _AVAILABLE.get(index, False)

    @staticmethod
    def ready(device: torch.device) -> bool:
        """Whether polling is known to work on `device` now; unlike `available`, starts no check."""
        if not ENABLED or device.type != "cuda":
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        with _LOCK:
            return _AVAILABLE.get(index, False)

    @staticmethod
    def warm_up(device: torch.device) -> None:
        """Start checking `device` in a background thread, unless it is checked or being checked."""
        if not ENABLED or device.type != "cuda":
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        with _LOCK:
            if index in _AVAILABLE or index in _CHECKING:
                return
            thread = threading.Thread(target=_check, args=(index,), name=f"sluice-copy-flags-cuda{index}",
                                      daemon=True)
            _CHECKING[index] = thread
        thread.start()


def _check(index: int) -> None:
    works = _works(torch.device("cuda", index))
    with _LOCK:
        _AVAILABLE[index] = works
        _CHECKING.pop(index, None)


def _works(device: torch.device) -> bool:
    try:
        from engine.memory import flag_poll

        with torch.cuda.device(device):
            main, side = torch.cuda.Stream(device), torch.cuda.Stream(device)  # never the legacy stream
            with torch.cuda.stream(main):
                flags = CopyFlags(1, device)
                seen = torch.zeros(1, dtype=torch.int32, device=device)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    torch.cuda._sleep(1_000_000)  # about a millisecond: the poll must really wait
                    flags.set_after_copy(0)
                flag_poll.poll(flags.flags, 0)
                seen.copy_(flags.flags)  # after the poll on this stream: 1 only if the poll waited
            side.synchronize()
            main.synchronize()
            return bool(seen.item() == 1)
    except Exception as error:  # noqa: BLE001 - any failure (no Triton, no compiler) keeps the events
        log.info("cuda: copy flags unavailable (%s); captured calls wait for copies with events", error)
        return False

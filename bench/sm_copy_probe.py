"""Host-to-device copies by the SMs (a Triton kernel reading mapped pinned memory) against the copy engine:
could a streamed segment's weights arrive faster, or at the same rate inside a CUDA graph, if a few SMs
pulled them instead of the copy engine pushing them?

    python3 bench/sm_copy_probe.py

Rows (GB/s, median of 5 after a warm-up, CUDA events): the copy engine (`copy_`, non-blocking) and the SM
copy at several grid sizes, eagerly and replayed as one CUDA graph of 16 copies; then each beside a stream
of bf16 matrix products, with the products' slowdown.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import MIB, graphed, measure  # noqa: E402

GPU = torch.device("cuda")


@triton.jit
def _pull(source, target, words, BLOCK: tl.constexpr):
    """Grid-stride copy of int32 words; `source` may point at mapped pinned host memory."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    for start in range(program * BLOCK, words, programs * BLOCK):
        where = start + lanes
        keep = where < words
        tl.store(target + where, tl.load(source + where, mask=keep, cache_modifier=".cg"), mask=keep)


def sm_copy(target: torch.Tensor, source: torch.Tensor, programs: int, block: int = 4096) -> None:
    """Copy int32 `source` (pinned host) into `target` (device) with `programs` CTAs."""
    words = source.numel()
    _pull[(programs,)](source, target, words, BLOCK=block, num_warps=8)


def rate(fn, nbytes: int) -> float:
    """GB/s of fn() moving nbytes: bench/memory.py's median of 5 steps after a warm-up."""
    return nbytes / (measure(GPU, fn, 1, 5)[0] / 1e3) / 1e9


def eager_and_graph(fn, nbytes: int) -> str:
    """The cells `eager GB/s | graph GB/s` of fn() moving nbytes."""
    return f"{rate(fn, nbytes):.1f} | {rate(graphed(GPU, fn), nbytes):.1f}"


def main() -> int:
    chunk, count = 64 * MIB, 16
    host = torch.randint(-(2**31), 2**31 - 1, (count * chunk // 4,), dtype=torch.int32).pin_memory()
    on_gpu = torch.empty_like(host, device=GPU)
    parts = [(on_gpu[i * chunk // 4 : (i + 1) * chunk // 4], host[i * chunk // 4 : (i + 1) * chunk // 4])
             for i in range(count)]

    def engine() -> None:
        for target, source in parts:
            target.copy_(source, non_blocking=True)

    def pulled(programs: int):
        def run() -> None:
            for target, source in parts:
                sm_copy(target, source, programs)
        return run

    try:
        sm_copy(on_gpu, host, 132)
    except (RuntimeError, ValueError) as error:  # Triton may refuse a host pointer
        print(f"SM copy refused: {error}")
        return 1
    torch.cuda.synchronize()
    exact = torch.equal(on_gpu.cpu(), host)
    print(f"SM copy of {count * chunk / MIB:.0f} MiB exact: {exact}")
    print("| copier | eager GB/s | graph GB/s |")
    print("| --- | ---: | ---: |")
    total = count * chunk
    print(f"| copy engine | {eager_and_graph(engine, total)} |")
    for programs in (4, 8, 16, 32, 66, 132, 264):
        print(f"| SM copy, {programs} CTAs | {eager_and_graph(pulled(programs), total)} |")

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def products() -> None:
        for _ in range(12):
            a @ a

    alone = measure(GPU, products, 1, 5)[0] / 1e3  # seconds
    print("| copier beside matrix products | copy GB/s | products' time / alone |")
    print("| --- | ---: | ---: |")
    for name, fn in [("copy engine", engine)] + [(f"SM copy, {p} CTAs", pulled(p)) for p in (8, 16, 32)]:
        copy_done = torch.cuda.Event(enable_timing=True)
        copy_start = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(torch.cuda.current_stream())
        start.record()
        with torch.cuda.stream(side):
            copy_start.record()
            fn()
            copy_done.record()
        products()
        end.record()
        torch.cuda.synchronize()
        copy_gbps = total / (copy_start.elapsed_time(copy_done) / 1e3) / 1e9
        slowdown = (start.elapsed_time(end) / 1e3) / alone
        print(f"| {name} | {copy_gbps:.1f} | {slowdown:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Pinned host-to-device copy rate under the stream ring's patterns, to find what slows streamed copies.

    python3 bench/copy_rate.py

Rows (GB/s over the whole pattern, CUDA events):
- one copy of each size, back to back on one stream;
- a 59.4 MiB copy (SD1.5's largest stage) at several source and destination offsets;
- the ring pattern: copies of a size into a ring of slots on a side stream, each after the compute of the
  slot's previous segment, the compute stream waiting for each copy (short sleep kernels as compute),
  eager and captured as one CUDA graph;
- copies beside large matrix products on the compute stream.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import MIB, measure  # noqa: E402


def timed(fn) -> float:
    """Median seconds of fn() over 5 calls after one warm-up (bench/memory.py's measure)."""
    return measure(torch.device("cuda"), fn, 1, 5)[0] / 1e3


def main() -> int:
    host = torch.empty(2048 * MIB, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    print("| pattern | GB/s |")
    print("| --- | ---: |")

    for size in (1, 4, 16, 64, 256):
        nbytes, count = size * MIB, max(1, 512 // size)

        def back_to_back(nbytes: int = nbytes, count: int = count) -> None:
            for i in range(count):
                offset = (i * nbytes) % (768 * MIB)
                device[offset : offset + nbytes].copy_(host[offset : offset + nbytes], non_blocking=True)

        print(f"| {count} x {size} MiB back to back | {count * nbytes / timed(back_to_back) / 1e9:.1f} |")

    nbytes = 62_274_560
    for source, target in ((0, 0), (256, 0), (0, 256), (4096 + 256, 4096 + 512), (2 * MIB + 256, 256)):
        def offset_copy(source: int = source, target: int = target) -> None:
            for _ in range(8):
                device[target : target + nbytes].copy_(host[source : source + nbytes], non_blocking=True)

        rate = 8 * nbytes / timed(offset_copy) / 1e9
        print(f"| 8 x 59.4 MiB, source +{source}, target +{target} | {rate:.1f} |")

    for size_mib, slots, sleep_cycles, tiny, count in (
        (8, 3, 1000, 0, 48), (30, 3, 1000, 0, 48), (30, 3, 1000, 4096, 48), (2, 6, 1000, 0, 48),
        (8, 3, 200_000, 0, 48), (8, 3, 1000, 0, 160), (8, 3, 1000, 0, 320), (4, 6, 1000, 0, 640),
    ):
        nbytes = int(size_mib * MIB)
        copied = [torch.cuda.Event() for _ in range(count)]
        done = [torch.cuda.Event() for _ in range(count)]

        def ring(nbytes: int = nbytes, slots: int = slots, count: int = count, cycles: int = sleep_cycles,
                 copied: list = copied, done: list = done, tiny: int = tiny) -> None:
            compute = torch.cuda.current_stream()
            side.wait_stream(compute)
            queued = 0
            for i in range(count):
                while queued < count and queued - slots < i:
                    with torch.cuda.stream(side):
                        if queued >= slots:
                            side.wait_event(done[queued - slots])
                        slot = (queued % slots) * nbytes
                        source = queued * nbytes % (1536 * MIB)
                        device[slot : slot + nbytes].copy_(host[source : source + nbytes], non_blocking=True)
                        if tiny:  # a second, small run of the same segment
                            far = 1536 * MIB + queued * tiny
                            aside = 1000 * MIB
                            device[aside : aside + tiny].copy_(host[far : far + tiny], non_blocking=True)
                        copied[queued].record(side)
                    queued += 1
                compute.wait_event(copied[i])
                torch.cuda._sleep(cycles)
                done[i].record(compute)
            compute.wait_stream(side)

        eager = count * nbytes / timed(ring) / 1e9
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            ring()
        replayed = count * nbytes / timed(graph.replay) / 1e9
        label = f"ring: {count} x {size_mib} MiB (+{tiny} B) in {slots} slots, sleep {sleep_cycles} cycles"
        print(f"| {label}, eager | {eager:.1f} |")
        print(f"| {label}, graph | {replayed:.1f} |")

    weights = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    for label, waits, branch in (("matmuls", 1, False), ("matmuls, 2 waits per copy", 2, False),
                                 ("matmuls on two branches", 1, True)):
        nbytes, count, slots = 30 * MIB, 40, 4
        copied = [torch.cuda.Event() for _ in range(count)]
        done = [torch.cuda.Event() for _ in range(count)]
        other = torch.cuda.Stream()

        def ring_matmul(nbytes: int = nbytes, count: int = count, slots: int = slots, waits: int = waits,
                        branch: bool = branch, copied: list = copied, done: list = done,
                        other: torch.cuda.Stream = other) -> None:
            compute = torch.cuda.current_stream()
            side.wait_stream(compute)
            other.wait_stream(compute)
            queued = 0
            for i in range(count):
                while queued < count and queued - slots < i:
                    with torch.cuda.stream(side):
                        for back in range(waits):
                            if queued - slots - back >= 0:
                                side.wait_event(done[queued - slots - back])
                        slot = (queued % slots) * nbytes
                        device[slot : slot + nbytes].copy_(host[queued * nbytes : (queued + 1) * nbytes],
                                                           non_blocking=True)
                        copied[queued].record(side)
                    queued += 1
                compute.wait_event(copied[i])
                weights @ weights  # about 0.2 ms: the 0.57 ms copies set the pace
                if branch:
                    other.wait_stream(compute)
                    with torch.cuda.stream(other):
                        weights @ weights
                    compute.wait_stream(other)
                done[i].record(compute)
            compute.wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        eager = count * nbytes / timed(ring_matmul) / 1e9
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            ring_matmul()
        replayed = count * nbytes / timed(graph.replay) / 1e9
        print(f"| ring: {count} x 30 MiB in {slots} slots, {label}, eager | {eager:.1f} |")
        print(f"| ring: {count} x 30 MiB in {slots} slots, {label}, graph | {replayed:.1f} |", flush=True)

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    nbytes = 32 * MIB
    rates: list[float] = []

    def copies_only() -> None:
        with torch.cuda.stream(side):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            for i in range(16):
                chunk = slice(i * nbytes, (i + 1) * nbytes)
                device[chunk].copy_(host[chunk], non_blocking=True)
            end.record(side)
        end.synchronize()
        rates.append(16 * nbytes / (start.elapsed_time(end) / 1e3) / 1e9)

    for _ in range(3):
        copies_only()
    print(f"| 16 x 32 MiB on the side stream alone | {statistics.median(rates):.1f} |")
    rates.clear()
    for _ in range(3):
        for _ in range(10):
            a @ a  # queue compute first so that the copies run beside it
        copies_only()
    print(f"| 16 x 32 MiB on the side stream beside 8192^2 fp16 matmuls | {statistics.median(rates):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

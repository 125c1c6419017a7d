"""The pinned host-to-device copy rate while the UNet computes, with no segment plan, ring or runner: how
fast can weights stream at all beside a UNet's kernels?

    python3 bench/copy_beside_compute.py [--calls 8]

For SD1.5 (512x512) and SDXL (1024x1024) on random fp16 weights resident on the GPU, the compute stream runs
`--calls` UNet calls back to back (replays of one captured graph, or eager calls), or spin kernels of the
same length, or nothing; meanwhile a side stream copies pinned host memory into device memory in chunks,
bytes enough for about 4/5 of the compute's time at 55 GB/s, so that every copy overlaps compute. Rows: the
copies' GB/s (CUDA events around them on the side stream) and the compute's ms with and without the copies.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory import graphed  # noqa: E402
from plan_replay_toy import real_unet, spin_rate  # noqa: E402

from engine.models.staged import run_stages  # noqa: E402

MIB = 1024**2


def unet_call(family: str, device: torch.device) -> Callable[[], object]:
    """One forward of the family's UNet on random weights resident on `device` (plan_replay_toy's)."""
    stages, initial_state = real_unet(family, device)

    @torch.no_grad()
    def call() -> object:
        return run_stages(stages, initial_state())["h"]

    return call


def run(compute: Callable[[], None] | None, copies: Callable[[], None] | None, side: torch.cuda.Stream
        ) -> tuple[float, float]:
    """(compute ms, copies ms) of one run of both, the copies on `side` starting with the compute."""
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    marks[0].record()
    side.wait_stream(torch.cuda.current_stream())
    if copies is not None:
        with torch.cuda.stream(side):
            marks[2].record(side)
            copies()
            marks[3].record(side)
    if compute is not None:
        compute()
    marks[1].record()
    torch.cuda.synchronize()
    compute_ms = marks[0].elapsed_time(marks[1]) if compute is not None else 0.0
    copies_ms = marks[2].elapsed_time(marks[3]) if copies is not None else 0.0
    return compute_ms, copies_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    host = torch.empty(1024 * MIB, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(1024 * MIB, dtype=torch.uint8, device=device)
    cycles_per_second = spin_rate(device)
    print("| model | compute | chunk MiB | copies GB/s | compute ms alone | compute ms beside the copies |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for family in ("SD1.5", "SDXL"):
        eager = unet_call(family, device)
        replay = graphed(device, eager)

        def calls(one: Callable[[], object]) -> Callable[[], None]:
            return lambda: [one() for _ in range(args.calls)]

        graph_ms = statistics.median(run(calls(replay), None, side)[0] for _ in range(args.repeats))
        cycles = int(graph_ms / 1e3 * cycles_per_second)
        computes: list[tuple[str, Callable[[], None] | None]] = [
            ("none", None),
            ("spin kernels", lambda cycles=cycles: torch.cuda._sleep(cycles)),
            ("UNet graph replays", calls(replay)),
            ("UNet eager calls", calls(eager)),
        ]
        copy_bytes = int(0.8 * graph_ms / 1e3 * 55e9)
        for name, compute in computes:
            alone = (statistics.median(run(compute, None, side)[0] for _ in range(args.repeats))
                     if compute is not None else 0.0)
            for chunk_mib in (8, 64):
                chunk = chunk_mib * MIB
                count = max(1, copy_bytes // chunk)

                def copies(chunk: int = chunk, count: int = count) -> None:
                    for i in range(count):
                        offset = (i * chunk) % (host.numel() - chunk + 1)
                        part = slice(offset, offset + chunk)
                        target[part].copy_(host[part], non_blocking=True)

                runs = [run(compute, copies, side) for _ in range(args.repeats)]
                copy_ms = statistics.median(r[1] for r in runs)
                beside = statistics.median(r[0] for r in runs) if compute is not None else 0.0
                rate = count * chunk / (copy_ms / 1e3) / 1e9
                print(f"| {family} | {name} | {chunk_mib} | {rate:.1f} | {alone:.1f} | {beside:.1f} |",
                      flush=True)
        del eager, replay
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

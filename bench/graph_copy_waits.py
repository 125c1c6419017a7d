"""Which dependency slows the ring's copies inside a captured call: a study, not a benchmark of the product.

    python3 bench/graph_copy_waits.py [--out DIR]

Inside the CUDA graph of a whole call, the stream ring's pinned copies run at about 50 GB/s where the same
copies queued eagerly run at 55 (bench/replay_trace.py). This program traces one graph replay (as
replay_trace.py does) of SD1.5 at 1103 MiB and SDXL at 388 MiB with the runtime patched in these ways:

- "no copy waits": copies wait for no compute (their ring bytes may be overwritten while still read: the
  outputs are WRONG; it shows what the waits cost);
- "last wait only": each copy waits only for the latest segment it overwrites (enough, since the compute
  stream runs segments in order);
- "waits per group of N copies": the first copy of each N waits for the latest segment any of them
  overwrites, the rest for nothing (still correct: the copy stream runs them in order);
- "bridge kernel" / "bridge copy": a one-thread kernel or a 64-byte copy on the copy stream between a
  copy's waits and the copy, so that its direct predecessor in the graph is on its own branch.

Writes graph_copy_waits_rows.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replay_trace  # noqa: E402
from memory import MIB, RESULTS, model_cases, random_weights, unet_inputs  # noqa: E402

from engine.memory import segment_plan, stream_ring  # noqa: E402
from engine.memory.segment_plan import Segment  # noqa: E402

BUDGETS = {"SD1.5": 1103, "SDXL": 388}
PLACE = segment_plan._place_in_ring
COPY_RUNS = stream_ring.StreamRing._copy_runs


def with_waits(choose: Callable[[tuple[int, ...]], tuple[int, ...]]) -> Callable:
    def place(segments: list[Segment], ring: int) -> list[Segment]:
        return [replace(s, waits=choose(s.waits)) for s in PLACE(segments, ring)]

    return place


def grouped_waits(group: int) -> Callable:
    """Streamed segments in groups of up to `group`: the first copy of a group waits for the latest segment
    that any copy of the group overwrites, the others wait for nothing (the copy stream runs them after it).
    A copy that overwrites a segment at or after its group's first starts a new group."""

    def place(segments: list[Segment], ring: int) -> list[Segment]:
        placed = PLACE(segments, ring)
        waits: dict[int, tuple[int, ...]] = {}
        first: Segment | None = None
        members = 0
        for s in (s for s in placed if s.streamed):
            latest = max(s.waits, default=None)
            if first is not None and members < group and (latest is None or latest < first.index):
                merged = max(waits[first.index] + ((latest,) if latest is not None else ()), default=None)
                waits[first.index] = (merged,) if merged is not None else ()
                waits[s.index] = ()
                members += 1
            else:
                first, members = s, 1
                waits[s.index] = (latest,) if latest is not None else ()
        return [replace(s, waits=waits.get(s.index, ())) for s in placed]

    return place


def bridged(bridge: str) -> Callable:
    spare: dict[str, torch.Tensor] = {}

    def copy_runs(ring: stream_ring.StreamRing, layout: object) -> None:
        if bridge == "kernel":
            torch.cuda._sleep(1)
        else:
            if not spare:
                spare["host"] = torch.zeros(64, dtype=torch.uint8).pin_memory()
                spare["device"] = torch.zeros(64, dtype=torch.uint8, device=ring.device)
            spare["device"].copy_(spare["host"], non_blocking=True)
        COPY_RUNS(ring, layout)

    return copy_runs


VARIANTS = {
    "default": (PLACE, COPY_RUNS),
    "no copy waits (wrong outputs)": (with_waits(lambda waits: ()), COPY_RUNS),
    "last wait only": (with_waits(lambda waits: (max(waits),) if waits else ()), COPY_RUNS),
    "waits per group of 4 copies": (grouped_waits(4), COPY_RUNS),
    "waits per group of 16 copies": (grouped_waits(16), COPY_RUNS),
    "bridge kernel": (PLACE, bridged("kernel")),
    "bridge copy": (PLACE, bridged("copy")),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--variants", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    chosen = [v for v in args.variants.split(",") if v] or list(VARIANTS)
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; accepted: {', '.join(VARIANTS)}")
    device = torch.device("cuda")
    rows = []
    for name, config, side in model_cases(False):
        weights = random_weights(config, torch.float16, device)
        inputs = unet_inputs(config, side, torch.float16, device)
        budget = BUDGETS[name.split()[0]] * MIB
        for label in chosen:
            place, copy_runs = VARIANTS[label]
            segment_plan._place_in_ring = place
            stream_ring.StreamRing._copy_runs = copy_runs
            row = replay_trace.trace_point(name, config, weights, inputs, device, budget, None, "auto")
            rows.append({**row, "variant": label})
            replay_trace.print_rows(rows[-1:])
        segment_plan._place_in_ring, stream_ring.StreamRing._copy_runs = PLACE, COPY_RUNS
        del weights, inputs
    print()
    replay_trace.print_rows(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graph_copy_waits_rows.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

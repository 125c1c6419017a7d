"""What streamed buffers taken from the activations' memory pool would gain over the fixed stream ring: a
model, on the H200's measured stage times, of a design not built yet.

    python3 bench/pool_study.py bench/results/stage_profile_cuda_<time>.json [--copy-rate 50]

Today a plan holds resident weights + a fixed ring + the peak workspace within the budget, at every moment.
In the pool design each streamed segment's buffer is allocated (on the compute stream) when its copy is
queued and freed after the segment computes, so streamed bytes in flight share memory with the workspace:
at each segment m, resident + workspace(m) + the buffers alive at m <= budget. Copies are queued in order,
each at the first segment from which that holds until it is consumed, and start once the compute stream
reached that segment. For each budget: the planner's plan modelled by stream_model.step_seconds, the best
pool plan over resident rooms (the same pace of streamed stages) and chunk sizes, and the floor of any plan
(stream_model.floor_seconds, at the copy rate given). Runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plan_study import DEFAULT_BUDGETS, MIB, unet_stage_weights  # noqa: E402

from engine.memory.segment_plan import STREAMED_TIME_SHARE, _segments, _streamed_stages, plan_segments  # noqa: E402
from engine.memory.stream_model import COPY_GAP, SEGMENT_GAP, floor_seconds, step_seconds  # noqa: E402


def pool_seconds(stages: Sequence, weights: Sequence[dict[str, int]], peaks: Sequence[int],
                 seconds: Sequence[float], budget: int, resident_room: int, chunk: int,
                 bandwidth: float) -> tuple[float, int] | None:
    """(modelled seconds, streamed bytes) of the pool design, or None when it does not fit."""
    sizes = [sum(w.values()) for w in weights]
    streamed = _streamed_stages(sizes, resident_room, seconds, chunk)
    segments = _segments(stages, weights, weights, sizes, streamed, chunk, 0, seconds,
                         sum(seconds) / STREAMED_TIME_SHARE)
    resident = sum(s.weight_bytes for s in segments if not s.streamed)
    workspace = [max(peaks[s.start:s.stop]) for s in segments]
    alive = [0] * len(segments)  # bytes of streamed buffers allocated at each segment
    queued_at = {}
    first = 0
    for segment in (s for s in segments if s.streamed):
        end = segment.index
        while any(resident + workspace[m] + alive[m] + segment.weight_bytes > budget
                  for m in range(first, end + 1)):
            first += 1
            if first > end:
                return None
        queued_at[segment.index] = first
        for m in range(first, end + 1):
            alive[m] += segment.weight_bytes
    order = [s for s in segments if s.streamed]
    copied, copy_free, compute, queued = {}, 0.0, 0.0, 0
    for segment in segments:
        while queued < len(order) and queued_at[order[queued].index] <= segment.index:
            copy = order[queued]
            copy_free = max(copy_free, compute) + copy.weight_bytes / bandwidth + COPY_GAP
            copied[copy.index] = copy_free
            queued += 1
        start = max(compute, copied[segment.index]) + SEGMENT_GAP if segment.streamed else compute
        compute = start + sum(seconds[segment.start:segment.stop])
    return max(compute, copy_free), sum(s.weight_bytes for s in order)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--copy-rate", type=float, default=50.0, help="GB/s of the modelled copies")
    args = parser.parse_args()
    bandwidth = args.copy_rate * 1e9
    for profile in json.loads(args.profile.read_text())["models"]:
        name = profile["model"]
        stages, weights = unet_stage_weights(name)
        measured = profile["stages"]
        scale = profile["resident_ms"] / 1e3 / sum(r["ms"] / 1e3 for r in measured)
        seconds = [r["ms"] / 1e3 * scale for r in measured]
        peaks = [r["workspace_bytes"] for r in measured]
        sizes = [sum(w.values()) for w in weights]
        workspace = max(peaks) + min(4 * MIB, max(peaks) // 16)
        print(f"\n{name}, copies at {args.copy_rate:.0f} GB/s")
        print("| budget MiB | ring plan ms | pool plan ms | pool resident MiB | pool streamed MiB "
              "| floor ms |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for budget_mib in DEFAULT_BUDGETS["SD1.5" if name.startswith("SD1") else "SDXL"]:
            budget = budget_mib * MIB
            ring = step_seconds(plan_segments(stages, weights, workspace, budget, (), seconds,
                                              bandwidth=bandwidth), seconds, bandwidth)
            room, best = budget - max(peaks), None
            for share in range(40):
                for chunk in (16 * MIB, 32 * MIB, 64 * MIB):
                    result = pool_seconds(stages, weights, peaks, seconds, budget, room * share // 40,
                                          max(chunk, max(sizes)), bandwidth)
                    if result is not None and (best is None or result[0] < best[0]):
                        best = (result[0], room * share // 40, result[1])
            floor = floor_seconds(seconds, sizes, peaks, budget, bandwidth)
            pool = "| - | - | -" if best is None else \
                f"| {best[0] * 1e3:.1f} | {best[1] / MIB:.0f} | {best[2] / MIB:.0f}"
            print(f"| {budget_mib} | {ring * 1e3:.1f} {pool} | {floor * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

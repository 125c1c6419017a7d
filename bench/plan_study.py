"""Replay measured stage times through the segment planner and a model of the copy and compute streams,
to study plans offline (on any machine) before measuring them on a GPU.

    python3 bench/plan_study.py bench/results/stage_profile_cuda_<time>.json [--budgets 388,1296,...]

For each model of the profile (written by bench/stage_profile.py) and each budget, the planner of
engine/memory/segment_plan.py makes its default plan and the plan it chooses given a copy rate
(--copy-rate), and engine/memory/stream_model.py runs one call of each: copies queue in order on one copy
engine, each after the compute of the segments whose ring bytes it overwrites; a streamed segment computes
after its copy and the segment before it. The table gives the modelled step times beside the physical
line of bench/memory.py
(max(resident step, bytes that cannot stay resident / bandwidth)) and a plan-only lower bound (no ring
limit): max over streamed segments j of (bytes streamed up to j / bandwidth + compute from j to the end),
and the floor of any plan within the budget at the measured bandwidth (stream_model.floor_seconds: the
physical line, raised where the budget cannot hold what the heavy middle stages need prefetched).
Stage times are the profile's, scaled so that they sum to the resident step time (a graph replay).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.memory.ledger import BudgetExceeded  # noqa: E402
from engine.memory.segment_plan import SegmentPlan, plan_segments  # noqa: E402
from engine.memory.stream_model import POLLED_SEGMENT_GAP, floor_seconds, step_seconds  # noqa: E402
from engine.models.unet import UNetModel, sd15_unet_config, sdxl_unet_config  # noqa: E402

MIB = 1024**2
DEFAULT_BUDGETS = {"SD1.5": [155, 214, 471, 787, 1103, 1419], "SDXL": [331, 388, 1296, 2264, 3231, 4199]}


def unet_stage_weights(model: str) -> tuple[list, list[dict[str, int]]]:
    config = sd15_unet_config() if model.startswith("SD1") else sdxl_unet_config()
    unet = UNetModel(config, dtype=torch.float16, device="meta")
    names = {id(p): n for n, p in unet.named_parameters()}
    stages = unet.stages()
    weights = [{names[id(p)]: p.numel() * p.element_size() for p in stage.parameters()} for stage in stages]
    return stages, weights


def plan_bound(plan: SegmentPlan, seconds: list[float], bandwidth: float) -> float:
    """The plan's step time with an unlimited ring (see the module docstring)."""
    total, before, streamed, bound = sum(seconds), 0.0, 0, 0.0
    for segment in plan.segments:
        if segment.streamed:
            streamed += segment.ring_bytes
            bound = max(bound, streamed / bandwidth + total - before)
        before += sum(seconds[segment.start : segment.stop])
    return max(bound, total)


def study(profile: dict, bandwidth: float, budgets: list[int] | None, copy_rate: float, gap: float) -> None:
    name = profile["model"]
    stages, weights = unet_stage_weights(name)
    measured = profile["stages"]
    if [r["stage"] for r in measured] != [s.name for s in stages]:
        raise SystemExit(f"{name}: the profile's stages are not this checkout's UNet stages (re-profile)")
    scale = profile["resident_ms"] / 1e3 / sum(r["ms"] / 1e3 for r in measured)
    seconds = [r["ms"] / 1e3 * scale for r in measured]
    peak = max(r["workspace_bytes"] for r in measured)
    workspace = peak + min(4 * MIB, peak // 16)  # as the runner pads a measured workspace
    total = sum(n for w in weights for n in w.values())
    print(f"\n{name}: {len(stages)} stages, resident {profile['resident_ms']:.1f} ms, workspace "
          f"{workspace / MIB:.1f} MiB, copy {bandwidth / 1e9:.1f} GB/s (modelled copies at "
          f"{copy_rate / 1e9:.1f})")
    print("| budget MiB | default ring MiB | modelled ms | chosen ring MiB | streamed MiB | segments "
          "| modelled ms | plan bound ms | physical ms | modelled / physical | floor ms | floor / physical |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    sizes = [sum(w.values()) for w in weights]
    peaks = [r["workspace_bytes"] for r in measured]
    family = "SD1.5" if name.startswith("SD1") else "SDXL"
    for budget_mib in budgets or DEFAULT_BUDGETS[family]:
        budget = budget_mib * MIB
        try:
            default = plan_segments(stages, weights, workspace, budget, (), seconds)
            plan = plan_segments(stages, weights, workspace, budget, (), seconds, bandwidth=copy_rate,
                                 segment_gap=gap)
        except BudgetExceeded:
            print(f"| {budget_mib} | infeasible | | | | | | | | | | |")
            continue
        modelled = step_seconds(plan, seconds, copy_rate, gap)
        physical = max(sum(seconds), max(0, total + workspace - budget) / bandwidth)
        streamed = sum(s.ring_bytes for s in plan.segments if s.streamed)
        floor = floor_seconds(seconds, sizes, peaks, budget, bandwidth)
        print(f"| {budget_mib} | {default.ring_bytes / MIB:.0f} | "
              f"{step_seconds(default, seconds, copy_rate, gap) * 1e3:.1f} | {plan.ring_bytes / MIB:.0f} | "
              f"{streamed / MIB:.0f} | {len(plan.segments)} | {modelled * 1e3:.1f} | "
              f"{plan_bound(plan, seconds, copy_rate) * 1e3:.1f} | {physical * 1e3:.1f} | "
              f"{modelled / physical:.2f} | {floor * 1e3:.1f} | {floor / physical:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="a stage_profile_*.json of bench/stage_profile.py")
    parser.add_argument("--budgets", default="", help="comma-separated budgets in MiB (default: a sweep)")
    parser.add_argument("--copy-rate", type=float, default=None,
                        help="GB/s of the modelled copies (default: the profile's probe, the rate of a "
                             "captured call whose compute polls copy flags; 0.91 of it where it waits for "
                             "events)")
    parser.add_argument("--segment-gap-us", type=float, default=POLLED_SEGMENT_GAP * 1e6,
                        help="us a streamed segment costs compute (2 polling flags, 14 waiting for events)")
    args = parser.parse_args()
    data = json.loads(args.profile.read_text())
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()] or None
    for profile in data["models"]:
        rate = args.copy_rate * 1e9 if args.copy_rate else data["bandwidth"]
        study(profile, data["bandwidth"], budgets, rate, args.segment_gap_us * 1e-6)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The planner's real segment plans replayed with spin kernels in place of the UNet's compute: do the copies
slow down inside a CUDA graph because of the plan's dependency structure, or because of the UNet's kernels?

    python3 bench/plan_replay_toy.py bench/results/stage_profile_cuda_<time>.json \
        [--points "SDXL:388,SD1.5:1103"] [--variant STREAMED_TIME_SHARE=0]

For each point the planner (engine/memory/segment_plan.py, with the profile's stage times and workspace as
bench/plan_study.py uses them) makes its plan; the toy then runs it the way the segment runner does: one
ring of the plan's size, each streamed segment's bytes copied from its own span of one pinned buffer on a
side stream, after the compute of the segments it overwrites, the compute of a streamed segment after its
copy. Each stage's compute is one spin kernel (`torch.cuda._sleep`, no memory traffic) of the stage's
measured time, or with --real the UNet's own stage on random weights resident on the device (the copies
then move the plan's bytes into a ring that no stage reads): do the UNet's kernels slow the copies down
without the weight store and the runner? Eagerly and as one captured graph, it prints ms per call and, from
the profiler's timeline of one call, the copies' rate while the copy engine was busy (bench/replay_trace.py's
figures).

--waits picks how the two streams wait for each other: `events` (the runner's way: a copy waits for the
events of the segments whose ring bytes it overwrites, a streamed segment for its copy's event; inside a
graph these become edges between the copy and compute branches), `copy` or `compute` (only that side
waits), `none` (neither: wrong bytes, for the rate alone), or `flags`: the same waits through flags in
device memory, each set by a one-thread kernel after a segment's compute or a copy, and polled on the other
stream by the runner's one-thread kernel (engine/memory/flag_poll.py), so that the captured graph holds two
chains with no edges between them.
`relay_kernel` and `relay_copy` are `events` with the copy's event recorded after a one-thread kernel or a
4-byte device copy that follows the copy, so that in a graph the edge to compute leaves that node and not
the copy; `hybrid` has copies wait for events, and compute poll a flag that a 4-byte copy from pinned memory
sets after each copy (the copy branch then holds copies alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory import graphed, random_weights, time_step, unet_inputs  # noqa: E402
from plan_study import unet_stage_weights  # noqa: E402
from replay_trace import profiled, timeline  # noqa: E402

from engine.memory import segment_plan  # noqa: E402
from engine.memory.flag_poll import poll  # noqa: E402
from engine.memory.segment_plan import SegmentPlan, plan_segments  # noqa: E402
from engine.models.staged import Stage, State  # noqa: E402
from engine.models.unet import UNetModel, sd15_unet_config, sdxl_unet_config  # noqa: E402

MIB = 1024**2
WAITS = ("events", "copy", "compute", "none", "flags", "relay_kernel", "relay_copy", "hybrid")


@triton.jit
def _raise(flags, index):
    tl.store(flags + index, 1)


def raise_flag(flags: torch.Tensor, index: int) -> None:
    _raise[(1,)](flags, index, num_warps=1)


def spin_rate(device: torch.device) -> float:
    """Cycles per second of torch.cuda._sleep's loop."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1e3)


def plan_for(profile: dict, budget: int) -> tuple[SegmentPlan, list[float]]:
    stages, weights = unet_stage_weights(profile["model"])
    measured = profile["stages"]
    scale = profile["resident_ms"] / 1e3 / sum(r["ms"] / 1e3 for r in measured)
    seconds = [r["ms"] / 1e3 * scale for r in measured]
    peak = max(r["workspace_bytes"] for r in measured)
    workspace = peak + min(4 * MIB, peak // 16)
    return plan_segments(stages, weights, workspace, budget, (), seconds, bandwidth=50e9), seconds


def real_unet(family: str, device: torch.device) -> tuple[list[Stage], Callable[[], State]]:
    """The UNet's stages on random fp16 weights resident on `device`, and its initial state's maker."""
    config, side = (sd15_unet_config(), 64) if family == "SD1.5" else (sdxl_unet_config(), 128)
    unet = UNetModel(config, dtype=torch.float16, device=device)
    unet.load_state_dict(random_weights(config, torch.float16, device))
    inputs = unet_inputs(config, side, torch.float16, device)
    return unet.stages(), lambda: unet.initial_state(*inputs)


def toy_call(plan: SegmentPlan, cycles: list[int], ring: torch.Tensor, host: torch.Tensor,
             spans: dict[int, int], copy_stream: torch.cuda.Stream,
             real: tuple[list[Stage], Callable[[], State]] | None = None, waits: str = "events"
             ) -> Callable[[], None]:
    """One call of `plan`: spin kernels of `cycles` per stage, or the `real` stages and initial state; the
    streams wait for each other as `waits` says (see the module docstring)."""
    streamed = [s for s in plan.segments if s.streamed]
    count = len(plan.segments)
    flags = torch.zeros(2 * count, dtype=torch.int32, device=ring.device)  # computed[0:count], copied[count:]
    one_host = torch.ones(1, dtype=torch.int32).pin_memory()
    one_device = torch.ones(1, dtype=torch.int32, device=ring.device)

    def call() -> None:
        state = real[1]() if real is not None else None
        compute = torch.cuda.current_stream()
        if waits in ("flags", "hybrid"):
            flags.zero_()
        copy_stream.wait_stream(compute)
        done: dict[int, torch.cuda.Event] = {}
        copied: dict[int, torch.cuda.Event] = {}
        queued = 0
        for segment in plan.segments:
            while queued < len(streamed) and all(w < segment.index for w in streamed[queued].waits):
                copy = streamed[queued]
                with torch.cuda.stream(copy_stream):
                    for waited in copy.waits:
                        if waits == "flags":
                            poll(flags, waited)
                        elif waits not in ("compute", "none"):
                            copy_stream.wait_event(done[waited])
                    start = spans[copy.index]
                    ring[copy.ring_offset: copy.ring_offset + copy.ring_bytes].copy_(
                        host[start: start + copy.ring_bytes], non_blocking=True)
                    flag = flags[count + copy.index : count + copy.index + 1]
                    if waits in ("flags", "relay_kernel"):
                        raise_flag(flags, count + copy.index)
                    elif waits in ("relay_copy", "hybrid"):
                        flag.copy_(one_device if waits == "relay_copy" else one_host, non_blocking=True)
                    copied[copy.index] = torch.cuda.Event()
                    copied[copy.index].record(copy_stream)
                queued += 1
            if segment.streamed and waits in ("flags", "hybrid"):
                poll(flags, count + segment.index)
            elif segment.streamed and waits not in ("copy", "none"):
                compute.wait_event(copied[segment.index])
            for stage in range(segment.start, segment.stop):
                if real is not None:
                    state = real[0][stage].run(state)
                else:
                    torch.cuda._sleep(cycles[stage])
            if waits == "flags":
                raise_flag(flags, segment.index)
            done[segment.index] = torch.cuda.Event()
            done[segment.index].record(compute)
        compute.wait_stream(copy_stream)

    return call


def measure(device: torch.device, call: Callable[[], None], calls: int = 10) -> tuple[float, dict]:
    """(median ms of `calls` calls after two warm-up calls, replay_trace's figures of one more)."""
    for _ in range(2):
        call()
    ms = statistics.median(time_step(device, call) for _ in range(calls))
    return ms, timeline(profiled(device, call))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--points", default="SDXL:388,SD1.5:1103")
    parser.add_argument("--variant", action="append", default=[], help="CONSTANT=value of segment_plan.py")
    parser.add_argument("--real", action="store_true",
                        help="the UNet's own stages on resident random weights instead of spin kernels")
    parser.add_argument("--waits", default="events", help=f"comma-separated, of: {', '.join(WAITS)}")
    args = parser.parse_args()
    for waits in args.waits.split(","):
        if waits not in WAITS:
            parser.error(f"unknown --waits {waits!r}; accepted: {', '.join(WAITS)}")
    profiles = {p["model"].split()[0]: p for p in json.loads(args.profile.read_text())["models"]}
    variants = [("default", {})]
    variants += [(v, dict(a.partition("=")[::2] for a in v.split(","))) for v in args.variant]
    for _, change in variants:
        for name, value in change.items():
            if not isinstance(getattr(segment_plan, name, None), int) or not value.isdigit():
                parser.error(f"bad assignment {name}={value!r}; accepted: a segment_plan.py constant = an "
                             "integer")
    device = torch.device("cuda")
    rate = spin_rate(device)
    copy_stream = torch.cuda.Stream(device)
    print(f"compute: {'the UNet stages' if args.real else 'spin kernels'}")
    print("| point | variant | waits | mode | segments | copies | ms / call | copy busy ms "
          "| copies GB/s while busy | compute ms |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    defaults = {name: getattr(segment_plan, name) for _, change in variants for name in change}
    for point in args.points.split(","):
        family, _, budget = point.partition(":")
        if family not in profiles or not budget.isdigit():
            parser.error(f"bad point {point!r}; accepted: MODEL:MiB with MODEL one of {sorted(profiles)}")
        for label, change in variants:
            for name, value in defaults.items():
                setattr(segment_plan, name, value)
            for name, value in change.items():
                setattr(segment_plan, name, int(value))
            plan, seconds = plan_for(profiles[family], int(budget) * MIB)
            cycles = [int(s * rate) for s in seconds]
            spans, total = {}, 0
            for segment in plan.segments:
                if segment.streamed:
                    spans[segment.index] = total
                    total += segment.ring_bytes
            host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            ring = torch.empty(plan.ring_bytes, dtype=torch.uint8, device=device)
            real = real_unet(family, device) if args.real else None
            for waits in args.waits.split(","):
                call = toy_call(plan, cycles, ring, host, spans, copy_stream, real, waits)
                for mode in ("eager", "graph"):
                    ms, figures = measure(device, graphed(device, call) if mode == "graph" else call)
                    print(f"| {point} | {label} | {waits} | {mode} | {len(plan.segments)} | {len(spans)} | "
                          f"{ms:.2f} | {figures.get('copy_busy_ms', 0):.2f} | "
                          f"{figures.get('copy_gbps', 0):.1f} | {figures.get('compute_ms', 0):.2f} |",
                          flush=True)
            del host, ring, real
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

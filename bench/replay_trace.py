"""Where a budgeted step's time goes: the GPU timeline of one CUDA-graph replay, from the profiler.

    python3 bench/replay_trace.py [--points "SD1.5:1103,SDXL:388"] [--variant RING_TARGET=64] [--out DIR]

For each point (model and budget in MiB), the runtime runs the UNet with weights in pinned RAM until its
call is a captured graph, then one replay runs under torch.profiler. From the GPU's own timestamps:

- copies: how many, bytes, time the copy engine was busy and the bandwidth while busy, idle gaps;
- compute: time some kernel ran (union of kernel intervals);
- compute idle while a copy ran (compute waits for bytes: copy-bound), and while none ran (latency between
  streams, launch gaps);
- copy idle while compute ran (the ring is full, or nothing is left to copy).

Each --variant sets constants of engine/memory/segment_plan.py (`A=1,B=2`; MiB for RING_TARGET), POLL
(on|off: whether a captured call's compute polls copy flags, engine/memory/copy_flags.py) or GRAPHS
(--cuda-graphs) for another run of every point, so that one GPU session compares plans. Writes the first
point's Chrome trace to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory import (  # noqa: E402
    MIB,
    RESULTS,
    _compute,
    copy_bandwidth,
    model_cases,
    random_weights,
    registered_unet,
    release_garbage,
    time_step,
    unet_inputs,
)

from engine.memory import copy_flags, segment_plan  # noqa: E402
from engine.memory.ledger import BudgetExceeded, live_free_memory  # noqa: E402

Interval = tuple[float, float]  # (start, end) in microseconds


def union(intervals: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def gaps(busy: list[Interval], span: Interval) -> list[Interval]:
    out, cursor = [], span[0]
    for start, end in busy:
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, end)
    if span[1] > cursor:
        out.append((cursor, span[1]))
    return out


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(trace: dict) -> dict:
    """Copy and compute figures of one replay's Chrome trace."""
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    copies = [e for e in trace["traceEvents"] if e.get("cat") == "gpu_memcpy"]
    h2d = [e for e in copies if "HtoD" in e.get("name", "")]
    copy_busy = union([(e["ts"], e["ts"] + e["dur"]) for e in h2d])
    compute = union(kernels)
    everything = compute + copy_busy
    if not everything:
        return {}
    span = (min(a for a, _ in everything), max(b for _, b in everything))
    compute_idle, copy_idle = gaps(compute, span), gaps(copy_busy, span)
    moved = sum(e.get("args", {}).get("bytes", 0) for e in h2d)
    busy = sum(b - a for a, b in copy_busy)
    small = [e for e in h2d if e.get("args", {}).get("bytes", 0) < MIB]
    return {
        "span_ms": (span[1] - span[0]) / 1e3,
        "kernels": len(kernels),
        "copies": len(h2d),
        "copied_mib": moved / MIB,
        "copy_busy_ms": busy / 1e3,
        "copy_gbps": moved / max(busy, 1e-9) / 1e3,
        "small_copies": len(small),
        "small_copy_us": statistics.median([e["dur"] for e in small]) if small else 0.0,
        "compute_ms": sum(b - a for a, b in compute) / 1e3,
        "compute_wait_copy_ms": overlap(compute_idle, copy_busy) / 1e3,
        "compute_wait_other_ms": sum(b - a for a, b in compute_idle) / 1e3
        - overlap(compute_idle, copy_busy) / 1e3,
        "copy_idle_under_compute_ms": overlap(copy_idle, compute) / 1e3,
        "copy_idle_tail_ms": (span[1] - copy_busy[-1][1]) / 1e3 if copy_busy else 0.0,
        "copy_idle_head_ms": (copy_busy[0][0] - span[0]) / 1e3 if copy_busy else 0.0,
        # per copy: start, duration (us), bytes, the share of it that some kernel ran beside, and the kernel
        # that ran beside it longest (does compute slow the copy engine down?)
        "copy_events": [(e["ts"] - span[0], e["dur"], e.get("args", {}).get("bytes", 0),
                         overlap([(e["ts"], e["ts"] + e["dur"])], compute) / max(e["dur"], 1e-9),
                         _longest_beside(e, trace)) for e in h2d],
    }


def _longest_beside(copy: dict, trace: dict) -> str:
    """The name of the kernel that ran longest during `copy` ('' when none ran)."""
    start, end = copy["ts"], copy["ts"] + copy["dur"]
    best, name = 0.0, ""
    for event in trace["traceEvents"]:
        if event.get("cat") == "kernel":
            shared = min(end, event["ts"] + event["dur"]) - max(start, event["ts"])
            if shared > best:
                best, name = shared, event.get("name", "")[:60]
    return name


def profiled(device: torch.device, call: Callable[[], object]) -> dict:
    """The Chrome trace (CUDA activity) of one `call`, as a dict."""
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        call()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def trace_point(name: str, config: object, weights: dict, inputs: tuple, device: torch.device, budget: int,
                keep: Path | None, graphs: str) -> dict:
    release_garbage(device)
    runtime, module, unet, _, _ = registered_unet(config, weights, device, "cpu", budget,
                                                  live_free_memory(_compute(device)), graphs)
    try:
        def step() -> object:
            return runtime.run(module, unet, unet.stages(), unet.initial_state(*inputs))["h"]

        for _ in range(5):  # measuring calls, the steady call, the capture
            step()
        step_ms = statistics.median(time_step(device, step) for _ in range(10))
        trace = profiled(device, step)
        if keep is not None:
            keep.write_text(json.dumps(trace))
        plan = runtime.snapshot()["modules"][module]["plan"]
        streamed = sum(1 for s in plan["segments"] if s["streamed"])
        return {"model": name, "budget_mib": budget / MIB, "step_ms": step_ms,
                "ring_mib": plan["ring_bytes"] / MIB, "segments": len(plan["segments"]), "streamed": streamed,
                **timeline(trace)}
    finally:
        runtime.unregister(module)


COLUMNS = ["step_ms", "span_ms", "segments", "streamed", "ring_mib", "copies", "copied_mib", "copy_busy_ms",
           "copy_gbps", "small_copies", "small_copy_us", "compute_ms", "compute_wait_copy_ms",
           "compute_wait_other_ms", "copy_idle_under_compute_ms", "copy_idle_head_ms", "copy_idle_tail_ms"]


def print_rows(rows: list[dict]) -> None:
    print("| point | variant | " + " | ".join(COLUMNS) + " |")
    print("| --- | --- |" + " ---: |" * len(COLUMNS))
    for row in rows:
        cells = [f"{row[c]:.2f}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in COLUMNS]
        print(f"| {row['model']} {row['budget_mib']:.0f} | {row['variant']} | " + " | ".join(cells) + " |",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="SD1.5:787,SD1.5:1103,SDXL:388,SDXL:2264")
    parser.add_argument("--variant", action="append", default=[], help="CONSTANT=value (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    wanted: dict[str, list[int]] = {}
    for point in args.points.split(","):
        family, _, budget = point.partition(":")
        if family not in ("SD1.5", "SDXL") or not budget.isdigit():
            parser.error(f"bad point {point!r} in --points; accepted: SD1.5:MiB or SDXL:MiB, e.g. SDXL:388")
        wanted.setdefault(family, []).append(int(budget))
    variants = [("default", {})]
    for variant in args.variant:
        change = dict(a.partition("=")[::2] for a in variant.split(","))
        for name, value in change.items():
            if name == "GRAPHS":
                good = value in ("on", "off", "auto")
            elif name == "POLL":
                good = value in ("on", "off")
            else:
                number = value.replace(".", "", 1).isdigit()
                good = number and isinstance(getattr(segment_plan, name, None), int)
            if not good:
                parser.error(f"bad assignment {name}={value!r} in --variant; accepted: GRAPHS=on|off|auto, "
                             "POLL=on|off or RING_TARGET, RING_SHARE, RING_CHUNKS, STREAMED_TIME_SHARE = "
                             "a number")
        variants.append((variant, change))
    device = torch.device("cuda")
    print(f"copy bandwidth {copy_bandwidth(device) / 1e9:.1f} GB/s", flush=True)
    defaults = {name: getattr(segment_plan, name)
                for _, change in variants for name in change if name not in ("GRAPHS", "POLL")}
    rows, keep = [], args.out / "replay_trace.json"
    args.out.mkdir(parents=True, exist_ok=True)
    for name, config, side in model_cases(False):
        family = name.split()[0]
        if family not in wanted:
            continue
        weights = random_weights(config, torch.float16, device)
        inputs = unet_inputs(config, side, torch.float16, device)
        for budget in wanted[family]:
            for label, change in variants:
                for constant, value in defaults.items():
                    setattr(segment_plan, constant, value)
                for constant, value in change.items():
                    if constant in ("GRAPHS", "POLL"):
                        continue
                    scale = MIB if constant == "RING_TARGET" else 1
                    setattr(segment_plan, constant, int(float(value) * scale))
                copy_flags.ENABLED = change.get("POLL", "on") == "on"
                try:
                    row = trace_point(name, config, weights, inputs, device, budget * MIB, keep,
                                      change.get("GRAPHS", "auto"))
                except BudgetExceeded as error:
                    print(f"{name} {budget} MiB {label}: infeasible ({error})", flush=True)
                    continue
                keep = None
                rows.append({**row, "variant": label})
                print_rows(rows[-1:])
        del weights, inputs
    print()
    print_rows(rows)
    (args.out / "replay_trace_rows.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

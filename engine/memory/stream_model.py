"""A model of one call of a segment plan on a copy engine and a compute stream, to choose between plans.

The runner (segments.py) queues each streamed segment's copy as soon as the segments whose ring bytes it
overwrites (`Segment.waits`) have been queued for compute; the copy engine runs copies in order, each after
its bytes arrive at `bandwidth` plus COPY_GAP and after the compute of the segments it waits for; a segment
computes after the one before it and, when streamed, after its copy. The call takes until both streams are
done. With the stage times of the H200's graph-replayed steps and the copy rate seen inside those graphs (50
GB/s), this predicts measured SD1.5 and SDXL budgeted steps within 4% (bench/results/: the default-ring
columns of plan_study_20261130_s12_ring_choices.log against replay_trace_cuda_20261130_s12_b_*.log).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # segment_plan.py imports this module to choose between its plans
    from engine.memory.segment_plan import SegmentPlan

COPY_GAP = 5e-6  # seconds between two copies on the copy engine (measured: 2 to 4 us, plus launch)
PROBE_BYTES = 16 * 1024**2  # within 1% of a 256 MiB copy's rate on the H200 (bench/copy_rate.py)
_BANDWIDTH: dict[int, float] = {}  # CUDA device index -> pinned host-to-device bytes per second


def step_seconds(plan: SegmentPlan, stage_seconds: Sequence[float], bandwidth: float) -> float:
    """Modelled seconds of one call of `plan` (see the module docstring)."""
    if plan.whole:
        return sum(stage_seconds)
    streamed = [s for s in plan.segments if s.streamed]
    done: dict[int, float] = {}
    copied: dict[int, float] = {}
    copy_free = compute = 0.0
    queued = 0
    for segment in plan.segments:
        while queued < len(streamed) and all(w < segment.index for w in streamed[queued].waits):
            copy = streamed[queued]
            start = max([copy_free] + [done[w] for w in copy.waits])
            copy_free = copied[copy.index] = start + copy.ring_bytes / bandwidth + COPY_GAP
            queued += 1
        start = max(compute, copied[segment.index]) if segment.streamed else compute
        compute = done[segment.index] = start + sum(stage_seconds[segment.start : segment.stop])
    return max(compute, copy_free)


def copy_bandwidth(device: torch.device) -> float | None:
    """Pinned host-to-device bytes per second of a CUDA device, measured once per process (the best of
    three 16 MiB copies, into 16 MiB of device memory that the caching allocator keeps for later use, outside
    any ledger); None for other devices, whose copies do not overlap compute."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _BANDWIDTH:
        host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
        target = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        _BANDWIDTH[index] = PROBE_BYTES / max(best, 1e-9)
    return _BANDWIDTH[index]

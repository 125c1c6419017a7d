"""A model of one call of a segment plan on a copy engine and a compute stream, to choose between plans.

The runner (segments.py) queues each streamed segment's copy as soon as the segments whose ring bytes it
overwrites (`Segment.waits`) have been queued for compute; the copy engine runs copies in order, each after
its bytes arrive at `bandwidth` plus COPY_GAP and after the compute of the segments it waits for; a segment
computes after the one before it and, when streamed, after its copy and a per-segment gap (`call_rates`:
how long its wait takes). The call takes until both streams are done. With the stage times the runner
measures, the rate and gap of polled replays predicted the copy-bound steps of bench/memory.py on the H200
within 3.5%, and put SD1.5's near-full ones 5 to 7% low (bench/results/memory_cuda_20261130_075727.log,
"modelled" beside each plan). With events, at 0.91
of the rate, it predicted the copy-bound steps within 4% (session 12) and missed the compute-bound ones
until SEGMENT_GAP (SD1.5 at 1418 MiB: 12.3 ms modelled, 13.7 measured; 13.4 with the gap).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.memory import profile_cache
from engine.memory.copy_flags import CopyFlags

if TYPE_CHECKING:  # segment_plan.py imports this module to choose between its plans
    from engine.memory.segment_plan import SegmentPlan

COPY_GAP = 5e-6  # seconds between two copies on the copy engine (measured: 2 to 4 us, plus launch)
# seconds a streamed segment costs the compute stream in a graph replay that waits for the copy's event (even
# when the copy is done): SD1.5 at 1418 MiB on the H200 idled compute 1.1 ms beyond its first wait over 79
# streamed segments (bench/results/replay_trace_cuda_20261130_s13_compute_bound.log)
SEGMENT_GAP = 14e-6
# the same where compute polls the copy's flag (copy_flags.py): a poll that finds its flag set takes 1.1 us,
# with no gap around it (SD1.5 at 1103 MiB on the H200, bench/results/replay_trace_cuda_20261130_s14_poll.*)
POLLED_SEGMENT_GAP = 2e-6
# the ring's copies inside a captured call whose compute waits for their events run at about this share of
# the probe's rate: 49 to 51 GB/s against 55 on the H200 (bench/results/
# replay_trace_cuda_20261130_s13_time_share_sweep.log); the events' edges from the copy branch to the compute
# branch do it: polled flags give 55 (bench/results/plan_replay_relays_cuda_20261130_s14.log)
GRAPH_COPY_SHARE = 0.91
PROBE = "pinned_copy_rate"  # the profile cache's name for copy_bandwidth's measurement
PROBE_BYTES = 16 * 1024**2  # within 1% of a 256 MiB copy's rate on the H200 (copy_rate_cuda_20261130_s12.log)
_BANDWIDTH: dict[int, float] = {}  # CUDA device index -> pinned host-to-device bytes per second


def step_seconds(plan: SegmentPlan, stage_seconds: Sequence[float], bandwidth: float,
                 segment_gap: float = SEGMENT_GAP) -> float:
    """Modelled seconds of one call of `plan` (see the module docstring), each streamed segment costing the
    compute stream `segment_gap`."""
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
        start = max(compute, copied[segment.index]) + segment_gap if segment.streamed else compute
        compute = done[segment.index] = start + sum(stage_seconds[segment.start : segment.stop])
    return max(compute, copy_free)


def call_rates(device: torch.device, graphs: bool) -> tuple[float | None, float]:
    """(copy bytes per second, seconds per streamed segment) of the calls a runner makes on `device`: the
    probe's rate and SEGMENT_GAP eagerly; in captured calls the same rate and POLLED_SEGMENT_GAP where compute
    polls copy flags, else GRAPH_COPY_SHARE of the rate. The rate is None off CUDA."""
    bandwidth = copy_bandwidth(device)
    if bandwidth is None or not graphs:
        return bandwidth, SEGMENT_GAP
    if CopyFlags.ready(device):
        return bandwidth, POLLED_SEGMENT_GAP
    return bandwidth * GRAPH_COPY_SHARE, SEGMENT_GAP


def copy_bandwidth(device: torch.device) -> float | None:
    """Pinned host-to-device bytes per second of a CUDA device, measured once per process (the best of
    three 16 MiB copies, into 16 MiB of device memory that the caching allocator keeps for later use, outside
    any ledger), or read from the profile cache where an earlier process measured it; None for other
    devices, whose copies do not overlap compute."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _BANDWIDTH:
        device = torch.device("cuda", index)
        cached = profile_cache.read_probe(PROBE, device, torch.uint8, bytes=PROBE_BYTES)
        if isinstance(cached, float) and cached > 0:
            _BANDWIDTH[index] = cached
        else:
            host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
            target = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
            _BANDWIDTH[index] = pinned_copy_rate(host, target)
            profile_cache.write_probe(PROBE, device, torch.uint8, _BANDWIDTH[index], bytes=PROBE_BYTES)
    return _BANDWIDTH[index]


def pinned_copy_rate(host: torch.Tensor, target: torch.Tensor, repeats: int = 3) -> float:
    """Bytes per second of copying pinned `host` into CUDA `target` (the best of `repeats` copies)."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return host.numel() * host.element_size() / max(best, 1e-9)


def floor_seconds(
    stage_seconds: Sequence[float],
    stage_bytes: Sequence[int],
    stage_workspace: Sequence[int],
    budget: int,
    bandwidth: float,
) -> float:
    """A lower bound on the seconds of one call, repeated, of any plan of these stages within `budget`.

    `stage_bytes[i]`: the weight bytes stage i reads (that are not on the device for good);
    `stage_workspace[i]`: the peak bytes it allocates besides weights; `budget`: bytes for weights and
    workspace. Whatever stays resident, however the copies are ordered, sized and buffered (across calls
    too), one copy engine moving `bandwidth` bytes per second and the budget held at every moment give:

    - the physical line: max(all compute, (weights + the peak workspace - budget) / bandwidth);
    - for every window H of consecutive stages (cyclically) and L the stages before it: at the moment a
      stage s of L peaks, the bytes already on the device for H are at most budget - its workspace -
      what is resident; the copy engine adds `bandwidth` bytes per second from then until H starts.
      So at least bytes(H) - budget + max over s of (workspace(s) - bandwidth x compute from s to H's
      start) arrive while H runs, and a call takes at least compute(L) + max(compute(H), that /
      bandwidth).

    A UNet keeps most of its weights in its low-resolution middle and spends most of its compute at full
    resolution, where its workspace peaks: the bytes the middle streams cannot be prefetched during the
    full-resolution stages beyond what the budget leaves, so at middle budgets this floor lies well above
    the physical line (SD1.5 at 1100 MiB: 1.2x on the H200, bench/results/floor_*.log). O(stages^2).
    """
    count = len(stage_seconds)
    if not (len(stage_bytes) == len(stage_workspace) == count):
        raise ValueError(f"{count} stage times but {len(stage_bytes)} byte counts and "
                         f"{len(stage_workspace)} workspace peaks")
    compute = sum(stage_seconds)
    best = max(compute, (sum(stage_bytes) + max(stage_workspace, default=0) - budget) / bandwidth)
    for start in range(count):  # H begins at stage `start`; L is the stages before it, nearest first
        worst, elapsed, running = [], 0.0, 0.0  # worst[k-1]: the max over L's k nearest stages (and 0)
        for back in range(1, count):
            stage = (start - back) % count
            elapsed += stage_seconds[stage]
            running = max(running, stage_workspace[stage] - bandwidth * elapsed)
            worst.append(running)
        window_seconds, window_bytes = 0.0, 0
        for length in range(1, count):  # H: stages start .. start + length - 1
            stage = (start + length - 1) % count
            window_seconds += stage_seconds[stage]
            window_bytes += stage_bytes[stage]
            during = window_bytes - budget + worst[count - length - 1]
            best = max(best, compute - window_seconds + max(window_seconds, during / bandwidth))
    return best

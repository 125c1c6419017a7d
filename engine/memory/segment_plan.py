"""Segment plans: which stages keep their weights resident and which stream them, within a capacity.

A module whose weights and workspace fit the capacity runs as one segment with every weight resident.
Otherwise each stage gets a role (reference/001 "graph-cut segments", edge-dit's streamed blocks):

- resident: its weights are copied once and stay on the device across calls (a replica in the store);
- streamed: its weights are copied, for every call, into a ring buffer of `ring_bytes` that streamed
  segments share in order, and dropped after the segment computes.

The ring holds at least two of the largest streamed stages, and up to an eighth of the room (at most
RING_TARGET); with room for two streamed segments the copy of the next segments overlaps the current one's
compute (double buffering and deeper). With less room than two of the largest stages the whole room is the
ring, cut into halves: stages larger than half of it stream alone, the others still overlap. Resident bytes
= capacity - workspace - ring, so the bytes streamed per call are the weights - that: the ring's bytes
stream on top of what cannot stay resident. Once stage times and the copy bandwidth are known, smaller
rings are offered beside that default (a sixteenth of the room; two of a smaller stage, the larger stages
kept resident) and stream_model.py's model of the two streams picks the fastest (of near ties, the one that
streams the fewest bytes): on the H200 a 126 MiB ring was a sixth of SD1.5's streamed bytes at 1103 MiB.
Which stages stream is chosen so that streamed bytes are spread over the call in proportion to the stages'
compute time (measured on the first call of an input shape; uniform before): the copy engine then runs
beside compute from the first stage to the last instead of stalling compute where streamed stages cluster.

Consecutive stages of one role form a segment; streamed runs are cut into chunks of at most a third of the
ring (at least the largest stage), so that the copies of the following chunks fit beside the one computing,
and, once stage times are measured, of at most 1/STREAMED_TIME_SHARE of the call's compute: a segment's
copy must end before its first stage starts, so a long segment with few weights (the full-resolution
blocks of a UNet) would have its bytes arrive long before most of its stages need them, holding ring
space that later copies wait for. Session 11's study of the H200's measured stage times (bench/plan_study.py,
then fitting about 20 us of overhead per copy and 40 us per streamed segment to the measured steps) put the
cut at 1 to 3% off the step time at most budgets of SD1.5 and SDXL, and a few % slower at SDXL's smallest
budget, where there are the most segments. But each streamed segment also costs the compute stream about
stream_model.SEGMENT_GAP inside a graph that waits for events (POLLED_SEGMENT_GAP where it polls flags), so
plans cut at 1/400, 1/50, 1/25 or not at all by compute time are modelled too, and the fastest wins: fewer
segments where compute hides the copies (SD1.5 at 1418 MiB, SDXL from 4199 MiB), finer ones where copies
bind and polled segments cost little (SDXL at 331 MiB: 4.5% faster modelled at 1/400, on the H200's stage
times; bench/plan_study.py). With events, where copies bound, session 13's sweep on the H200 could not tell
the cuts apart (bench/results/replay_trace_cuda_20261130_s13_time_share_sweep.log).
Each streamed segment has a ring offset and the earlier segments whose bytes it overwrites (`waits`): its
copy may start only after their compute has finished.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from engine.memory import stream_model
from engine.memory.ledger import MIB, BudgetExceeded
from engine.memory.weight_store import aligned
from engine.models.staged import Stage

RING_TARGET = 256 * MIB  # the largest stream ring beyond two stages: about 5 ms of copies at 55 GB/s
STREAMED_TIME_SHARE = 200  # a streamed segment computes for at most this fraction of a call (when known)
OTHER_TIME_SHARES = (400, 50, 25, 0)  # offered beside it, chosen by the model (0: no cut by time)
RING_SHARE = 8  # the ring takes up to this fraction of the room (at least two of the largest stages)
RING_CHUNKS = 3  # a streamed segment holds at most this fraction of the ring (at least the largest stage)
TIE = 1.005  # plans modelled within this factor of the fastest tie: the one streaming the fewest bytes wins
# (where compute hides every copy the model cannot tell rings apart, and each streamed byte still costs)


@dataclass(frozen=True)
class Segment:
    index: int
    start: int  # first stage index
    stop: int  # one past the last stage index
    keys: tuple[str, ...]  # weights the segment reads
    weight_bytes: int  # all its weights
    cost_bytes: int  # weights it brings to the device (not resident for good) + workspace
    streamed: bool = False  # weights copied into the stream ring for each call
    ring_offset: int = 0  # streamed: byte offset of its weights in the ring
    ring_bytes: int = 0  # streamed: bytes of the ring it occupies (each weight aligned)
    waits: tuple[int, ...] = ()  # streamed: earlier segments whose ring bytes it overwrites


@dataclass(frozen=True)
class SegmentPlan:
    segments: tuple[Segment, ...]
    workspace_bytes: int  # workspace estimate the plan was made with
    capacity_bytes: int  # what was available to the module when planned
    whole: bool  # the whole module fits: one segment, weights left resident
    ring_bytes: int = 0  # stream ring size (0 when nothing streams)
    resident_bytes: int = 0  # weights of resident segments that are not resident for good
    brought_bytes: int = 0  # all weights that are not resident for good


def plan_segments(
    stages: Sequence[Stage],
    stage_weight_bytes: Sequence[Mapping[str, int]],
    workspace_estimate: int,
    budget_available: int,
    resident_keys: Collection[str] = (),
    stage_seconds: Sequence[float] | None = None,
    overlap: bool = True,
    ring_target: int | None = None,
    bandwidth: float | None = None,
    segment_gap: float = stream_model.SEGMENT_GAP,
) -> SegmentPlan:
    """Plan `stages` so that resident weights + stream ring + workspace <= budget_available.

    `stage_weight_bytes[i]` maps the keys stage i reads to their bytes; `resident_keys` are weights that
    stay on the device anyway (they cost nothing). `stage_seconds` weighs where streamed bytes go (uniform
    when None). `overlap` False (no prefetch): a ring of one segment, copies never overlap compute.
    `ring_target` defaults to RING_TARGET. With `bandwidth` (bytes per second of the copies) and stage
    times, the plan is the fastest by stream_model.py (each streamed segment costing compute `segment_gap`)
    of the default ring and smaller rings that keep the largest stages resident (see `_ring_choices`), each
    cut by compute time at STREAMED_TIME_SHARE and at OTHER_TIME_SHARES. A stage that cannot fit alone
    raises BudgetExceeded.
    """
    ring_target = RING_TARGET if ring_target is None else ring_target
    if len(stage_weight_bytes) != len(stages):
        raise ValueError(f"{len(stages)} stages but {len(stage_weight_bytes)} weight maps")
    resident = set(resident_keys)
    needs = [{k: n for k, n in weights.items() if k not in resident} for weights in stage_weight_bytes]
    everything = {k: n for weights in stage_weight_bytes for k, n in weights.items()}
    brought = sum(n for k, n in everything.items() if k not in resident)
    if brought + workspace_estimate <= budget_available:
        whole = Segment(0, 0, len(stages), tuple(everything), sum(everything.values()),
                        brought + workspace_estimate)
        return SegmentPlan((whole,), workspace_estimate, budget_available, True, 0, brought, brought)

    room = budget_available - workspace_estimate
    ring_sizes = [sum(aligned(n) for n in need.values()) for need in needs]
    for index, (stage, size) in enumerate(zip(stages, ring_sizes, strict=True)):
        if size > room:
            raise BudgetExceeded(
                f"stage {stage.name!r} (index {index}) cannot fit on its own: {size} bytes of "
                f"weights + {workspace_estimate} bytes of workspace > {budget_available} bytes "
                f"available; raise --max-vram or free device memory"
            )
    known = stage_seconds is not None and len(stage_seconds) == len(stages) and sum(stage_seconds) > 0
    times = list(stage_seconds) if known else [0.0] * len(stages)
    choices = _ring_choices(ring_sizes, room, ring_target, overlap)
    if not (known and bandwidth):
        choices = choices[:1]
    roles = []
    for ring, chunk, largest_streamed in choices:
        forced = [size > largest_streamed for size in ring_sizes]
        roles.append((ring, chunk, _streamed_stages(ring_sizes, room - ring, stage_seconds, chunk, forced)))

    def cut(share: int) -> list[SegmentPlan]:  # a plan per ring choice, streamed runs cut at 1/share
        time_cap = sum(times) / share if known and share else 0.0
        plans = []
        for ring, chunk, streamed in roles:
            segments = _segments(stages, needs, stage_weight_bytes, ring_sizes, streamed, chunk,
                                 workspace_estimate, times, time_cap)
            segments = _place_in_ring(segments, ring)
            resident_bytes = sum(s.cost_bytes - workspace_estimate for s in segments if not s.streamed)
            plans.append(SegmentPlan(tuple(segments), workspace_estimate, budget_available, False, ring,
                                     resident_bytes, brought))
        return plans

    plans = cut(STREAMED_TIME_SHARE)
    if not (known and bandwidth):
        return plans[0]
    modelled = [stream_model.step_seconds(plan, times, bandwidth, segment_gap) for plan in plans]
    for share in OTHER_TIME_SHARES:
        more = cut(share)
        plans += more
        modelled += [stream_model.step_seconds(plan, times, bandwidth, segment_gap) for plan in more]
    near = [plan for plan, seconds in zip(plans, modelled, strict=True) if seconds <= min(modelled) * TIE]
    return min(near, key=lambda plan: (_streamed_bytes(plan), len(plan.segments)))


def _streamed_bytes(plan: SegmentPlan) -> int:
    return sum(s.ring_bytes for s in plan.segments if s.streamed)


def _ring_choices(
    sizes: Sequence[int], room: int, ring_target: int, overlap: bool
) -> list[tuple[int, int, int]]:
    """(ring bytes, chunk bytes, largest streamed stage) of the plans to choose from, the default first.

    Default: the ring holds two of the largest stages and up to 1/RING_SHARE of the room (at most
    `ring_target`). The ring's bytes are streamed on top of what cannot stay resident, so with prefetch
    smaller rings are offered too: up to 1/(2 RING_SHARE) of the room, and two of a smaller stage with the
    stages above it kept resident (SD1.5's two 59 MiB convolutions set a 119 MiB ring where two of the
    next largest stages need 63), while those stages take at most half of the resident room, or when they fit
    and at most half of the other stages' bytes must stream: where nearly everything fits, a ring of two
    small stages streams a few MiB where one of two large ones streamed them on every call (SD1.5 at 1730
    MiB: 10 MiB instead of 105). The smaller stages offered are the four largest and a ladder below them.
    """
    largest = max(sizes)
    if not overlap:
        ring = min(room, max(largest, min(ring_target, room // RING_SHARE) // 2))
        return [(ring, ring, largest)]
    if room < 2 * largest:  # too little room to double-buffer the largest stage: the smaller ones still can
        return [(room, room // 2, largest)]
    descending = sorted({size for size in sizes if size}, reverse=True)
    bounds = descending[:4]
    for size in descending[4:]:  # and a ladder of smaller stages, each at most half the one before
        if size <= bounds[-1] // 2:
            bounds.append(size)
    total = sum(sizes)
    choices: dict[tuple[int, int], int] = {}  # (ring, largest streamed stage) -> chunk, in order
    for share in (RING_SHARE, 2 * RING_SHARE):
        for bound in bounds:
            kept = sum(size for size in sizes if size > bound)
            shared = min(room, max(2 * bound, min(ring_target, room // share)))
            for ring in dict.fromkeys((shared, 2 * bound)):  # the share's ring, and the least for `bound`
                must = total - (room - ring)  # bytes that stream: at most half of the stages that may
                if kept <= (room - ring) // 2 or (kept <= room - ring and total - kept >= 2 * must):
                    choices.setdefault((ring, bound), max(bound, ring // RING_CHUNKS))
    return [(ring, chunk, bound) for (ring, bound), chunk in choices.items()]


def _streamed_stages(
    sizes: Sequence[int], resident_room: int, seconds: Sequence[float] | None, run: int,
    forced: Sequence[bool] | None = None,
) -> list[bool]:
    """Which stages stream: resident while the room lasts, streamed bytes keeping pace with compute time.
    `forced` stages stay resident whatever the pace (they are larger than the ring allows).

    The streamed bytes follow the pace within half a `run` either way (hysteresis), so roles alternate in
    runs of about `run` bytes rather than stage by stage: fewer, larger segments.
    """
    times = list(seconds) if seconds is not None and len(seconds) == len(sizes) else [1.0] * len(sizes)
    if sum(times) <= 0:
        times = [1.0] * len(sizes)
    forced = list(forced) if forced is not None else [False] * len(sizes)
    to_stream = max(0, sum(sizes) - resident_room)
    total_time, elapsed, streamed_bytes = sum(times), 0.0, 0
    resident_bytes = sum(size for size, kept in zip(sizes, forced, strict=True) if kept)
    roles = []
    stream = False
    for size, time, kept in zip(sizes, times, forced, strict=True):
        elapsed += time
        if kept:
            roles.append(False)
            continue
        pace = to_stream * elapsed / total_time
        fits = resident_bytes + size <= resident_room
        if size:
            ahead = streamed_bytes + size - pace  # bytes streamed beyond the pace if this stage streams
            stream = not fits or ahead <= (run // 2 if stream else -(run // 2))
        roles.append(stream)  # a weight-free stage keeps the role around it: it does not cut a run
        if stream:
            streamed_bytes += size
        else:
            resident_bytes += size
    return roles


def _segments(
    stages: Sequence[Stage],
    needs: Sequence[Mapping[str, int]],
    weights: Sequence[Mapping[str, int]],
    ring_sizes: Sequence[int],
    streamed: Sequence[bool],
    chunk: int,
    workspace: int,
    seconds: Sequence[float],
    time_cap: float,
) -> list[Segment]:
    """Consecutive stages of one role as segments; streamed runs cut into chunks of at most `chunk` bytes
    and (when `time_cap` > 0) `time_cap` seconds of compute."""
    bounds: list[tuple[int, int, bool]] = []
    start, run_bytes, run_seconds = 0, ring_sizes[0], seconds[0]  # of stages start..index-1
    for index in range(1, len(stages) + 1):
        if index < len(stages) and streamed[index] == streamed[start]:
            run_bytes, run_seconds = run_bytes + ring_sizes[index], run_seconds + seconds[index]
            if not streamed[start]:
                continue
            if run_bytes <= chunk and (time_cap <= 0 or run_seconds <= time_cap):
                continue
        bounds.append((start, index, streamed[start]))
        if index < len(stages):
            start, run_bytes, run_seconds = index, ring_sizes[index], seconds[index]
    segments = []
    for number, (first, stop, is_streamed) in enumerate(bounds):
        keys = {k: n for i in range(first, stop) for k, n in weights[i].items()}
        brought = {k: n for i in range(first, stop) for k, n in needs[i].items()}
        segments.append(Segment(number, first, stop, tuple(keys), sum(keys.values()),
                                sum(brought.values()) + workspace, is_streamed and bool(brought),
                                ring_bytes=sum(aligned(n) for n in brought.values()) if is_streamed else 0))
    return segments


def _place_in_ring(segments: list[Segment], ring: int) -> list[Segment]:
    """Lay the streamed segments out one after another in the ring, wrapping to 0 when one does not fit at
    the end; each records the earlier segments it overwrites."""
    placed: list[tuple[int, int, int]] = []  # (start, end, segment index) of earlier streamed segments
    cursor = 0
    out = []
    for segment in segments:
        if not segment.streamed:
            out.append(segment)
            continue
        if cursor + segment.ring_bytes > ring:
            cursor = 0
        end = cursor + segment.ring_bytes
        waits = tuple(index for start, stop, index in placed if start < end and cursor < stop)
        placed = [p for p in placed if not (p[0] >= cursor and p[1] <= end)] + [(cursor, end, segment.index)]
        out.append(replace(segment, ring_offset=cursor, waits=waits))
        cursor = end
    return out

"""Segmented execution: run a module's stages within a device budget (reference/001, edge-dit's streaming).

`segment_plan.py` decides which stages keep their weights resident and which stream them through the
stream ring (`stream_ring.py`). The runner here executes a plan:

- a whole plan (the module fits) binds every weight once and then runs the stages with no per-stage work;
- resident segments acquire their replicas from the weight store (copied on first use, kept across calls,
  pinned while they compute, evicted only when the ledger needs room);
- streamed segments are copied into the ring for every call. With prefetch on CUDA their copies run on a
  side stream, queued as far ahead as the ring allows; GPU events order each copy after the compute of the
  segments whose ring bytes it overwrites, so the host never waits. `--disable-prefetch` copies each one
  on the compute stream just before it runs.

Workspace (everything a call allocates besides weights: the state carried between stages, such as a UNet's
skip connections, and each stage's temporaries) is measured on the first call of each input shape, which
on CUDA is planned as if the workspace took half of what the module can use: on CUDA
the peak of `torch.cuda.max_memory_allocated` over every stage, less the weights the ledger tracks, less
what was allocated before the call; on other devices (no allocator report) twice the largest tensor seen in
the stage states. The same call times each stage (GPU time on CUDA, see stage_timing.py, or the wall clock
on a CPU), and the plan is remade with those times so streamed bytes follow compute. On CUDA the second
call of a shape times the stages again and keeps each stage's lesser time: the first call's also hold
one-time work (kernel loading, cuDNN autotuning, the attention backend probe), up to hundreds of
milliseconds in one stage. Plans are cached per input shape, budget and
workspace, and reused while they still fit. A shape's measured profile (workspace, stage times and peaks) is
kept in the profile cache on disk (profile_cache.py); a later process that finds it there plans its first
call of the shape with it and times no call.

CUDA graphs (`--cuda-graphs`, on by default on CUDA): once a call ran with the same input shape, plan,
stream ring and weight residency as the call before it (nothing was copied in or evicted), the next call is
captured as one CUDA graph, copies into the ring and their waits included (compute polls a flag per
streamed copy where copy_flags.py's kernel works, else waits for events), and later calls with the same
key replay it: the host then queues one graph instead of thousands of kernels, which on a launch-bound
model is most of a step. Inputs are copied into the graph's tensors and outputs cloned out. The graph's
memory pool holds the call's workspace for as long as the graph lives, so the ledger keeps that workspace
tracked (idle between calls); evicting it drops the graph. Any change of the key runs eagerly again, and a
failed capture turns graphs off for the runner with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine import telemetry
from engine.devices import device_name
from engine.memory import profile_cache, stream_model
from engine.memory.copy_flags import CopyFlags
from engine.memory.ledger import RUN_REFRESH, BudgetExceeded, DeviceLedger
from engine.memory.profile_cache import CachedProfile
from engine.memory.segment_plan import Segment, SegmentPlan, plan_segments
from engine.memory.stage_timing import (
    TIMED_CALLS,
    StageProfile,
    StageTiming,
    largest_tensor_bytes,
    tensors_of,
)
from engine.memory.stream_ring import StreamRing
from engine.memory.weight_store import WeightStore, aligned
from engine.models.staged import Stage, State

__all__ = ["Segment", "SegmentPlan", "SegmentRunner", "StageProfile", "plan_segments"]

WORKSPACE_KEY = "segments"  # the one reusable workspace a runner tracks per module
RING_KEY = "stream_ring"  # the stream ring, tracked as a workspace while it exists
GRAPH_KEY = "cuda_graph"  # the memory pool of a captured call, tracked as a workspace while it exists
RUNNER_KEYS = (WORKSPACE_KEY, RING_KEY, GRAPH_KEY)  # the workspaces a runner owns (a new plan replaces them)
POOL_REPLANS = 2  # plans remade per input shape to leave room for what its graph's pool reserved
POOL_GRAIN = 2 * 2**20  # the allocator reserves in 2 MiB pages
log = logging.getLogger("sluice.memory")


def graph_io_bytes(state: State) -> int:
    """Device bytes a captured call holds beyond the workspace its eager calls measure: its static copy of
    the input tensors, and the copy of its output it hands back (taken as large as the largest input)."""
    sizes = [aligned(t.numel() * t.element_size()) for t in tensors_of(state) if t.device.type == "cuda"]
    return sum(sizes) + max(sizes, default=0)


def _clone_state(value: Any) -> Any:
    """`value` with every tensor cloned (a graph's outputs are overwritten by its next replay)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_clone_state(v) for v in value)
    return value


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # the captured call's input tensors, in `tensors_of` order
    output: State  # the captured call's output state (the graph's tensors)
    key: tuple
    copies: list[tuple[int, int]]  # (streamed segment index, bytes) the graph copies on each replay
    flags: CopyFlags | None  # the flags its compute polls for copies (None: it waits for events)
    tracked: int  # the workspace the ledger tracks for it: its plan's, or its pool's measured size if larger


def _shape_signature(state: State) -> tuple:
    """What a plan and a captured graph depend on, in state order: each tensor's shape, dtype and device,
    and the plain values (a text encoder's clip skip, flags) that choose the computation."""

    def describe(value: Any) -> tuple:
        tensors = tensors_of(value)
        if tensors:
            return tuple((tuple(t.shape), str(t.dtype), str(t.device)) for t in tensors)
        return (repr(value),) if value is None or isinstance(value, bool | int | float | str) else ()

    return tuple((key, describe(value)) for key, value in state.items())


class SegmentRunner:
    def __init__(
        self,
        store: WeightStore,
        ledger: DeviceLedger,
        device: torch.device | str,
        prefetch: bool = True,
        segmented: bool = True,
        bus: telemetry.EventBus | None = None,
        graphs: bool = True,
        cache: profile_cache.ProfileCache | None = None,
    ) -> None:
        """Runs stage lists on `device` within `ledger`'s budget, with weights from `store`.

        `prefetch` False = streamed segments are copied just before they run, on the compute stream
        (reference/001 --disable-prefetch); `segmented` False = one segment always
        (--disable-segmented-compute), failing when it does not fit after eviction. `cache` keeps stage
        profiles across processes (default: the process's profile cache).
        """
        self.store = store
        self.ledger = ledger
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.segmented = segmented
        self.graphs = graphs  # capture steady calls as CUDA graphs (on CUDA only)
        self.bus = bus or telemetry.bus
        self._graph: _Graph | None = None
        self._steady: tuple | None = None  # key of the last call that copied nothing in and evicted nothing
        self._ring_serial = 0  # counts stream rings, so a graph never replays over a replaced one
        self.plan: SegmentPlan | None = None
        self.module: str | None = None
        self._plans: dict[tuple, SegmentPlan] = {}
        self._workspace: dict[tuple, int] = {}  # shape signature -> measured workspace bytes
        self._seconds: dict[tuple, list[float]] = {}  # shape signature -> measured seconds per stage
        self._timed: dict[tuple, int] = {}  # shape signature -> calls that measured it
        self._ring: StreamRing | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._flags: CopyFlags | None = None  # set while a call is captured where polling works
        self._computing: int | None = None
        self._issued: set[int] = set()  # streamed segments whose copy is queued and not yet computed
        self._bound_ring: Segment | None = None  # the streamed segment whose ring views are bound now
        self._resident: tuple[int, frozenset[str]] | None = None  # (id(plan), keys of its resident segments)
        self._ready: tuple[int, int] | None = None  # (id(whole plan), store generation) with all bound
        self._keys_cache: tuple[list[Stage], list[list[str]]] | None = None
        self._held: dict[int, tuple[int, int]] = {}  # resident segment -> (id(plan), store generation)
        self._device_name = device_name(self.device)
        self._pinned: list[str] = []  # keys pinned while a resident segment computes
        self.profile: StageProfile | None = None  # the last measured shape's per-stage times and peaks
        self._cache = profile_cache.default_cache() if cache is None else cache
        self._profile_keys: dict[tuple, dict] = {}  # shape signature -> its cache key
        self._peaks: dict[tuple, list[int]] = {}  # shape signature -> measured workspace peak per stage
        # shape signature -> bytes a captured graph's private pool reserved beyond what its plan left room
        # for (the allocator's rounding and fragmentation, which eager calls do not show), and how often
        self._pool_excess: dict[tuple, int] = {}
        self._pool_replans: dict[tuple, int] = {}

    def _stage_keys(self, stages: Sequence[Stage]) -> list[list[str]]:
        """The keys each stage reads: the last call's when the stages are the same objects (a model that
        caches its stage list), else looked up in the store."""
        cached = self._keys_cache
        if cached is not None and len(cached[0]) == len(stages) and all(
            a is b for a, b in zip(cached[0], stages, strict=True)
        ):
            return cached[1]
        keys = [self.store.stage_keys(stage) for stage in stages]
        self._keys_cache = (list(stages), keys)
        return keys

    def ring_bytes(self) -> int:
        return 0 if self._ring is None else self._ring.nbytes

    def _weights_on_device(self) -> int:
        return self.ledger.tracked(kind="weights") + self.ring_bytes()

    def _resident_keys(self, plan: SegmentPlan) -> frozenset[str]:
        if self._resident is None or self._resident[0] != id(plan):
            keys = frozenset(k for s in plan.segments if not s.streamed for k in s.keys)
            self._resident = (id(plan), keys)
        return self._resident[1]

    def run(self, stages: Sequence[Stage], state: State, module: str | None = None) -> State:
        """Run `stages` on `state` segment by segment; returns the final state."""
        self.ledger.refresh(RUN_REFRESH)  # live free memory, read at most every RUN_REFRESH seconds
        stage_keys = self._stage_keys(stages)
        if module is None:
            first = next((keys[0] for keys in stage_keys if keys), None)
            module = self.store.module_of(first) if first is not None else "model"
        self.module = module
        signature = _shape_signature(state)
        if signature not in self._workspace:
            self._read_profile(stages, signature)
        first = signature not in self._workspace
        measuring = self._timed.get(signature, 0) < self._timed_calls()
        workspace = self._workspace.get(signature, 2 * largest_tensor_bytes(state))
        if first and self.device.type == "cuda":
            # the call that measures the workspace assumes it may take half of what the module can use,
            # so that a first call whose activations are far larger than its inputs (a UNet's skips and
            # attention) still stays within the budget: more streams once, then the plan is remade
            capacity = self._capacity()
            largest = max((sum(aligned(self.store.nbytes(k)) for k in keys if self.store.home(k) != "device")
                           for keys in stage_keys), default=0)
            workspace = max(workspace, min(capacity // 2, capacity - largest))
        if self.graphs and self.device.type == "cuda":
            workspace += graph_io_bytes(state)
        plan = self._plan_with_pool_room(stages, stage_keys, workspace, signature)
        if measuring or not self.graphs or self.device.type != "cuda" or self._rereads(plan):
            log.debug("%s: eager call (measuring %s, graphs %s, or it re-reads disk)", self.module, measuring,
                      self.graphs)
            return self._run_eager(plan, stages, state, signature, measuring)
        key = (signature, id(plan), self.store.generation, self._ring_serial, torch.is_grad_enabled())
        if self._graph is not None and self._graph.key == key:
            return self._replay(self._graph, plan, state)
        self._drop_graph()
        if self._steady == key:
            try:
                return self._capture(plan, stages, state, key)
            except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager calls
                log.warning("%s: CUDA graph capture failed (%s); running without graphs", self.module, error)
                self.graphs = False
                self._drop_graph()
        state = self._run_eager(plan, stages, state, signature, measuring)
        after = (signature, id(self.plan), self.store.generation, self._ring_serial, torch.is_grad_enabled())
        self._steady = key if after == key else None
        log.debug("%s: eager call before a capture; steady %s (plan %s, generation %s, ring %s)", self.module,
                  after == key, after[1] == key[1], after[2] == key[2], after[3] == key[3])
        return state

    def _run_eager(
        self, plan: SegmentPlan, stages: Sequence[Stage], state: State, signature: tuple, measuring: bool
    ) -> State:
        measurement = (StageTiming(self.device, self._weights_on_device, state, len(stages)) if measuring
                       else None)
        try:
            self._allocate(self.module, WORKSPACE_KEY, plan.workspace_bytes)
            if plan.whole:
                state = self._run_whole(plan, stages, state, measurement)
            else:
                state = self._run_segments(plan, stages, state, measurement)
        finally:
            self._abandon()
        if measurement is not None:
            workspace, seconds = measurement.finish()
            if signature in self._workspace:  # a later timing call: the least time each stage took
                workspace = max(workspace, self._workspace[signature])
                seconds = [min(a, b) for a, b in zip(seconds, self._seconds[signature], strict=True)]
            self._workspace[signature], self._seconds[signature] = workspace, seconds
            self._timed[signature] = self._timed.get(signature, 0) + 1
            self.profile = StageProfile(list(seconds), list(measurement.peaks))
            self._peaks[signature] = list(measurement.peaks)
            if self._timed[signature] >= self._timed_calls():
                self._write_profile(signature)
        return state

    def _timed_calls(self) -> int:
        """The calls of an input shape that time its stages."""
        return TIMED_CALLS if self.device.type == "cuda" else 1

    def _read_profile(self, stages: Sequence[Stage], signature: tuple) -> None:
        """Before the first call of a shape: adopt the profile an earlier process measured for it, as if this
        one had timed it; else remember the key to store this process's measurement under."""
        if not self._cache.enabled:
            return
        key = profile_cache.stage_profile_key(self.device, stages, signature, self._timed_calls())
        cached = profile_cache.read_stage_profile(self._cache, key)
        self._profile_keys[signature] = key
        if cached is None:
            return
        self._workspace[signature], self._seconds[signature] = cached.workspace, list(cached.seconds)
        self._peaks[signature], self._pool_excess[signature] = list(cached.peaks), cached.pool_excess
        self._timed[signature] = self._timed_calls()
        self.profile = StageProfile(list(cached.seconds), list(cached.peaks))
        log.debug("%s: stage profile of %s read from the profile cache", self.module, signature)

    def _write_profile(self, signature: tuple, pool_excess: int | None = None) -> None:
        """Keep what this process measured of the shape in the profile cache, for later processes (with
        `pool_excess` as the room its graph pool needs, default what this process plans with)."""
        key = self._profile_keys.get(signature)
        timed = self._timed.get(signature, 0) >= self._timed_calls()
        if key is not None and timed and signature in self._peaks:
            excess = self._pool_excess.get(signature, 0) if pool_excess is None else pool_excess
            measured = CachedProfile(self._workspace[signature], list(self._seconds[signature]),
                                     list(self._peaks[signature]), excess)
            profile_cache.write_stage_profile(self._cache, key, measured)

    # ------------------------------------------------------------------------------------------ graphs

    def _capture(self, plan: SegmentPlan, stages: Sequence[Stage], state: State, key: tuple) -> State:
        """Capture one call as a CUDA graph, replay it once for this call's result, and keep it."""
        inputs = _clone_state(state)
        static = tensors_of(inputs)  # before the capture: the stages change the state's structure
        copies: list[tuple[int, int]] = []

        def record(event: telemetry.Event) -> None:
            if event.kind == "transfer" and str(event.get("key", "")).startswith("segment "):
                copies.append((int(event["key"].removeprefix("segment ")), int(event["bytes"])))

        flags = None  # compute polls a flag per streamed copy where it can (copy_flags.py), else waits
        if self.prefetch and any(s.streamed for s in plan.segments) and CopyFlags.available(self.device):
            flags = CopyFlags(len(plan.segments), self.device)
        self.store.wait_pinned()  # a graph may not copy from pageable memory
        torch.cuda.synchronize(self.device)
        # the eager calls before left freed blocks in the caching allocator; the graph's pool is new memory,
        # so hand those back first: what nvidia-smi shows (reserved) then stays near the budget
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        unsubscribe = self.bus.subscribe(record)
        copies_before = self.store.copies
        self._flags = flags
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the GUI thread polls meanwhile
                output = self._run_eager(plan, stages, inputs, key[0], False)
        except BaseException:
            self._forget_captured_copies()
            raise
        finally:
            self._flags = None
            unsubscribe()
        if (self.store.copies, self.store.generation, self._ring_serial) != (copies_before, *key[2:4]):
            # the capture copied weights in or evicted some (room got tighter): those copies were only
            # recorded, never run, so nothing it touched may be trusted
            self._forget_captured_copies()
            raise RuntimeError("weights moved while the call was captured")
        tracked = self._measure_pool(key[0], plan, torch.cuda.memory_reserved(self.device) - reserved_before)
        self._graph = _Graph(graph, static, output, key, copies, flags, tracked)
        self._allocate(self.module, GRAPH_KEY, tracked)
        self.ledger.mark_pooled(self.module, "workspace", GRAPH_KEY)
        self.ledger.on_release(self.module, "workspace", GRAPH_KEY, self._forget_graph)
        self.ledger.set_idle(self.module, GRAPH_KEY)
        return self._replay(self._graph, plan, state)

    def _measure_pool(self, signature: tuple, plan: SegmentPlan, pool: int) -> int:
        """The workspace to track for a graph whose private pool reserved `pool` bytes (what nvidia-smi shows
        of it, more than the live tensors of the eager calls by the allocator's rounding): the pool, when
        the budget has room for it. Else the plan's workspace for now, and the excess is remembered for the
        shape, so that the next plan leaves room for it (one more capture, after which reserved memory stays
        within the budget). Replanning stops after POOL_REPLANS tries, so a pool that keeps growing cannot
        make the calls evict and recapture for ever."""
        if pool <= plan.workspace_bytes:
            return plan.workspace_bytes
        excess = -(-(pool - plan.workspace_bytes) // POOL_GRAIN) * POOL_GRAIN
        with_room = self._pool_excess.get(signature, 0) + excess
        try:
            self.ledger.allocate(self.module, "workspace", GRAPH_KEY, pool)
        except BudgetExceeded:
            replans = self._pool_replans.get(signature, 0)
            if replans < POOL_REPLANS:
                self._pool_replans[signature] = replans + 1
                self._pool_excess[signature] = with_room
                log.debug("%s: graph pool reserved %.1f MiB, %.1f MiB over its plan's workspace and over the "
                          "budget; the next plan leaves room for it", self.module, pool / 2**20,
                          excess / 2**20)
                self._write_profile(signature, with_room)
            return plan.workspace_bytes
        # it fits this budget; a later process (at a tighter budget) plans with room for it from the start
        self._write_profile(signature, with_room)
        return pool

    def _replay(self, graph: _Graph, plan: SegmentPlan, state: State) -> State:
        self._allocate(self.module, GRAPH_KEY, graph.tracked)  # active again while it runs
        try:
            for target, value in zip(graph.inputs, tensors_of(state), strict=True):
                target.copy_(value)
            graph.graph.replay()
            self._publish_replay(graph, plan)
            return _clone_state(graph.output)
        finally:
            if self._graph is graph:
                self.ledger.set_idle(self.module, GRAPH_KEY)

    def _rereads(self, plan: SegmentPlan) -> bool:
        """Whether a streamed segment re-reads disk-home weights on every call: such host reads cannot be
        captured (a graph would copy from the first call's buffers)."""
        if plan.whole:
            return False
        return any(self.store.home(k) == "disk" for s in plan.segments if s.streamed for k in s.keys)

    def _publish_replay(self, graph: _Graph, plan: SegmentPlan) -> None:
        """The events of an eager call, published while the GPU runs the replay (host times, so a trace
        shows when the work was queued): the GUI and the counters stay the same with graphs."""
        copies = dict(graph.copies)
        for segment in plan.segments:
            if segment.index in copies:
                self.bus.publish("transfer", device=self._device_name, module=self.module,
                                 key=f"segment {segment.index}", bytes=copies[segment.index], direction="h2d",
                                 seconds=0.0, stream="graph")
            self.bus.publish("segment_start", device=self._device_name, module=self.module,
                             index=segment.index, stages=(segment.start, segment.stop),
                             weight_bytes=segment.weight_bytes)
            self.bus.publish("segment_end", device=self._device_name, module=self.module, index=segment.index)

    def release(self) -> None:
        """Give back everything the runner holds on the device: its graph, stream ring and workspace."""
        self._drop_graph()
        self._drop_ring()
        if self.module is not None:
            self.ledger.release(self.module, "workspace", WORKSPACE_KEY)

    def _forget_captured_copies(self) -> None:
        """After a capture that failed or moved weights: drop this module's replicas and the ring, whose
        copies a capture only records, so that the next call copies them again for real."""
        self._graph = None
        self._held.clear()
        self._ready = None
        self._drop_ring()
        self.store.release_module(self.module)

    def reset_graph(self) -> None:
        """Drop the captured graph (settings that the capture baked in changed)."""
        self._drop_graph()
        self._steady = None

    def _drop_graph(self) -> None:
        if self._graph is not None:
            self.ledger.release(self.module, "workspace", GRAPH_KEY)  # calls _forget_graph
        self._graph = None

    def _forget_graph(self) -> None:
        had_graph = self._graph is not None
        self._graph = None
        self._steady = None
        if had_graph and self.device.type == "cuda":
            # a dropped graph's private pool is free but reserved, and no other pool can use it: the module
            # that needed the room (or this one's next plan) would allocate beside it (reserved went 25% over
            # an SDXL budget so); cudaFree waits for a replay still running
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------ running

    def _run_whole(
        self, plan: SegmentPlan, stages: Sequence[Stage], state: State, measurement: StageTiming | None
    ) -> State:
        segment = plan.segments[0]
        self._drop_ring()
        self._start(segment)
        if self._ready != (id(plan), self.store.generation):  # else nothing was evicted since the last run
            self._hold(segment.keys)
        state = self._run_stages(stages, 0, len(stages), state, measurement)
        self._end(segment)
        self._ready = (id(plan), self.store.generation)
        return state

    def _run_segments(
        self, plan: SegmentPlan, stages: Sequence[Stage], state: State, measurement: StageTiming | None
    ) -> State:
        ring = self._ring_for(plan)
        resident = self._resident_keys(plan)
        streamed = [s for s in plan.segments if s.streamed]
        stream = None
        if self.device.type == "cuda":
            compute = torch.cuda.current_stream(self.device)
            stream = self._side_stream() if self.prefetch else compute
            if self._flags is not None:
                self._flags.reset()  # before the copies: the copy stream waits for this below
            stream.wait_stream(compute)  # the ring's bytes may still be read by the last call's compute
        queued = 0  # streamed segments whose copy is queued, in order
        for segment in plan.segments:
            if self.prefetch:
                while queued < len(streamed) and all(w < segment.index for w in streamed[queued].waits):
                    self._queue_copy(ring, plan, resident, streamed[queued], stream)
                    queued += 1
            elif segment.streamed:
                self._queue_copy(ring, plan, resident, segment, stream)
            self._start(segment)
            if segment.streamed:
                if stream is not None:
                    ring.wait_copied(segment, self._flags)
                self._issued.discard(segment.index)
                self._bound_ring = segment
                self._hold(ring.bind(plan, segment, resident))
            elif self._held.get(segment.index) != (id(plan), self.store.generation):
                self._hold(segment.keys)  # else its replicas are bound since it last ran: nothing to do
            state = self._run_stages(stages, segment.start, segment.stop, state, measurement)
            if not segment.streamed:
                self._held[segment.index] = (id(plan), self.store.generation)
            if segment.streamed:
                ring.mark_done(segment)
            self._end(segment)
        if self._flags is not None and stream is not None:
            compute.wait_stream(stream)  # a capture joins the copy stream: no wait for a copy's event did
        return state

    def _hold(self, keys: Sequence[str]) -> None:
        """Acquire, bind and pin `keys` for the segment about to compute."""
        missing = [k for k in keys if not self.store.is_bound(k)]
        if missing:  # acquire them all: what is bound already is protected from the eviction this may do
            self.store.bind_keys(missing, self.store.acquire(keys, self.device))
        self.store.pin(keys)
        self._pinned = list(keys)

    def _run_stages(
        self, stages: Sequence[Stage], start: int, stop: int, state: State, measurement: StageTiming | None
    ) -> State:
        if measurement is None:
            for stage in stages[start:stop]:
                state = stage.run(state)
            return state
        for index in range(start, stop):
            measurement.before(index)
            state = stages[index].run(state)
            measurement.after(index, state)
        return state

    def _queue_copy(
        self, ring: StreamRing, plan: SegmentPlan, resident: frozenset[str], segment: Segment, stream: Any
    ) -> None:
        ring.copy(plan, segment, resident, stream, self.module, self._flags)
        self._issued.add(segment.index)

    def _start(self, segment: Segment) -> None:
        self._computing = segment.index
        self.bus.publish(
            "segment_start",
            device=self._device_name,
            module=self.module,
            index=segment.index,
            stages=(segment.start, segment.stop),
            weight_bytes=segment.weight_bytes,
        )

    def _end(self, segment: Segment) -> None:
        self._let_go()
        self.bus.publish(
            "segment_end", device=self._device_name, module=self.module, index=segment.index
        )

    def _abandon(self) -> None:
        """After a run (or a failure): unbind ring views, unpin, mark the workspaces idle."""
        self._let_go()
        self._issued.clear()
        self.ledger.release(self.module, "workspace", WORKSPACE_KEY)
        if self._ring is not None:
            self.ledger.set_idle(self.module, RING_KEY)

    def _let_go(self) -> None:
        """The segment that computed (or failed) gives back its ring views and pins."""
        if self._bound_ring is not None and self._ring is not None:
            self._ring.rest(self.plan, self._bound_ring, self._resident_keys(self.plan))
        self._bound_ring = None
        if self._pinned:
            self.store.unpin(self._pinned)
            self._pinned = []
        self._computing = None

    # ------------------------------------------------------------------------------------------ memory

    def _allocate(self, module: str, key: str, nbytes: int) -> None:
        """Track a workspace, evicting idle workspaces and replicas for it when needed."""
        try:
            self.ledger.allocate(module, "workspace", key, nbytes)
        except BudgetExceeded:
            self.store.evict_until_fits(nbytes, self.device)
            self.ledger.allocate(module, "workspace", key, nbytes)

    def _ring_for(self, plan: SegmentPlan) -> StreamRing:
        """The stream ring of `plan`'s size: the existing one when it still is, else a new one."""
        if self._ring is not None and self._ring.nbytes == plan.ring_bytes:
            self._allocate(self.module, RING_KEY, plan.ring_bytes)  # active again (or re-tracked)
            self.ledger.on_release(self.module, "workspace", RING_KEY, self._forget_ring)
            self._ring.forget(plan)
            return self._ring
        self._drop_ring()
        self._allocate(self.module, RING_KEY, plan.ring_bytes)
        self._ring_serial += 1
        buffer = torch.empty(plan.ring_bytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cuda" and self.prefetch:
            buffer.record_stream(self._side_stream())
        self._ring = StreamRing(self.store, buffer, self.bus)
        self.ledger.on_release(self.module, "workspace", RING_KEY, self._forget_ring)
        return self._ring

    def _drop_ring(self) -> None:
        if self._ring is not None:
            self.ledger.release(self.module, "workspace", RING_KEY)  # calls _forget_ring
        self._ring = None

    def _forget_ring(self) -> None:
        self._ring = None
        self._ring_serial += 1

    def _side_stream(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    # ------------------------------------------------------------------------------------------ planning

    def snapshot(self) -> dict:
        """The current plan with each segment's state: resident, prefetching, computing or evicted."""
        if self.plan is None:
            return {"module": self.module, "device": self._device_name, "segments": []}
        rows = []
        for segment in self.plan.segments:
            if segment.index == self._computing:
                status = "computing"
            elif segment.index in self._issued:
                status = "prefetching"
            elif not segment.streamed and all(self.store.is_resident(k) for k in segment.keys):
                status = "resident"
            else:
                status = "evicted"
            rows.append(
                {
                    "index": segment.index,
                    "stages": (segment.start, segment.stop),
                    "weight_bytes": segment.weight_bytes,
                    "streamed": segment.streamed,
                    "state": status,
                }
            )
        return {
            "module": self.module,
            "device": self._device_name,
            "whole": self.plan.whole,
            "workspace_bytes": self.plan.workspace_bytes,
            "ring_bytes": self.plan.ring_bytes,
            "segments": rows,
        }

    def _capacity(self) -> int:
        """What this module can use: free budget plus everything eviction could reclaim (its own ring and
        workspace included, since a new plan replaces them)."""
        # only the runner's own workspaces: others of the module (a sampler's state held around its calls,
        # runtime.ModuleMemory.holding) stay while it runs; counting them made every plan too large by
        # them, and each call then evicted and re-copied resident weights (never steady, so never a graph)
        own = sum(self.ledger.workspace(self.module, key) for key in RUNNER_KEYS) if self.module else 0
        evictable = self.store.evictable_bytes(self.device) + own - self._idle_own()
        return max(0, self.ledger.headroom() + evictable)  # headroom may be negative: over the limit

    def _idle_own(self) -> int:
        """This runner's idle workspaces, which `evictable_bytes` already counts."""
        return sum(n for m, key, n in self.ledger.idle_workspaces()
                   if m == self.module and key in RUNNER_KEYS)

    def _plan_with_pool_room(
        self, stages: Sequence[Stage], stage_keys: list[list[str]], workspace: int, signature: tuple
    ) -> SegmentPlan:
        """The plan for `workspace`, with room for what the shape's graph pool reserved beyond it where a plan
        still fits then (below one allocator page of budget for the workspace none does: that room is
        given up for the shape, and its pool stays over the budget by less than a page)."""
        excess = self._pool_excess.get(signature, 0)
        if excess:
            try:
                return self._plan_for(stages, stage_keys, workspace + excess, signature)
            except BudgetExceeded:
                log.debug("%s: no plan leaves room for the %.1f MiB its graph pool reserved beyond the "
                          "workspace; planning without it", self.module, excess / 2**20)
                self._pool_excess[signature] = 0
                self._pool_replans[signature] = POOL_REPLANS
        return self._plan_for(stages, stage_keys, workspace, signature)

    def _plan_for(
        self, stages: Sequence[Stage], stage_keys: list[list[str]], workspace: int, signature: tuple
    ) -> SegmentPlan:
        capacity = self._capacity()
        seconds = self._seconds.get(signature)
        budget = self.ledger.budget_bytes
        # the copy flags' readiness changes the modelled rates: the plan is made again once they are ready
        polled = CopyFlags.ready(self.device) if self.segmented and self.prefetch else False
        timed = self._timed.get(signature, 0)
        cache_key = (self.module, len(stages), signature, budget, workspace, polled, timed)
        cached = self._plans.get(cache_key)
        if cached is not None and self._still_good(cached, capacity):
            if cached is not self.plan:
                self._use(cached, cached=True)
            return cached
        weights = [{k: self.store.nbytes(k) for k in keys} for keys in stage_keys]
        resident = [k for keys in stage_keys for k in keys if self.store.home(k) == "device"]
        if self.segmented:
            bandwidth, gap = stream_model.call_rates(self.device, self.graphs and self.device.type == "cuda")
            if not (seconds and self.prefetch):
                bandwidth = None
            plan = plan_segments(stages, weights, workspace, capacity, resident, seconds, self.prefetch,
                                 bandwidth=bandwidth, segment_gap=gap)
        else:
            everything = sum(self.store.nbytes(k) for keys in stage_keys for k in keys)
            plan = plan_segments(stages, weights, workspace, max(capacity, everything + workspace), resident)
        self._plans[cache_key] = plan
        self._use(plan, cached=False)
        return plan

    def _use(self, plan: SegmentPlan, cached: bool) -> None:
        """Adopt `plan`: replicas of weights it streams are dropped (they are outside its budget)."""
        self.plan = plan
        if self.prefetch and self.graphs and any(s.streamed for s in plan.segments):
            # compiles the poll kernel in the background (Triton's import alone took 0.5 s on the H200's host,
            # which a module that stays resident never needs); captures wait with events until it is ready
            CopyFlags.warm_up(self.device)
        resident = {k for segment in plan.segments if not segment.streamed for k in segment.keys}
        self.store.release_keys(k for segment in plan.segments for k in segment.keys if k not in resident)
        self.store.set_segments(
            {k: None if s.streamed else s.index for s in plan.segments for k in s.keys}
        )
        self.bus.publish(
            "plan",
            device=self._device_name,
            module=self.module,
            cached=cached,
            whole=plan.whole,
            workspace=plan.workspace_bytes,
            capacity=plan.capacity_bytes,
            ring=plan.ring_bytes,
            segments=[(s.start, s.stop, s.weight_bytes) for s in plan.segments],
            streamed=[s.streamed for s in plan.segments],
        )

    def _still_good(self, plan: SegmentPlan, capacity: int) -> bool:
        """A cached plan still fits, and is not segmented when the whole module would now fit."""
        need = plan.workspace_bytes + plan.ring_bytes + plan.resident_bytes
        if plan.whole:
            return plan.segments[0].cost_bytes <= capacity
        if need > capacity:
            return False
        if self.segmented:
            return plan.brought_bytes + plan.workspace_bytes > capacity
        return True

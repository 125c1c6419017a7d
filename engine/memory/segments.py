"""Segmented execution: cut a module's stages into segments that fit, and run them (reference/001).

The planner cuts only at stage boundaries (the graph cuts of the model contract) and merges neighbours
while a segment's missing weights plus its compute workspace fit the capacity; a module whose weights and
workspace fit runs as one segment and keeps its weights resident. Plans are cached per input shape,
budget and workspace estimate, and reused while they still fit.

The runner stages each segment's weights through the weight store: acquire and pin before the segment
computes, unpin after, so replicas stay resident for the next call until eviction needs the room. On
CUDA the next parameter-bearing segment is copied on a side stream while the current one computes; the
compute stream waits on the copy's event and the replicas are recorded on the compute stream, so the
caching allocator cannot reuse them early.

Workspace: on CUDA the peak of `torch.cuda.max_memory_allocated` above the segment's starting allocation,
measured on the first run of each input shape (this resets the device's peak counter). On other devices
there is no allocator report, so the estimate is twice the largest tensor seen in the stage states
(a stage's input and output live together); the first plan of a shape uses twice the largest input tensor.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine import telemetry
from engine.devices import device_name
from engine.memory.ledger import BudgetExceeded, DeviceLedger
from engine.memory.weight_store import WeightStore
from engine.models.staged import Stage, State, run_stages

WORKSPACE_KEY = "segments"  # the one reusable workspace a runner tracks per module


@dataclass(frozen=True)
class Segment:
    index: int
    start: int  # first stage index
    stop: int  # one past the last stage index
    keys: tuple[str, ...]  # weights the segment reads
    weight_bytes: int  # all its weights
    cost_bytes: int  # weights not resident for good + workspace: what must fit while it computes


@dataclass(frozen=True)
class SegmentPlan:
    segments: tuple[Segment, ...]
    workspace_bytes: int  # workspace estimate the plan was made with
    capacity_bytes: int  # what was available to the module when planned
    whole: bool  # the whole module fits: one segment, weights left resident


def plan_segments(
    stages: Sequence[Stage],
    stage_weight_bytes: Sequence[Mapping[str, int]],
    workspace_estimate: int,
    budget_available: int,
    resident_keys: Collection[str] = (),
) -> SegmentPlan:
    """Greedy graph-cut plan: each segment's non-resident weight bytes + workspace <= budget_available.

    `stage_weight_bytes[i]` maps the keys stage i reads to their bytes; `resident_keys` are weights that
    stay on the device anyway (they cost nothing). A stage that cannot fit alone raises BudgetExceeded.
    """
    if len(stage_weight_bytes) != len(stages):
        raise ValueError(f"{len(stages)} stages but {len(stage_weight_bytes)} weight maps")
    resident = set(resident_keys)

    def cost(keys: Mapping[str, int]) -> int:
        return sum(nbytes for key, nbytes in keys.items() if key not in resident) + workspace_estimate

    def segment(index: int, start: int, stop: int, keys: Mapping[str, int]) -> Segment:
        return Segment(index, start, stop, tuple(keys), sum(keys.values()), cost(keys))

    everything = {k: n for weights in stage_weight_bytes for k, n in weights.items()}
    if cost(everything) <= budget_available:
        whole = segment(0, 0, len(stages), everything)
        return SegmentPlan((whole,), workspace_estimate, budget_available, True)
    segments: list[Segment] = []
    start, keys = 0, {}
    for index, (stage, weights) in enumerate(zip(stages, stage_weight_bytes, strict=True)):
        if cost(weights) > budget_available:
            missing = cost(weights) - workspace_estimate
            raise BudgetExceeded(
                f"stage {stage.name!r} (index {index}) cannot fit on its own: {missing} bytes of "
                f"weights + {workspace_estimate} bytes of workspace > {budget_available} bytes "
                f"available; raise --max-vram or free device memory"
            )
        merged = {**keys, **weights}
        if index > start and cost(merged) > budget_available:
            segments.append(segment(len(segments), start, index, keys))
            start, merged = index, dict(weights)
        keys = merged
    segments.append(segment(len(segments), start, len(stages), keys))
    return SegmentPlan(tuple(segments), workspace_estimate, budget_available, False)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _largest_tensor_bytes(state: State) -> int:
    return max((t.numel() * t.element_size() for t in _tensors(state)), default=0)


def _shape_signature(state: State) -> tuple:
    """The input shapes and dtypes a plan depends on, in state order."""
    return tuple(
        (key, tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(value))) for key, value in state.items()
    )


class SegmentRunner:
    def __init__(
        self,
        store: WeightStore,
        ledger: DeviceLedger,
        device: torch.device | str,
        prefetch: bool = True,
        segmented: bool = True,
        bus: telemetry.EventBus | None = None,
    ) -> None:
        """Runs stage lists on `device` within `ledger`'s budget, with weights from `store`.

        `prefetch` False = no side-stream copies (reference/001 --disable-prefetch); `segmented` False = one
        segment always (--disable-segmented-compute), failing when it does not fit after eviction.
        """
        self.store = store
        self.ledger = ledger
        self.device = torch.device(device)
        self.prefetch = prefetch and self.device.type == "cuda"
        self.segmented = segmented
        self.bus = bus or telemetry.bus
        self.plan: SegmentPlan | None = None
        self.module: str | None = None
        self._plans: dict[tuple, SegmentPlan] = {}
        self._workspace: dict[tuple, int] = {}  # shape signature -> measured workspace bytes
        self._computing: int | None = None
        self._pending: tuple[int, dict[str, torch.Tensor], torch.cuda.Event] | None = None
        self._side_stream: torch.cuda.Stream | None = None
        self._active: tuple[Segment, Sequence[Stage]] | None = None  # pinned and bound until it ends

    def run(self, stages: Sequence[Stage], state: State, module: str | None = None) -> State:
        """Run `stages` on `state` segment by segment; returns the final state."""
        self.ledger.refresh()  # live free memory is read once per run (one driver query, about 1 ms on CUDA)
        stage_keys = [self.store.stage_keys(stage) for stage in stages]
        all_keys = [k for keys in stage_keys for k in keys]
        self.module = module or (self.store.module_of(all_keys[0]) if all_keys else "model")
        signature = _shape_signature(state)
        measuring = signature not in self._workspace
        workspace = self._workspace.get(signature, 2 * _largest_tensor_bytes(state))
        plan = self._plan_for(stages, stage_keys, workspace, signature)
        self.store.set_segments({k: segment.index for segment in plan.segments for k in segment.keys})
        segment_of_stage = {
            i: segment for segment in plan.segments for i in range(segment.start, segment.stop)
        }
        seen = [_largest_tensor_bytes(state)]
        peaks: list[int] = []

        def observed(stage: Stage) -> Stage:
            def run_and_observe(s: State) -> State:
                s = stage.run(s)
                seen.append(_largest_tensor_bytes(s))
                return s

            return Stage(stage.name, stage.modules, run_and_observe)

        def before(index: int, stage: Stage) -> None:
            segment = segment_of_stage[index]
            if index == segment.start:
                self._start_segment(plan, segment, stages)
                if measuring and self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                    peaks.append(-torch.cuda.memory_allocated(self.device))

        def after(index: int, stage: Stage) -> None:
            segment = segment_of_stage[index]
            if index == segment.stop - 1:
                if measuring and self.device.type == "cuda":
                    peaks[-1] += torch.cuda.max_memory_allocated(self.device)
                self._end_segment(segment, stages)

        try:
            state = run_stages([observed(stage) for stage in stages], state, before, after)
        finally:
            self._abandon()
        if measuring:
            self._workspace[signature] = max(peaks) if peaks else 2 * max(seen)
        return state

    def snapshot(self) -> dict:
        """The current plan with each segment's state: resident, prefetching, computing or evicted."""
        if self.plan is None:
            return {"module": self.module, "device": device_name(self.device), "segments": []}
        pending = self._pending[0] if self._pending is not None else None
        rows = []
        for segment in self.plan.segments:
            if segment.index == self._computing:
                status = "computing"
            elif segment.index == pending:
                status = "prefetching"
            elif all(self.store.is_resident(k) for k in segment.keys):
                status = "resident"
            else:
                status = "evicted"
            rows.append(
                {
                    "index": segment.index,
                    "stages": (segment.start, segment.stop),
                    "weight_bytes": segment.weight_bytes,
                    "state": status,
                }
            )
        return {
            "module": self.module,
            "device": device_name(self.device),
            "whole": self.plan.whole,
            "workspace_bytes": self.plan.workspace_bytes,
            "segments": rows,
        }

    def _capacity(self) -> int:
        """What this module can use: free budget plus everything eviction could reclaim."""
        return self.ledger.available() + self.store.evictable_bytes(self.device)

    def _plan_for(
        self, stages: Sequence[Stage], stage_keys: list[list[str]], workspace: int, signature: tuple
    ) -> SegmentPlan:
        capacity = self._capacity()
        cache_key = (self.module, len(stages), signature, self.ledger.budget_bytes, workspace)
        cached = self._plans.get(cache_key)
        if cached is not None and self._still_good(cached, capacity):
            self.plan = cached
            self._publish_plan(cached, cached=True)
            return cached
        weights = [{k: self.store.nbytes(k) for k in keys} for keys in stage_keys]
        resident = [k for keys in stage_keys for k in keys if self.store.home(k) == "device"]
        budget = (
            capacity
            if self.segmented
            else max(capacity, sum(self.store.nbytes(k) for ks in stage_keys for k in ks) + workspace)
        )
        plan = plan_segments(stages, weights, workspace, budget, resident)
        if not plan.whole and self.prefetch:
            try:  # half the room for each segment, so the next one can be copied while this one computes
                plan = plan_segments(
                    stages, weights, workspace, workspace + (budget - workspace) // 2, resident
                )
            except BudgetExceeded:
                pass  # a stage too large to double-buffer: segments without overlap
        self._plans[cache_key] = plan
        self.plan = plan
        self._publish_plan(plan, cached=False)
        return plan

    def _still_good(self, plan: SegmentPlan, capacity: int) -> bool:
        """A cached plan still fits, and is not segmented when the whole module would now fit."""
        if max(s.cost_bytes for s in plan.segments) > capacity:
            return False
        if not plan.whole and self.segmented:
            keys = {k for s in plan.segments for k in s.keys if self.store.home(k) != "device"}
            return sum(self.store.nbytes(k) for k in keys) + plan.workspace_bytes > capacity
        return True

    def _publish_plan(self, plan: SegmentPlan, cached: bool) -> None:
        self.bus.publish(
            "plan",
            device=device_name(self.device),
            module=self.module,
            cached=cached,
            whole=plan.whole,
            workspace=plan.workspace_bytes,
            capacity=plan.capacity_bytes,
            segments=[(s.start, s.stop, s.weight_bytes) for s in plan.segments],
        )

    def _start_segment(self, plan: SegmentPlan, segment: Segment, stages: Sequence[Stage]) -> None:
        self._computing = segment.index
        self.bus.publish(
            "segment_start",
            device=device_name(self.device),
            module=self.module,
            index=segment.index,
            stages=(segment.start, segment.stop),
            weight_bytes=segment.weight_bytes,
        )
        try:
            self.ledger.allocate(self.module, "workspace", WORKSPACE_KEY, plan.workspace_bytes)
        except BudgetExceeded:
            self.store.evict_until_fits(plan.workspace_bytes, self.device)
            self.ledger.allocate(self.module, "workspace", WORKSPACE_KEY, plan.workspace_bytes)
        if self._pending is not None and self._pending[0] == segment.index:
            _, tensors, event = self._pending
            self._pending = None
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for tensor in tensors.values():
                tensor.record_stream(stream)
        else:
            tensors = self.store.acquire(segment.keys, self.device)
            self.store.pin(segment.keys)
        self._active = (segment, stages)
        if self.prefetch:
            self._prefetch_after(plan, segment.index)
        for stage in stages[segment.start : segment.stop]:
            self.store.bind_stage_weights(stage, tensors)

    def _end_segment(self, segment: Segment, stages: Sequence[Stage]) -> None:
        for stage in stages[segment.start : segment.stop]:
            self.store.unbind_stage_weights(stage)
        self.store.unpin(segment.keys)
        self._active = None
        self.ledger.set_idle(self.module, WORKSPACE_KEY)
        self._computing = None
        self.bus.publish(
            "segment_end", device=device_name(self.device), module=self.module, index=segment.index
        )

    def _prefetch_after(self, plan: SegmentPlan, index: int) -> None:
        """Copy the next parameter-bearing segment's weights on the side stream if they fit beside it."""
        following = [s for s in plan.segments[index + 1 :] if s.keys]
        if not following:
            return
        segment = following[0]
        missing = sum(self.store.nbytes(k) for k in segment.keys if not self.store.is_resident(k))
        if not self.ledger.would_fit(missing):
            self.store.evict_until_fits(missing, self.device, protect=segment.keys)
            if not self.ledger.would_fit(missing):
                return
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            tensors = self.store.acquire(segment.keys, self.device, stream=self._side_stream)
        except BudgetExceeded:
            return
        event = torch.cuda.Event()
        event.record(self._side_stream)
        self.store.pin(segment.keys)
        self._pending = (segment.index, tensors, event)

    def _abandon(self) -> None:
        """After a run (or a failure): release the workspace and any prefetch nobody consumed."""
        if self._pending is not None:
            index, _, event = self._pending
            event.synchronize()
            self.store.unpin(self.plan.segments[index].keys)
            self._pending = None
        if self._active is not None:
            segment, stages = self._active
            self._end_segment(segment, stages)
        self.ledger.release(self.module, "workspace", WORKSPACE_KEY)

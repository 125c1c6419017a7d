"""The stream ring: one device buffer that a module's streamed segments take turns in (segment_plan.py).

Each streamed segment's weights sit in the ring at the plan's offset, laid out in the order of the store's
host arena, so weights that are neighbours in the arena (consecutive stages) arrive in one copy. The
parameters viewing the ring are made once per plan and rebound for every call.

On CUDA, copies run on the copy stream: a segment's copy first waits for the compute of the segments whose
bytes it overwrites (their `done` events), and records `copied`, which the compute stream waits for before
the segment runs. Ordering lives on the GPU, so the host never blocks and can queue copies as far ahead as
the ring allows. In a captured call the compute stream waits through copy_flags.py's flags instead of the
`copied` events where it can (edges from copies to compute slow a graph's copies). On a CPU the copies are
plain synchronous copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from engine import telemetry
from engine.devices import device_name
from engine.memory.copy_flags import CopyFlags
from engine.memory.segment_plan import Segment, SegmentPlan
from engine.memory.weight_store import WeightStore, aligned


@dataclass
class _Layout:
    binds: list[tuple[dict, str, nn.Parameter]]  # (owner's _parameters, attribute, view of the ring)
    rests: list[tuple[dict, str, nn.Parameter]]  # the same places with their resting parameters
    shared: list[str]  # keys of the segment that a resident segment holds: bound from their replicas
    runs: list[tuple[torch.Tensor, int, int, int]]  # (arena, host offset, ring offset, bytes): one copy each
    reads: list[tuple[str, torch.Tensor]]  # disk homes: (key, ring view) re-read for every copy
    nbytes: int


class StreamRing:
    def __init__(self, store: WeightStore, buffer: torch.Tensor, bus: telemetry.EventBus) -> None:
        self.store = store
        self.buffer = buffer  # uint8 on the compute device
        self.bus = bus
        self.device = buffer.device
        self._layouts: dict[tuple[int, int], _Layout] = {}  # (id(plan), segment index) -> layout
        self._copied: dict[int, torch.cuda.Event] = {}
        self._done: dict[int, torch.cuda.Event] = {}

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def bind(self, plan: SegmentPlan, segment: Segment, resident: frozenset[str]) -> list[str]:
        """Make the ring views the parameters of the segment's modules; returns the keys that a resident
        segment holds instead (the caller binds their replicas)."""
        layout = self._layout(plan, segment, resident)
        for parameters, attribute, parameter in layout.binds:
            parameters[attribute] = parameter
        return layout.shared

    def rest(self, plan: SegmentPlan, segment: Segment, resident: frozenset[str]) -> None:
        """Put the resting parameters back (the ring bytes will be overwritten)."""
        for parameters, attribute, parameter in self._layout(plan, segment, resident).rests:
            parameters[attribute] = parameter

    def copy(
        self,
        plan: SegmentPlan,
        segment: Segment,
        resident: frozenset[str],
        stream: torch.cuda.Stream | None,
        module: str,
        flags: CopyFlags | None = None,
    ) -> None:
        """Queue the copy of `segment`'s weights into the ring (on `stream` on CUDA), then set its flag in
        `flags` when given."""
        layout = self._layout(plan, segment, resident)
        began = time.perf_counter()
        if stream is None:
            self._copy_runs(layout)
        else:
            with torch.cuda.stream(stream):
                for waited in segment.waits:
                    if waited in self._done:
                        stream.wait_event(self._done[waited])
                self._copy_runs(layout)
                if flags is not None:
                    flags.set_after_copy(segment.index)
                event = self._copied.setdefault(segment.index, torch.cuda.Event())
                event.record(stream)
        self.bus.publish(
            "transfer",
            device=device_name(self.device),
            module=module,
            key=f"segment {segment.index}",
            bytes=layout.nbytes,
            direction="h2d",
            seconds=time.perf_counter() - began,
            stream=None if stream is None else str(stream),
        )

    def wait_copied(self, segment: Segment, flags: CopyFlags | None = None) -> None:
        """Make the current (compute) stream wait for the segment's copy: by polling its flag in `flags`
        when given, else by its event."""
        if flags is not None:
            flags.wait(segment.index)
        elif segment.index in self._copied:
            torch.cuda.current_stream(self.device).wait_event(self._copied[segment.index])

    def mark_done(self, segment: Segment) -> None:
        """Record on the compute stream that the segment no longer reads its ring bytes."""
        if self.device.type == "cuda":
            self._done.setdefault(segment.index, torch.cuda.Event()).record()

    def forget(self, plan: SegmentPlan) -> None:
        """Drop the cached layouts of other plans than `plan`."""
        self._layouts = {k: v for k, v in self._layouts.items() if k[0] == id(plan)}

    def _copy_runs(self, layout: _Layout) -> None:
        non_blocking = self.device.type == "cuda"
        for arena, host_offset, ring_offset, nbytes in layout.runs:
            self.buffer[ring_offset : ring_offset + nbytes].copy_(
                arena[host_offset : host_offset + nbytes], non_blocking=non_blocking
            )
        for key, view in layout.reads:
            view.copy_(self.store.read_host(key))  # pageable: the driver stages it before returning

    def _layout(self, plan: SegmentPlan, segment: Segment, resident: frozenset[str]) -> _Layout:
        cached = self._layouts.get((id(plan), segment.index))
        if cached is not None:
            return cached
        candidates = [k for k in dict.fromkeys(segment.keys) if self.store.home(k) != "device"]
        keys = [k for k in candidates if k not in resident]
        spans = {k: self.store.host_span(k) for k in keys}
        in_arena = sorted((k for k in keys if spans[k] is not None), key=lambda k: spans[k][1])
        binds: list[tuple[dict, str, nn.Parameter]] = []
        rests: list[tuple[dict, str, nn.Parameter]] = []
        runs: list[tuple[torch.Tensor, int, int, int]] = []
        reads: list[tuple[str, torch.Tensor]] = []
        cursor = segment.ring_offset
        for key in in_arena + [k for k in keys if spans[k] is None]:
            dtype, shape, nbytes = self.store.layout(key)
            view = self.buffer[cursor : cursor + nbytes].view(dtype).view(shape)
            parameter = nn.Parameter(view, requires_grad=False)
            for places, attribute, resting in self.store.places(key):
                binds.append((places, attribute, parameter))
                rests.append((places, attribute, resting))
            span = spans[key]
            if span is None:
                reads.append((key, view))
            elif runs and runs[-1][0] is span[0] and runs[-1][1] + runs[-1][3] == span[1] \
                    and runs[-1][2] + runs[-1][3] == cursor:
                arena, host, ring, length = runs[-1]
                runs[-1] = (arena, host, ring, length + aligned(nbytes))
            else:
                runs.append((span[0], span[1], cursor, aligned(nbytes)))
            cursor += aligned(nbytes)
        if cursor - segment.ring_offset > segment.ring_bytes:
            raise ValueError(
                f"segment {segment.index} needs {cursor - segment.ring_offset} ring bytes, "
                f"the plan gave it {segment.ring_bytes}"
            )
        shared = [k for k in candidates if k in resident]
        layout = _Layout(binds, rests, shared, runs, reads, sum(self.store.layout(k)[2] for k in keys))
        self._layouts[(id(plan), segment.index)] = layout
        return layout

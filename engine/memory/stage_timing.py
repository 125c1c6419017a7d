"""Timing a module's stages on the calls that measure an input shape (segments.py plans with the results).

Each measuring call reports, per stage, its time and the workspace at its peak. On a CPU the time is the wall
clock and the workspace twice the largest tensor of the stage states (no allocator report). On CUDA the time
is the stage's GPU time and the workspace the peak of `torch.cuda.max_memory_allocated` during the stage,
less the weights on the device, less what was allocated before the call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.models.staged import State

WORKSPACE_SLACK = 4 * 1024**2  # added to a measured CUDA workspace: the caching allocator rounds blocks up
_CYCLES_PER_SECOND: dict[int, float] = {}  # CUDA device index -> clock rate seen by torch.cuda._sleep
MIN_HOLD, MAX_HOLD = 0.5e-3, 10e-3  # seconds the GPU is held before each measured stage
TIMED_CALLS = 2  # CUDA calls of a shape that time its stages: the first also loads kernels, autotunes
# seconds a timed CUDA stage takes beyond its time in a graph replay (events, the hold's hand-over): the
# H200's stage times summed to 13.9 and 46.7 ms for SD1.5's 149 and SDXL's 343 stages against replayed steps
# of 12.3 and 43.2 ms, 10.7 and 10.2 us a stage (bench/results/stage_profile_cuda_20261130_044004.log)
TIMING_OVERHEAD = 10e-6


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in `value` (nested dicts, lists and tuples), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors_of(v)]
    return []


def largest_tensor_bytes(state: State) -> int:
    return max((t.numel() * t.element_size() for t in tensors_of(state)), default=0)


@dataclass(frozen=True)
class StageProfile:
    """What the measuring calls of an input shape saw, per stage: seconds (GPU time on CUDA; the least of
    the calls) and workspace bytes at the stage's peak (the last call's)."""

    seconds: list[float]
    workspace: list[int]


_CYCLES_PER_SECOND: dict[int, float] = {}  # CUDA device index -> clock rate seen by torch.cuda._sleep
MIN_HOLD, MAX_HOLD = 0.5e-3, 10e-3  # seconds the GPU is held before each measured stage
TIMED_CALLS = 2  # CUDA calls of a shape that time its stages: the first also loads kernels, autotunes
# seconds a timed CUDA stage takes beyond its time in a graph replay (events, the hold's hand-over): the
# H200's stage times summed to 13.9 and 46.7 ms for SD1.5's 149 and SDXL's 343 stages against replayed steps
# of 12.3 and 43.2 ms, 10.7 and 10.2 us a stage (bench/results/stage_profile_cuda_20261130_044004.log)
TIMING_OVERHEAD = 10e-6


def _cycles_per_second(device: torch.device) -> float:
    """The rate of `torch.cuda._sleep`'s spin loop on `device`, measured once (0 where torch lacks it: the
    stages are then timed without a hold, launch-bound as they run)."""
    if not hasattr(torch.cuda, "_sleep"):
        return 0.0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_SECOND:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up: the first launch loads the kernel
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_SECOND[index] = cycles / max(start.elapsed_time(end) / 1e3, 1e-6)
    return _CYCLES_PER_SECOND[index]


class StageTiming:
    """Per-stage times and workspace peaks of one call (the first of an input shape, on CUDA the first two).

    On CUDA each stage's time is its GPU time, not the host's: before a stage the GPU spins in a sleep
    kernel for three times as long as the host took to queue the previous stage (within MIN_HOLD and
    MAX_HOLD), so the stage's kernels are all queued when its start event fires and run back to back. A
    host time longer than the hold may include waiting for the GPU (a synchronising copy): it counts as the
    hold, so holds grow threefold per stage at most and never with the wait. Without the hold a launch-bound
    call (most eager calls) would time the host's launches, and streamed bytes would follow the wrong pace.
    Each time is less TIMING_OVERHEAD (at most half of it): the stages' times then sum to a replayed call's.
    """

    def __init__(self, device: torch.device, weights_on_device: Callable[[], int], state: State,
                 count: int) -> None:
        """Times `count` stages on `device`; `weights_on_device()` gives the weight bytes on it now (not
        workspace)."""
        self.device = device
        self.weights_on_device = weights_on_device
        self.cuda = device.type == "cuda"
        self.largest = [largest_tensor_bytes(state)]
        self.seconds = [0.0] * count
        self.peaks = [0] * count  # workspace bytes at each stage's peak
        self.workspace = 0
        self._events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._began = 0.0
        self._hold = MIN_HOLD  # seconds the GPU spins before the next stage
        if self.cuda:
            self.base = torch.cuda.memory_allocated(device) - weights_on_device()
            self._rate = _cycles_per_second(device)

    def before(self, index: int) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            if self._rate:
                torch.cuda._sleep(int(self._hold * self._rate))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((index, start, end))
        self._began = time.perf_counter()

    def after(self, index: int, state: State) -> None:
        host = time.perf_counter() - self._began
        if self.cuda:
            self._hold = min(MAX_HOLD, max(MIN_HOLD, 3 * min(host, self._hold)))
            self._events[-1][2].record()
            peak = torch.cuda.max_memory_allocated(self.device) - self.weights_on_device()
            self.peaks[index] = max(self.peaks[index], peak - self.base)
            self.workspace = max(self.workspace, peak - self.base)
        else:
            self.seconds[index] = host
            self.largest.append(largest_tensor_bytes(state))
            self.peaks[index] = 2 * max(self.largest[-2:])

    def finish(self) -> tuple[int, list[float]]:
        """(workspace bytes, seconds per stage)."""
        if not self.cuda:
            return 2 * max(self.largest), self.seconds
        if self._events:
            self._events[-1][2].synchronize()
        for index, start, end in self._events:
            elapsed = start.elapsed_time(end) / 1e3
            self.seconds[index] += max(elapsed - TIMING_OVERHEAD, elapsed / 2)
        workspace = max(self.workspace, 0)
        return workspace + min(WORKSPACE_SLACK, workspace // 16), self.seconds

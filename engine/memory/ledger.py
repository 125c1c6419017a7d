"""The ledger of one device: managed budget, reserve, and the weights and workspaces tracked per module.

Capacity rules of reference/000 and /001: a positive `--max-vram` is a managed budget from which every
tracked allocation (weights and workspaces of every module sharing the device) is deducted; live free
memory can lower the limit further, keeping `reserve_bytes` (512 MiB) of it for scratch buffers, and a
free-memory report is capped by the device's total minus what is tracked. Allocations are checked here
before torch allocates anything, so going over the budget is a clear `BudgetExceeded`, not an OOM.

Workspaces can be idle (kept for reuse between segments); re-allocating an idle workspace of the same key
and no larger size costs nothing, and idle workspaces are the first thing the weight store reclaims.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine import telemetry
from engine.devices import GIB, ComputeDevice, memory_info

MIB = 1024**2
DEFAULT_RESERVE = 512 * MIB
CUBLAS_STREAMS = 2  # streams that run matrix products: the compute stream and CUDA graphs' capture stream
# Reserved memory that no tensor holds under a CUDA budget: expandable segments map 2 MiB pages, a
# graph's private pool and the stream ring's blocks freed on another stream wait before reuse. Measured
# as reserved minus the tracked peak over whole jobs (bench/e2e.py, H100, 2026-12-05): 35-127 MiB at
# budgets of 1-4 GiB, about constant, so it is a fixed amount that a budget keeps free of plans.
ALLOCATOR_SLACK = 64 * MIB
RUN_REFRESH = 0.5  # seconds: how stale the live free-memory reading may be when a run starts
KINDS = ("weights", "workspace")

FreeMemoryFn = Callable[[], tuple[int, int]]  # () -> (total_bytes, free_bytes)


class BudgetExceeded(MemoryError):
    """An allocation (or a stage of a segment plan) that does not fit the device's managed budget."""


@dataclass
class _Allocation:
    nbytes: int
    idle: bool = False  # workspaces only: not in use, reclaimable
    pooled: bool = False  # held in a private allocator pool that the free-memory report counts as free


def resolve_budget(
    spec_value: float | None, device: ComputeDevice, free_memory_fn: FreeMemoryFn | None = None
) -> int | None:
    """Budget bytes for a `--max-vram` GiB value: positive = that budget, 0 or None = no managed budget
    (live free memory only), negative = free memory now minus that many GiB (a snapshot at startup)."""
    if spec_value is None or spec_value == 0:
        return None
    if spec_value > 0:
        return int(spec_value * GIB)
    _, free = (free_memory_fn or (lambda: memory_info(device)))()
    return max(0, free - int(-spec_value * GIB))


@functools.cache
def use_expandable_segments() -> bool:
    """Let torch's CUDA caching allocator grow and shrink one mapped range per pool (expandable segments)
    unless the user set PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF. With fixed segments, blocks of one
    size cannot serve another, and the reserved memory nvidia-smi shows ran 14-60% over `--max-vram` while
    the allocated peak kept it (bench/e2e.py on the H200, session 17: SD1.5 1.32 GiB reserved at 1 GiB,
    SDXL 1.64 at 1 GiB); with them it stayed within 10%. Returns whether the setting is on; decided once
    per process."""
    import os

    import torch

    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return "expandable_segments:true" in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
                                              + os.environ.get("PYTORCH_ALLOC_CONF", "")).lower()
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # an older torch, or a platform without the driver calls
        return False
    return True


def cublas_workspace_bytes(device: ComputeDevice) -> int:
    """The workspace torch gives cuBLAS on each CUDA stream that runs a matrix product (32 MiB on an H200),
    measured on a new stream and handed back (torch keeps one per stream for good, outside any ledger)."""
    import torch

    with torch.cuda.device(device.torch_device):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            a = torch.ones(8, 8, dtype=torch.float16, device=device.torch_device)
            before = torch.cuda.memory_allocated()
            product = a @ a
            workspace = torch.cuda.memory_allocated() - before - product.untyped_storage().nbytes()
            stream.synchronize()
        del a, product
        torch._C._cuda_clearCublasWorkspaces()  # the probe stream's (and the others', made again on use)
    return max(0, workspace - 512)  # the product's block rounds up to 512 bytes


def live_free_memory(device: ComputeDevice) -> FreeMemoryFn:
    """The free-memory report of `device`; on CUDA, blocks cached by torch's allocator count as free."""

    def report() -> tuple[int, int]:
        total, free = memory_info(device)
        if device.torch_device.type == "cuda":
            import torch

            stats = torch.cuda.memory_stats_as_nested_dict(
                device.torch_device
            )  # the flat form is 100x slower
            free += stats["reserved_bytes"]["all"]["current"] - stats["allocated_bytes"]["all"]["current"]
        return total, free

    return report


class DeviceLedger:
    def __init__(
        self,
        device_name: str,
        budget_bytes: int | None,
        reserve_bytes: int = DEFAULT_RESERVE,
        free_memory_fn: FreeMemoryFn | None = None,
        bus: telemetry.EventBus | None = None,
    ) -> None:
        """`budget_bytes` None = no managed budget; `free_memory_fn` None = no live limit (budget only)."""
        if budget_bytes is None and free_memory_fn is None:
            raise ValueError(
                f"device {device_name!r}: a ledger needs a budget, a free-memory report, or both"
            )
        self.device_name = device_name
        self.budget_bytes = budget_bytes
        self.reserve_bytes = reserve_bytes
        self.free_memory_fn = free_memory_fn
        self.bus = bus or telemetry.bus
        self.peak_tracked = 0
        self._lock = threading.RLock()
        self._tracked: dict[tuple[str, str, str], _Allocation] = {}  # (module, kind, key) -> allocation
        self._workspaces: dict[tuple[str, str], _Allocation] = {}  # (module, key): the workspaces of _tracked
        self._live: tuple[int, int, int] | None = None  # (total, free, tracked) at the last refresh
        self._on_release: dict[tuple[str, str, str], Callable[[], None]] = {}
        self._refreshed_at = 0.0
        self._total = 0  # tracked bytes, kept as allocations come and go
        self._by_kind: dict[str, int] = {}

    @classmethod
    def for_device(
        cls,
        device: ComputeDevice,
        max_vram_gib: float | None,
        reserve_bytes: int = DEFAULT_RESERVE,
        bus: telemetry.EventBus | None = None,
    ) -> DeviceLedger:
        """A ledger of a real device: budget from `--max-vram` semantics, live free memory from the device."""
        free_fn = live_free_memory(device)
        budget = resolve_budget(max_vram_gib, device, free_fn)
        ledger = cls(device.name, budget, reserve_bytes, free_fn, bus)
        if device.torch_device.type == "cuda":
            use_expandable_segments()  # before cuBLAS' workspaces, the first of the job's allocations
            ledger.track_library("cuBLAS", CUBLAS_STREAMS * cublas_workspace_bytes(device))
            if budget is not None:  # what nvidia-smi shows (reserved) is what a user holds the budget to
                ledger.track_library("allocator", ALLOCATOR_SLACK)
        return ledger

    def tracked(self, module: str | None = None, kind: str | None = None) -> int:
        """Tracked bytes, optionally of one module and/or kind (all, or all of a kind: O(1))."""
        with self._lock:
            if module is None:
                return self._total if kind is None else self._by_kind.get(kind, 0)
            if kind == "workspace":
                return sum(a.nbytes for (m, _), a in self._workspaces.items() if m == module)
            return sum(
                a.nbytes
                for (m, k, _), a in self._tracked.items()
                if (module is None or m == module) and (kind is None or k == kind)
            )

    def workspace(self, module: str, key: str) -> int:
        """Bytes of one tracked workspace (0 when it is not tracked)."""
        with self._lock:
            allocation = self._workspaces.get((module, key))
            return allocation.nbytes if allocation is not None else 0

    def refresh(self, max_age: float = 0.0) -> None:
        """Read the device's free memory now (unless the last reading is under `max_age` seconds old); until
        the next refresh, tracked changes update the reading.

        The runner refreshes at the start of a run at most every RUN_REFRESH seconds (reference/000: live free
        memory lowers the limit of each graph run), which keeps the driver and allocator queries (about a
        millisecond) out of the per-step path.
        """
        if self.free_memory_fn is None:
            return
        now = time.monotonic()
        if max_age and self._live is not None and now - self._refreshed_at < max_age:
            return
        total, free = self.free_memory_fn()
        with self._lock:
            pooled = sum(a.nbytes for a in self._workspaces.values() if a.pooled)
            self._live = (total, max(0, free - pooled), self.tracked())
            self._refreshed_at = now

    def mark_pooled(self, module: str, kind: str, key: str) -> None:
        """The tracked bytes of (module, kind, key) sit in a private allocator pool (a CUDA graph's): the
        report counts that pool's unused blocks as free though nothing else can use them, so each refresh
        takes them off again."""
        with self._lock:
            allocation = self._tracked.get((module, kind, key))
            if allocation is not None:
                allocation.pooled = True
                self._live = None  # the next reading applies it

    def free(self) -> int | None:
        """Live free bytes (capped by total minus tracked), or None without a free-memory report."""
        if self.free_memory_fn is None:
            return None
        if self._live is None:
            self.refresh()
        total, free_then, tracked_then = self._live
        tracked = self.tracked()
        return min(free_then - (tracked - tracked_then), total - tracked)

    def headroom(self) -> int:
        """min(budget - tracked, live free - reserve): negative when the device is already over a limit
        (a lowered budget, another process's allocations), so that freeing X bytes gains less than X."""
        with self._lock:
            limits = []
            if self.budget_bytes is not None:
                limits.append(self.budget_bytes - self.tracked())
            free = self.free()
            if free is not None:
                limits.append(free - self.reserve_bytes)
            return min(limits)

    def available(self) -> int:
        """Bytes a new allocation may take: the headroom, never negative."""
        return max(0, self.headroom())

    def would_fit(self, nbytes: int) -> bool:
        return nbytes <= self.available()

    def allocate(self, module: str, kind: str, key: str, nbytes: int) -> None:
        """Track `nbytes` for (module, kind, key), or raise BudgetExceeded without tracking anything.

        A workspace key that is already tracked is reused: it becomes active and grows only if needed.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown allocation kind {kind!r}; accepted: {', '.join(KINDS)}")
        with self._lock:
            existing = self._tracked.get((module, kind, key))
            if existing is not None and kind == "weights":
                raise ValueError(f"weights {key!r} of {module!r} are already tracked on {self.device_name}")
            delta = nbytes - existing.nbytes if existing is not None else nbytes
            if delta > 0 and delta > self.available():
                raise BudgetExceeded(self._refusal(module, kind, key, delta))
            if existing is not None:
                existing.idle = False
                if delta <= 0:
                    return
                existing.nbytes = nbytes
            else:
                self._tracked[(module, kind, key)] = _Allocation(nbytes)
                if kind == "workspace":
                    self._workspaces[(module, key)] = self._tracked[(module, kind, key)]
            self._count(kind, delta)
            self.peak_tracked = max(self.peak_tracked, self.tracked())
            self._publish(module, kind, key, delta)

    def _count(self, kind: str, delta: int) -> None:
        self._total += delta
        self._by_kind[kind] = self._by_kind.get(kind, 0) + delta

    def track_library(self, library: str, nbytes: int) -> None:
        """Track memory a library keeps for good on this device (cuBLAS' workspaces): a workspace of module
        `library` that is never idle, so it is never reclaimed. It is there whether it fits or not, so it is
        tracked without the budget check."""
        with self._lock:
            previous = self._tracked.get((library, "workspace", "library"))
            delta = nbytes - (previous.nbytes if previous is not None else 0)
            allocation = _Allocation(nbytes)
            self._tracked[(library, "workspace", "library")] = allocation
            self._workspaces[(library, "library")] = allocation
            self._count("workspace", delta)
            self.peak_tracked = max(self.peak_tracked, self.tracked())
            self._publish(library, "workspace", "library", delta)

    def set_idle(self, module: str, key: str) -> None:
        """Mark a workspace as not in use: kept for reuse, reclaimable under pressure."""
        with self._lock:
            self._tracked[(module, "workspace", key)].idle = True

    def idle_workspaces(self) -> list[tuple[str, str, int]]:
        """(module, key, bytes) of every idle workspace, oldest first."""
        with self._lock:
            return [(m, key, a.nbytes) for (m, key), a in self._workspaces.items() if a.idle]

    def on_release(self, module: str, kind: str, key: str, callback: Callable[[], None]) -> None:
        """Call `callback` when (module, kind, key) is next released, by its owner or by eviction: the owner
        of a real buffer behind a tracked workspace drops the buffer there."""
        with self._lock:
            self._on_release[(module, kind, key)] = callback

    def release(self, module: str, kind: str, key: str) -> int:
        """Stop tracking (module, kind, key); returns the bytes released (0 if it was not tracked)."""
        with self._lock:
            allocation = self._tracked.pop((module, kind, key), None)
            if kind == "workspace":
                self._workspaces.pop((module, key), None)
            callback = self._on_release.pop((module, kind, key), None)
            if allocation is not None:
                self._count(kind, -allocation.nbytes)
                self._publish(module, kind, key, -allocation.nbytes)
        if callback is not None:
            callback()
        return 0 if allocation is None else allocation.nbytes

    def snapshot(self) -> dict:
        """Budget, free, available, peak and tracked bytes per module split into weights and workspace."""
        with self._lock:
            modules: dict[str, dict[str, int]] = {}
            for (module, kind, _), allocation in self._tracked.items():
                modules.setdefault(module, {"weights": 0, "workspace": 0})[kind] += allocation.nbytes
            return {
                "device": self.device_name,
                "budget": self.budget_bytes,
                "reserve": self.reserve_bytes,
                "free": self.free(),
                "available": self.available(),
                "tracked": self.tracked(),
                "peak_tracked": self.peak_tracked,
                "modules": modules,
            }

    def _publish(self, module: str, kind: str, key: str, delta: int) -> None:
        self.bus.publish(
            "ledger",
            device=self.device_name,
            module=module,
            allocation=kind,
            key=key,
            delta=delta,
            tracked=self.tracked(),
        )

    def _refusal(self, module: str, kind: str, key: str, delta: int) -> str:
        snapshot = self.snapshot()
        per_module = (
            ", ".join(
                f"{m}: weights {v['weights'] / MIB:.1f} MiB, workspace {v['workspace'] / MIB:.1f} MiB"
                for m, v in snapshot["modules"].items()
            )
            or "nothing"
        )
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / MIB:.1f} MiB"
        free = "" if snapshot["free"] is None else f", live free {snapshot['free'] / MIB:.1f} MiB"
        return (
            f"{self.device_name}: {kind} {key!r} of {module} needs {delta / MIB:.2f} MiB ({delta} bytes) "
            f"but only "
            f"{snapshot['available'] / MIB:.2f} MiB is available (budget {budget}, reserve "
            f"{self.reserve_bytes / MIB:.0f} MiB{free}; tracked: {per_module})"
        )

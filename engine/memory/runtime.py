"""The per-process memory runtime: ledgers, weight stores and segment runners for every loaded module.

A bundle (diffusion model, text encoder, VAE) registers each of its models here under a module name
(`diffusion`, `te`, `vae`; `te#2` for a second model of the same kind) with a compute device and a weight
home (reference/000: `device`, `cpu`, `disk`). `run(name, model, stages, state)` then runs the model's
stages through that module's `SegmentRunner`: as one resident segment when the module fits, in segments
within the device budget otherwise (reference/001). Before a module runs, other modules' idle replicas on
its device are released if the module would otherwise have to be cut into segments (a text encoder's
copies make room for the diffusion model after the conditioning phase).

Each module has its own `WeightStore` over the shared per-device ledgers, so dropping a module (its bundle
was garbage-collected) frees exactly its weights. `snapshot()` is what the GUI memory panel polls at about
30 Hz: it reads counters under short locks and never queries a driver.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine import telemetry
from engine.devices import ComputeDevice, list_devices, resolve_device
from engine.memory.attention_probe import attention_backends, flash_attention_enabled
from engine.memory.ledger import MIB, BudgetExceeded, DeviceLedger, live_free_memory, resolve_budget
from engine.memory.segments import SegmentRunner
from engine.memory.weight_store import HOMES, Source, WeightStore
from engine.models.staged import Stage, State
from engine.placement import (
    FLASH_ATTN_MODULES,
    MODES,
    MemorySettings,
    PlacementError,
    max_vram_for,
    parse_modes,
    placement_for,
    settings_from_namespace,
)

log = logging.getLogger("sluice.memory")
NODE_PARAMS = ("auto", "device", "cpu", "disk")  # a loader node's params_backend choices


@dataclass(frozen=True)
class ResolvedPlacement:
    """One module's placement after CLI > node > workflow file > defaults."""

    module: str  # diffusion, te, vae
    compute: str  # compute device name
    params: str | None  # device, cpu, disk or another device's name; None = auto-fit decides
    settings: MemorySettings  # the merged settings the placement came from


@dataclass
class _Module:
    name: str  # store module name: diffusion, te, te#2, vae, ...
    kind: str  # diffusion, te, vae, ...
    device: ComputeDevice
    home: str  # device, cpu or disk
    store: WeightStore
    runner: SegmentRunner
    keys: list[str]
    aliases: dict[tuple[str, ...], nn.Module]  # root-parameter views (see _expose_root_parameters)
    summary: tuple[int, int] | None = None  # (workspace bytes, segments) of the last logged run


@dataclass(frozen=True)
class ModuleMemory:
    """What a bundle carries: the runtime and the module names of its models (one per model)."""

    runtime: MemoryRuntime
    names: tuple[str, ...]
    kind: str  # diffusion, te, vae
    compute: str  # compute device name
    params: str  # device, cpu or disk
    models: tuple[nn.Module, ...] = ()  # the registered models, in the order of `names`

    def holds(self, index: int, model: nn.Module) -> bool:
        """Whether `model` is the registered one (a LoRA-patched copy is not: it runs as a plain module)."""
        return index < len(self.models) and self.models[index] is model

    def run(self, index: int, model: nn.Module, stages: Sequence[Stage], state: State) -> State:
        return self.runtime.run(self.names[index], model, stages, state)

    def release(self) -> int:
        """Drop the device copies of every model of the bundle (end of its phase)."""
        return sum(self.runtime.release(name) for name in self.names)


class MemoryRuntime:
    def __init__(
        self,
        settings: MemorySettings | None = None,
        devices: Sequence[ComputeDevice] | None = None,
        bus: telemetry.EventBus | None = None,
        ledgers: Mapping[str, DeviceLedger] | None = None,
    ) -> None:
        """`ledgers` replaces the ledgers of the named devices (tests give the CPU a managed budget)."""
        self.settings = settings or MemorySettings()
        self.devices = list(devices) if devices is not None else list_devices()
        self.bus = bus or telemetry.bus
        self.ledgers: dict[str, DeviceLedger] = dict(ledgers or {})
        self.overrides: dict[str, Any] = {}  # explicit CLI flags, above every node and workflow setting
        self.published_plan: str | None = None  # the last auto-fit plan announced (printed once)
        self._own_ledgers: set[str] = set()
        self._modules: dict[str, _Module] = {}
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- configuration

    def configure(self, settings: MemorySettings) -> None:
        """Process-wide settings (budgets, prefetch, segmentation); existing ledgers get the new budgets."""
        with self._lock:
            self.settings = settings
            for name, ledger in self.ledgers.items():
                if name not in self._own_ledgers:
                    continue  # given by the caller with its own budget
                device = self.device(name)
                ledger.budget_bytes = resolve_budget(
                    max_vram_for(device, settings.max_vram, self.devices), device, ledger.free_memory_fn
                )
            for module in self._modules.values():
                module.runner.prefetch = settings.prefetch and module.device.torch_device.type == "cuda"
                module.runner.segmented = settings.segmented

    def resolve_placement(
        self,
        module: str,
        workflow_memory: Mapping[str, Any] | None = None,
        node_backend: str = "auto",
        node_params: str = "auto",
    ) -> ResolvedPlacement:
        """Placement of `module` from the CLI flags (`overrides`), a loader node's backend/params_backend
        (when not "auto"), the workflow file's settings["memory"] and the defaults, in that precedence.

        Also applies the process-wide part (budgets, prefetch, segmentation) to the runtime.
        """
        params_choice = node_params.strip().lower()
        if params_choice not in NODE_PARAMS:
            accepted = ", ".join(NODE_PARAMS)
            raise PlacementError(f"unknown params_backend {node_params!r}; accepted: {accepted}")
        workflow = MemorySettings.from_dict(workflow_memory or {})
        flags = argparse.Namespace(**self.overrides)
        process = settings_from_namespace(flags, workflow)
        if _process_part(process) != _process_part(self.settings):
            self.configure(process)
        backend = workflow.backend
        if node_backend.strip().lower() not in ("", "auto"):
            self.device(node_backend)  # a clear DeviceError for a name that resolves to nothing
            backend = f"{backend},{module}={node_backend.strip()}"
        settings = settings_from_namespace(flags, dataclasses.replace(workflow, backend=backend))
        placement = placement_for(module, settings, self.devices)
        if len(placement.compute) > 1:
            log.warning("%s: multi-device (%s) execution is not implemented yet; computing on %s", module,
                        "&".join(placement.compute), placement.compute[0])
        compute = self.device(placement.compute[0])
        cli_params = self.overrides.get("params_backend") or any(
            self.overrides.get(flag) for flag in ("offload_to_cpu", "dit_offload", "text_encoder_offload",
                                                  "vae_offload"))
        if cli_params or (params_choice == "auto" and settings.params_backend is not None):
            params: str | None = placement.params
        elif params_choice != "auto":
            unified = params_choice == "cpu" and compute.kind in ("cpu", "igpu")
            params = "device" if unified else params_choice
        else:
            params = None if settings.auto_fit else "device"
        return ResolvedPlacement(placement.module, compute.name, params, settings)

    def device(self, name: str) -> ComputeDevice:
        return resolve_device(name, self.devices)

    def ledger(self, device_name: str) -> DeviceLedger:
        """The ledger of a device, created on first use with the `--max-vram` budget that applies to it."""
        with self._lock:
            device = self.device(device_name)
            if device.name not in self.ledgers:
                gib = max_vram_for(device, self.settings.max_vram, self.devices)
                free = live_free_memory(device)
                self.ledgers[device.name] = DeviceLedger(
                    device.name, resolve_budget(gib, device, free), free_memory_fn=free, bus=self.bus
                )
                self._own_ledgers.add(device.name)
            return self.ledgers[device.name]

    # ---------------------------------------------------------------- modules

    def register(self, kind: str, model: nn.Module, home: str, device_name: str, source: Source) -> str:
        """Give `model`'s parameters their home (read from `source` now unless disk); returns its name."""
        if home not in HOMES:
            raise ValueError(f"unknown weight home {home!r}; accepted: {', '.join(HOMES)}")
        device = self.device(device_name)
        with self._lock:
            name, count = kind, 1
            while name in self._modules:
                count += 1
                name = f"{kind}#{count}"
            ledger = self.ledger(device.name)
            store = WeightStore({device.name: ledger}, bus=self.bus)
            aliases = _expose_root_parameters(model)
            keys = store.register_model(name, model, home, device.torch_device, source)
            runner = SegmentRunner(
                store,
                ledger,
                device.torch_device,
                prefetch=self.settings.prefetch,
                segmented=self.settings.segmented,
                bus=self.bus,
            )
            self._modules[name] = _Module(name, kind, device, home, store, runner, keys, aliases)
        self.bus.publish(
            "placement",
            module=name,
            component=kind,
            device=device.name,
            params=home,
            weight_bytes=sum(store.nbytes(k) for k in keys),
            source="load",
        )
        log.info("%s: computes on %s, weights %s (%.1f MiB)", name, device.name, home,
                 sum(store.nbytes(k) for k in keys) / MIB)
        return name

    def unregister(self, name: str) -> None:
        """Forget a module: its replicas and device-home weights leave the ledger."""
        with self._lock:
            module = self._modules.pop(name, None)
        if module is None:
            return
        module.store.release_module(name)
        ledger = module.runner.ledger
        for key in module.keys:
            ledger.release(name, "weights", key)
        ledger.release(name, "workspace", "segments")

    def bind_lifetime(self, owner: Any, names: Sequence[str]) -> None:
        """Unregister `names` when `owner` (what the bundle and its clones share) is garbage-collected."""
        weakref.finalize(owner, _unregister_all, weakref.ref(self), tuple(names))

    def modules(self) -> list[str]:
        with self._lock:
            return list(self._modules)

    def _module(self, name: str) -> _Module:
        with self._lock:
            if name not in self._modules:
                known = ", ".join(self._modules) or "none"
                raise KeyError(f"no module {name!r} in the memory runtime; registered: {known}")
            return self._modules[name]

    # ---------------------------------------------------------------- running

    def run(self, name: str, model: nn.Module, stages: Sequence[Stage], state: State) -> State:
        """Run `stages` of module `name` on `state` through its segment runner; returns the final state."""
        module = self._module(name)
        stages = _with_aliases(stages, module.aliases)
        self._make_room(module, stages)
        with attention_backends(self._flash_attention(module, model)):
            try:
                state = module.runner.run(stages, state, name)
            except BudgetExceeded:
                if not self._release_others(module):
                    raise
                state = module.runner.run(stages, state, name)
        self._log_summary(module)
        return state

    def _flash_attention(self, module: _Module, model: nn.Module) -> bool:
        """--flash-attn for the module's kind (auto: probed once per device, attention_probe.py)."""
        if module.kind not in FLASH_ATTN_MODULES:
            return True
        modes = parse_modes(self.settings.flash_attn, "--flash-attn", MODES, FLASH_ATTN_MODULES)
        mode = modes.get(module.kind, modes.get("*", "auto"))
        dtype = next(model.parameters()).dtype
        return flash_attention_enabled(module.device.torch_device, mode, dtype)

    def release(self, name: str) -> int:
        """Drop module `name`'s unpinned device replicas; returns the bytes freed."""
        return self._module(name).store.release_module(name)

    def _make_room(self, module: _Module, stages: Sequence[Stage]) -> None:
        """Release other modules' replicas on the device when this module would not fit whole otherwise."""
        store, runner = module.store, module.runner
        keys = {k for stage in stages for k in store.stage_keys(stage)}
        missing = sum(store.nbytes(k) for k in keys if not store.is_resident(k))
        capacity = runner.ledger.available() + store.evictable_bytes(module.device.torch_device)
        if missing and missing > capacity:
            self._release_others(module)

    def _release_others(self, module: _Module) -> int:
        with self._lock:
            others = [m for m in self._modules.values() if m is not module and m.device == module.device]
        freed = sum(m.store.release_module(m.name) for m in others)
        if freed:
            log.info("%s: released %.1f MiB of other modules' device copies on %s", module.name,
                     freed / MIB, module.device.name)
        return freed

    def _log_summary(self, module: _Module) -> None:
        """reference/001's compute-buffer line, when the workspace or the segment count changes."""
        plan = module.runner.plan
        if plan is None:
            return
        summary = (plan.workspace_bytes, len(plan.segments))
        if summary == module.summary:
            return
        module.summary = summary
        memory = "RAM" if module.device.kind == "cpu" else "VRAM"
        segments = f"{len(plan.segments)} segment" + ("s" if len(plan.segments) != 1 else "")
        log.info("%s compute buffer size: %.2f MB(%s) on %s (peak across %s)", module.name,
                 plan.workspace_bytes / MIB, memory, module.device.name, segments)

    # ---------------------------------------------------------------- telemetry

    def snapshot(self) -> dict:
        """Per device: budget, free, weights and workspace per module; per module: placement and plan."""
        with self._lock:
            ledgers = list(self.ledgers.values())
            modules = list(self._modules.values())
        return {
            "devices": {ledger.device_name: ledger.snapshot() for ledger in ledgers},
            "modules": {
                m.name: {
                    "kind": m.kind,
                    "device": m.device.name,
                    "params": m.home,
                    "weights": m.store.snapshot().get(m.name, {}),
                    "plan": m.runner.snapshot(),
                }
                for m in modules
            },
        }


def _process_part(settings: MemorySettings) -> tuple:
    return (settings.max_vram, settings.prefetch, settings.segmented, settings.vae_tiling)


def _unregister_all(runtime_ref: Callable[[], MemoryRuntime | None], names: tuple[str, ...]) -> None:
    runtime = runtime_ref()
    if runtime is not None:
        for name in names:
            runtime.unregister(name)


def _root_parameter_views(stages: Sequence[Stage]) -> list[nn.Module]:
    """Stage modules that hold no parameters themselves but list some of their root's (CLIP's
    positional_embedding and text_projection): they carry the attribute names in `names`."""
    return [
        m
        for stage in stages
        for m in stage.modules
        if getattr(m, "names", None) and not any(sub._parameters for sub in m.modules())
    ]


def _expose_root_parameters(model: nn.Module) -> dict[tuple[str, ...], nn.Module]:
    """Attach a child that holds the same Parameter objects as each root-parameter view, before the store
    registers the model: the store then binds both places, and the child stands in for the view."""
    if not hasattr(model, "stages"):
        return {}
    aliases: dict[tuple[str, ...], nn.Module] = {}
    for view in _root_parameter_views(model.stages()):
        names = tuple(view.names)
        if names in aliases:
            continue
        alias = nn.Module()
        for attribute in names:
            alias._parameters[attribute] = getattr(model, attribute)
        model._modules[f"memory_view_{len(aliases)}"] = alias
        aliases[names] = alias
    return aliases


def _with_aliases(stages: Sequence[Stage], aliases: Mapping[tuple[str, ...], nn.Module]) -> list[Stage]:
    if not aliases:
        return list(stages)
    replaced = []
    for stage in stages:
        modules = tuple(aliases.get(tuple(getattr(m, "names", ())), m) for m in stage.modules)
        replaced.append(stage if modules == stage.modules else Stage(stage.name, modules, stage.run))
    return replaced


_runtime: MemoryRuntime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> MemoryRuntime:
    """The process-wide runtime (created with default settings on first use)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = MemoryRuntime()
        return _runtime


def set_runtime(runtime: MemoryRuntime | None) -> MemoryRuntime | None:
    """Replace the process-wide runtime (tests, or the CLI with its flags); returns the previous one."""
    global _runtime
    with _runtime_lock:
        previous, _runtime = _runtime, runtime
        return previous


def torch_device(name: str) -> torch.device:
    """The torch device of a Sluice device name."""
    return resolve_device(name).torch_device

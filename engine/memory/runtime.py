"""The per-process memory runtime: ledgers, weight stores and segment runners for every loaded module.

A bundle (diffusion model, text encoder, VAE) registers each of its models here under a module name
(`diffusion`, `te`, `vae`; `te#2` for a second model of the same kind) with a compute device and a weight
home (reference/000: `device`, `cpu`, `disk`). `run(name, model, stages, state)` then runs the model's
stages through that module's `SegmentRunner`: as one resident segment when the module fits, in segments
within the device budget otherwise (reference/001). Before a module runs, other modules' idle replicas on
its device are released if the module would otherwise have to be cut into segments (a text encoder's
copies make room for the diffusion model after the conditioning phase).

Each module has its own `WeightStore` over the shared per-device ledgers, so dropping a module (its bundle
was garbage-collected) frees exactly its weights.

A module computed on several devices (reference/000, `diffusion=cuda0&cuda1`) is split. Layer split: its
stages are laid out in contiguous ranges over the devices (layer_split.py), each device's part has its own
store and runner (without segmentation or prefetch, as reference/000 says), and `run` runs each range on its
device, copying the state at the boundaries. Row split: its block linears are sharded by rows over the
devices (row_split.py) and the rest of the model runs on the main device as usual. A model without stages
(layer) or block linears (row) falls back to its first device with a warning. A module on several devices
uses flash attention only when every one of its devices selects it.

`snapshot()` is what the GUI memory panel polls at about 30 Hz: it reads counters under short locks and never
queries a driver.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine import telemetry
from engine.devices import ComputeDevice, device_name, list_devices, resolve_device
from engine.memory.attention_probe import attention_backends, flash_attention_enabled
from engine.memory.conv_probe import conv_backends, conv_direct_enabled
from engine.memory.layer_split import (
    NoLayerSplit,
    SplitViews,
    move_state,
    part_view,
    plan_layer_split,
    split_capacity,
)
from engine.memory.ledger import MIB, BudgetExceeded, DeviceLedger, resolve_budget
from engine.memory.row_split import block_linears, shard_transformer_linears
from engine.memory.segments import SegmentPlan, SegmentRunner, StageProfile
from engine.memory.weight_store import HOMES, Source, WeightStore
from engine.models.staged import Stage, State
from engine.placement import (
    CONV_DIRECT_MODULES,
    FLASH_ATTN_MODULES,
    LAYER_SPLIT_MODULES,
    MODES,
    SPLIT_MODES,
    MemorySettings,
    canonical_module,
    max_vram_for,
    parse_modes,
    resolve_node_placement,
    settings_from_namespace,
)

log = logging.getLogger("sluice.memory")


@dataclass(frozen=True)
class ResolvedPlacement:
    """One module's placement after CLI > node > workflow file > defaults."""

    module: str  # diffusion, te, vae
    compute: str  # main compute device name
    params: str | None  # device, cpu, disk or another device's name; None = auto-fit decides
    settings: MemorySettings  # the merged settings the placement came from
    devices: tuple[str, ...] = ()  # every compute device, main first (set to (compute,) when not given)
    split_mode: str = "layer"  # layer or row; matters only with several devices

    def __post_init__(self) -> None:
        if not self.devices:
            object.__setattr__(self, "devices", (self.compute,))


@dataclass
class _Part:
    """What one device holds of a module: a store and runner (one part per module unless layer split)."""

    device: ComputeDevice
    store: WeightStore
    runner: SegmentRunner
    keys: list[str]
    stages: list[tuple[str, str]] | None = None  # layer split: (first, last) stage name of each range
    logged: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # (workspace, segments) logged


@dataclass
class _Module:
    name: str  # store module name: diffusion, te, te#2, vae, ...
    kind: str  # diffusion, te, vae, ...
    device: ComputeDevice  # the main compute device
    home: str  # device, cpu or disk
    parts: list[_Part]  # in device order (the main device's first, unless it holds no stage)
    aliases: dict[tuple[str, ...], nn.Module]  # root-parameter views (see _expose_root_parameters)
    split: str | None = None  # "layer" or "row" when the module computes on several devices
    devices: tuple[ComputeDevice, ...] = ()  # every compute device, the main one first
    shards: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)  # row: (device, key, bytes)
    views: SplitViews = dataclasses.field(default_factory=SplitViews)  # layer split

    @property
    def store(self) -> WeightStore:
        return self.parts[0].store

    @property
    def runner(self) -> SegmentRunner:
        return self.parts[0].runner


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

    @contextlib.contextmanager
    def holding(self, key: str, nbytes: int) -> Iterator[None]:
        """Track `nbytes` that a caller keeps on the compute device for the duration of the block (a
        sampler's latents, CFG batches and conditioning), as a workspace of the first model's module, so
        that the model's segment plans leave room for it. Other modules' idle copies go first if needed."""
        ledger = self.runtime.ledger(self.compute)
        name = self.names[0]
        try:
            ledger.allocate(name, "workspace", key, nbytes)
        except BudgetExceeded:
            module = self.runtime._module(name)
            self.runtime._release_others(module, module.parts[0])
            module.store.evict_until_fits(nbytes, module.device.torch_device)
            ledger.allocate(name, "workspace", key, nbytes)
        try:
            yield
        finally:
            ledger.release(name, "workspace", key)


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
        self._backend_choices: dict[tuple, bool] = {}  # flash attention and direct convolution choices
        self._split_modes: dict[str, str] = {}  # module -> split mode of its last resolved placement
        self._last_run_on: dict[str, str] = {}  # device name -> the module that ran there last
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
                if module.split == "layer":
                    continue  # split parts never segment or prefetch (reference/000)
                module.runner.prefetch = settings.prefetch and module.device.torch_device.type == "cuda"
                module.runner.segmented = settings.segmented
                module.runner.graphs = settings.cuda_graphs != "off" and module.split != "row"
                module.runner.reset_graph()  # a capture bakes in the attention backends and budgets

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
        placed = resolve_node_placement(module, workflow_memory, node_backend, node_params, self.overrides,
                                        self.devices)
        flags = argparse.Namespace(**self.overrides)
        process = settings_from_namespace(flags, MemorySettings.from_dict(workflow_memory or {}))
        if _process_part(process) != _process_part(self.settings):
            self.configure(process)
        self._split_modes[placed.module] = placed.split_mode
        return ResolvedPlacement(placed.module, placed.compute[0], placed.params, placed.settings,
                                 placed.compute, placed.split_mode)

    def split_mode(self, module: str) -> str:
        """The split mode (layer or row) of `module`'s last resolved placement, else of the settings."""
        module = canonical_module(module)
        if module in self._split_modes:
            return self._split_modes[module]
        modes = parse_modes(self.settings.split_mode, "--split-mode", SPLIT_MODES, LAYER_SPLIT_MODULES)
        return modes.get(module, modes.get("*", "layer")) if module in LAYER_SPLIT_MODULES else "layer"

    def device(self, name: str) -> ComputeDevice:
        return resolve_device(name, self.devices)

    def ledger(self, device_name: str) -> DeviceLedger:
        """The ledger of a device, created on first use with the `--max-vram` budget that applies to it."""
        with self._lock:
            device = self.device(device_name)
            if device.name not in self.ledgers:
                gib = max_vram_for(device, self.settings.max_vram, self.devices)
                self.ledgers[device.name] = DeviceLedger.for_device(device, gib, bus=self.bus)
                self._own_ledgers.add(device.name)
            return self.ledgers[device.name]

    # ---------------------------------------------------------------- modules

    def register(
        self,
        kind: str,
        model: nn.Module,
        home: str,
        device_name: str,
        source: Source,
        devices: Sequence[str] | None = None,
        split_mode: str = "layer",
    ) -> str:
        """Give `model`'s parameters their home (read from `source` now unless disk); returns its name.

        `devices` lists every compute device, `device_name` (the main one) first; with several, the model is
        split over them by `split_mode` (layer or row).
        """
        if home not in HOMES:
            raise ValueError(f"unknown weight home {home!r}; accepted: {', '.join(HOMES)}")
        if split_mode not in SPLIT_MODES:
            raise ValueError(f"unknown split mode {split_mode!r}; accepted: {', '.join(SPLIT_MODES)}")
        main = self.device(device_name)
        listed = [self.device(n) for n in devices] if devices else [main]
        if listed[0].name != main.name or len({d.name for d in listed}) != len(listed):
            raise ValueError(f"devices {'&'.join(d.name for d in listed)} must list {main.name} first and "
                             f"each device once")
        with self._lock:
            name, count = kind, 1
            while name in self._modules:
                count += 1
                name = f"{kind}#{count}"
            aliases = _expose_root_parameters(model)
            entry = _Module(name, kind, main, home, [], aliases)
            if len(listed) > 1 and split_mode == "layer":
                self._register_layer_split(entry, model, home, listed, source)
            elif len(listed) > 1:
                self._register_row_split(entry, model, home, listed, source)
            if not entry.parts:
                entry.parts.append(self._register_part(name, model, home, main, source, split=False))
                entry.devices = (main,)
            self._modules[name] = entry
        weight_bytes = sum(p.store.nbytes(k) for p in entry.parts for k in p.keys) + self._shard_bytes(entry)
        self.bus.publish(
            "placement",
            module=name,
            component=kind,
            device=main.name,
            params=home,
            weight_bytes=weight_bytes,
            source="load",
            devices=[d.name for d in entry.devices],
            split=entry.split,
        )
        log.info("%s: computes on %s%s, weights %s (%.1f MiB)", name, "&".join(d.name for d in entry.devices),
                 f" ({entry.split} split)" if entry.split else "", home, weight_bytes / MIB)
        return name

    def _register_part(
        self, name: str, model: nn.Module, home: str, device: ComputeDevice, source: Source, split: bool
    ) -> _Part:
        """One store and runner on `device` for `model` (a whole model, or a layer-split part's view)."""
        ledger = self.ledger(device.name)
        # keyed by the torch device's name, which the store looks up (tests give fake names the CPU)
        store = WeightStore({device_name(device.torch_device): ledger}, bus=self.bus)
        with _current(device):
            keys = store.register_model(name, model, home, device.torch_device, source)
        runner = SegmentRunner(
            store,
            ledger,
            device.torch_device,
            prefetch=self.settings.prefetch and not split,
            segmented=self.settings.segmented and not split,
            bus=self.bus,
            graphs=self.settings.cuda_graphs != "off" and not split,
        )
        return _Part(device, store, runner, keys)

    def _register_layer_split(
        self, entry: _Module, model: nn.Module, home: str, devices: list[ComputeDevice], source: Source
    ) -> None:
        """Contiguous stage ranges per device in proportion to their capacity; a view registered per part."""
        names = [d.name for d in devices]
        try:
            if not hasattr(model, "stages"):
                raise NoLayerSplit("it is not a staged model")
            stages = _with_aliases(model.stages(), entry.aliases)
            capacities = [split_capacity(self.ledger(name).available()) for name in names]
            plan = plan_layer_split(model, stages, capacities, names)
        except NoLayerSplit as reason:
            log.warning("%s: no layer split over %s: %s; computing on %s", entry.name, "&".join(names),
                        reason, names[0])
            return
        try:
            for device in sorted(plan.owners):
                view, nodes = part_view(model, plan.owners[device])
                part = self._register_part(entry.name, view, home, devices[device], source, split=True)
                part.stages = plan.ranges(stages, device)
                entry.parts.append(part)
                entry.views.add(nodes, len(entry.parts) - 1)
        except BaseException:
            for part in entry.parts:
                self._drop_part(entry.name, part)
            entry.parts.clear()
            raise
        entry.split, entry.devices = "layer", tuple(devices)

    def _register_row_split(
        self, entry: _Module, model: nn.Module, home: str, devices: list[ComputeDevice], source: Source
    ) -> None:
        """Block linears sharded by rows over `devices` (resident there); the rest on the main device."""
        if not block_linears(model):
            log.warning("%s: no transformer-block linears to split by rows; computing on %s", entry.name,
                        devices[0].name)
            return
        capacities = [split_capacity(self.ledger(d.name).available()) for d in devices]
        fractions = capacities if sum(capacities) > 0 else [1] * len(devices)

        def reserve(index: int, shard: str, nbytes: int) -> None:
            key = f"{entry.name}/{shard}"
            self.ledger(devices[index].name).allocate(entry.name, "weights", key, nbytes)
            entry.shards.append((devices[index].name, key, nbytes))

        try:
            shard_transformer_linears(model, [d.torch_device for d in devices], fractions, source, reserve)
            entry.parts.append(self._register_part(entry.name, model, home, devices[0], source, split=False))
            entry.parts[-1].runner.graphs = False  # row shards run on other GPUs' streams, outside a capture
        except BaseException:
            self._drop_shards(entry)
            raise
        entry.split, entry.devices = "row", tuple(devices)

    def _drop_shards(self, entry: _Module) -> None:
        for device, key, _ in entry.shards:
            self.ledger(device).release(entry.name, "weights", key)
        entry.shards.clear()

    @staticmethod
    def _shard_bytes(entry: _Module, device: str | None = None) -> int:
        """Bytes of the module's row-split weight slices (on `device` only, when given)."""
        return sum(nbytes for name, _, nbytes in entry.shards if device is None or name == device)

    def unregister(self, name: str) -> None:
        """Forget a module: its replicas and device-home weights leave the ledger."""
        with self._lock:
            module = self._modules.pop(name, None)
        if module is None:
            return
        for part in module.parts:
            self._drop_part(name, part)
        self._drop_shards(module)

    def _drop_part(self, name: str, part: _Part) -> None:
        part.store.release_module(name)
        ledger = part.runner.ledger
        for key in part.keys:
            ledger.release(name, "weights", key)
        part.runner.release()

    def bind_lifetime(self, owner: Any, names: Sequence[str]) -> None:
        """Unregister `names` when `owner` (what the bundle and its clones share) is garbage-collected."""
        weakref.finalize(owner, _unregister_all, weakref.ref(self), tuple(names))

    def modules(self) -> list[str]:
        with self._lock:
            return list(self._modules)

    def stage_profile(self, name: str) -> StageProfile | None:
        """Per-stage times and workspace peaks of module `name`'s last measured input shape (its main
        device's part)."""
        return self._module(name).runner.profile

    def segment_plan(self, name: str) -> SegmentPlan | None:
        """The plan module `name`'s last call ran with (its main device's part)."""
        return self._module(name).runner.plan

    def _module(self, name: str) -> _Module:
        with self._lock:
            if name not in self._modules:
                known = ", ".join(self._modules) or "none"
                raise KeyError(f"no module {name!r} in the memory runtime; registered: {known}")
            return self._modules[name]

    # ---------------------------------------------------------------- running

    def run(self, name: str, model: nn.Module, stages: Sequence[Stage], state: State) -> State:
        """Run `stages` of module `name` on `state` through its segment runner(s); returns the final state
        (on the main device when the module is layer-split)."""
        module = self._module(name)
        stages = _with_aliases(stages, module.aliases)
        flash, conv = self._flash_attention(module, model), self._conv_direct(module, model)
        with attention_backends(flash), conv_backends(conv):
            if module.split != "layer":
                state = self._run_part(module, module.parts[0], stages, state)
            else:
                for part_index, run in module.views.ranges(stages):
                    part = module.parts[part_index]
                    state = self._run_part(module, part, run, move_state(state, part.device.torch_device))
                state = move_state(state, module.device.torch_device)
        return state

    def _run_part(self, module: _Module, part: _Part, stages: Sequence[Stage], state: State) -> State:
        self._trim_cache_between_modules(module, part)
        self._make_room(module, part, stages)
        with _current(part.device):
            try:
                state = part.runner.run(stages, state, module.name)
            except BudgetExceeded:
                if not self._release_others(module, part):
                    raise
                state = part.runner.run(stages, state, module.name)
        self._log_summary(module, part)
        return state

    def _trim_cache_between_modules(self, module: _Module, part: _Part) -> None:
        """Under a CUDA budget, hand torch's cached free blocks back to the driver when another module starts
        on the device (text encoders, then the diffusion model, then the VAE): the blocks one phase freed
        would otherwise stay reserved beside the next phase's, and what nvidia-smi shows (reserved) grew to
        2.7x a 1 GiB budget for SDXL (bench/e2e.py, session 16). A few milliseconds per phase."""
        device = part.device
        if device.torch_device.type != "cuda" or part.runner.ledger.budget_bytes is None:
            return
        if self._last_run_on.get(device.name) not in (None, module.name):
            torch.cuda.synchronize(device.torch_device)
            torch.cuda.empty_cache()
        self._last_run_on[device.name] = module.name

    def _flash_attention(self, module: _Module, model: nn.Module) -> bool:
        """--flash-attn for the module's kind (auto: probed once per device, attention_probe.py); a module on
        several devices uses it only when every one of them selects it (reference/000)."""
        if module.kind not in FLASH_ATTN_MODULES:
            return True
        return self._backend_choice(module, model, "--flash-attn", self.settings.flash_attn,
                                    FLASH_ATTN_MODULES, flash_attention_enabled)

    def _conv_direct(self, module: _Module, model: nn.Module) -> bool | None:
        """--conv-direct for the module's kind as cuDNN autotuning (conv_probe.py; auto: probed once per
        device); None for kinds without the choice (the global setting stays)."""
        if module.kind not in CONV_DIRECT_MODULES:
            return None
        return self._backend_choice(module, model, "--conv-direct", self.settings.conv_direct,
                                    CONV_DIRECT_MODULES, conv_direct_enabled)

    def _backend_choice(self, module: _Module, model: nn.Module, flag: str, value: str,
                        kinds: Collection[str], enabled: Callable[..., bool]) -> bool:
        """Whether `flag` (its `value`: per-kind on|off|auto) is on for the module on all of its devices;
        decided once per flag, kind, dtype and devices."""
        dtype = _compute_dtype(model)
        key = (flag, module.kind, value, dtype, module.devices)
        if key not in self._backend_choices:
            modes = parse_modes(value, flag, MODES, kinds)
            mode = modes.get(module.kind, modes.get("*", "auto"))
            self._backend_choices[key] = all(enabled(d.torch_device, mode, dtype) for d in module.devices)
        return self._backend_choices[key]

    def release(self, name: str) -> int:
        """Drop module `name`'s unpinned device replicas; returns the bytes freed."""
        return sum(part.store.release_module(name) for part in self._module(name).parts)

    def _make_room(self, module: _Module, part: _Part, stages: Sequence[Stage]) -> None:
        """Release other modules' replicas on the part's device when the part would not fit otherwise
        (counters only: this runs before every step)."""
        store, runner = part.store, part.runner
        missing = store.missing_bytes(module.name)
        if not missing or missing <= runner.ledger.available():
            return
        with self._lock:
            others = any(p.store.replica_bytes(m.name) for m in self._modules.values() if m is not module
                         for p in m.parts if p.device == part.device)
        if others and missing > runner.ledger.available() + store.evictable_bytes(part.device.torch_device):
            self._release_others(module, part)

    def _release_others(self, module: _Module, part: _Part) -> int:
        with self._lock:
            others = [(m, p) for m in self._modules.values() if m is not module
                      for p in m.parts if p.device == part.device]
        freed = sum(p.store.release_module(m.name) for m, p in others)
        if freed:
            log.info("%s: released %.1f MiB of other modules' device copies on %s", module.name,
                     freed / MIB, part.device.name)
        return freed

    def _log_summary(self, module: _Module, part: _Part) -> None:
        """reference/001's compute-buffer line, when the workspace or the segment count changes."""
        plan = part.runner.plan
        if plan is None:
            return
        summary = (plan.workspace_bytes, len(plan.segments))
        if summary in part.logged:
            return
        part.logged.add(summary)
        memory = "RAM" if part.device.kind == "cpu" else "VRAM"
        segments = f"{len(plan.segments)} segment" + ("s" if len(plan.segments) != 1 else "")
        log.info("%s compute buffer size: %.2f MB(%s) on %s (peak across %s)", module.name,
                 plan.workspace_bytes / MIB, memory, part.device.name, segments)

    # ---------------------------------------------------------------- telemetry

    def snapshot(self) -> dict:
        """Per device: budget, free, weights and workspace per module; per module: placement, plan, and each
        part (device, its stages or row slices, weights and plan)."""
        with self._lock:
            ledgers = list(self.ledgers.values())
            modules = list(self._modules.values())
        return {
            "devices": {ledger.device_name: ledger.snapshot() for ledger in ledgers},
            "modules": {m.name: self._module_snapshot(m) for m in modules},
        }

    def _module_snapshot(self, module: _Module) -> dict:
        empty = {"device_home": 0, "replica": 0, "pinned": 0, "offloaded": 0}
        parts: list[dict] = [
            {
                "device": part.device.name,
                "stages": part.stages,
                "weights": part.store.snapshot().get(module.name, dict(empty)),
                "plan": part.runner.snapshot(),
            }
            for part in module.parts
        ]
        if module.split == "row":
            parts[0]["row_slices"] = self._shard_bytes(module, module.device.name)
            parts += [{"device": d.name, "stages": None, "row_slices": self._shard_bytes(module, d.name)}
                      for d in module.devices[1:]]
        weights = dict(empty)
        for part in parts:
            for key, nbytes in part.get("weights", {}).items():
                weights[key] = weights.get(key, 0) + nbytes
        weights["device_home"] += self._shard_bytes(module)
        return {
            "kind": module.kind,
            "device": module.device.name,
            "devices": [d.name for d in module.devices],
            "split": module.split,
            "params": module.home,
            "weights": weights,
            "plan": module.runner.snapshot(),
            "parts": parts,
        }


def _current(device: ComputeDevice) -> contextlib.AbstractContextManager:
    """`device` as torch's current CUDA device (streams and events without a device are its own)."""
    if device.torch_device.type == "cuda":
        return torch.cuda.device(device.torch_device)
    return contextlib.nullcontext()


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model computes in: its `dtype` attribute where it has one, else its first floating-point
    parameter's (a quantised layer's weight is uint8 bytes)."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _process_part(settings: MemorySettings) -> tuple:
    return (settings.max_vram, settings.prefetch, settings.segmented, settings.vae_tiling,
            settings.cuda_graphs, settings.flash_attn, settings.conv_direct)


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


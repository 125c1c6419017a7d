"""Model loader nodes with ComfyUI's names, inputs (in ComfyUI's order) and outputs.

Model-choice widgets list the files of the models folder. Validation reads the choices without a context,
so they come from the settings given to `configure` (or, until then, from `load_settings()`: flags are not
seen there, the environment and the settings file are); running nodes use the executor's settings.

Every loader ends with `backend` (a compute device name, or auto) and `params_backend` (auto, device, cpu,
disk), after ComfyUI's inputs so that ComfyUI's positional widget values still import. Placement
precedence: `sluice run` flags > the node's own values (when not auto) > the workflow's settings["memory"]
> defaults; with no explicit params anywhere, auto-fit plans every loader of the workflow from the file
headers (engine/memory/autofit.py) and each node takes its components' choices. Weight types follow the
same precedence: `--type` / `--tensor-type-rules` (or the workflow's memory settings), else, with an explicit
`--auto-fit`, the ladder's choice in that plan (`node_weight_types`); a GGUF file's quantised weights rest
quantised whatever is chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.devices import DeviceError, resolve_device
from engine.graph.spec import COMBO, Input, NodeType, Output, RunContext, combo_input
from engine.memory.autofit import (
    TYPED_COMPONENTS,
    AutoFitPlan,
    ComponentNeed,
    component_needs,
    plan_placements,
    planning_room,
    publish_plan,
)
from engine.memory.runtime import MemoryRuntime, get_runtime
from engine.models.bundles import MissingComponent
from engine.models.formats import CheckpointError
from engine.models.loader import (
    ADD_LOADER_HINT,
    COMPONENT_NAMES,
    load_checkpoint,
    load_diffusion_model,
    load_text_encoders,
    load_vae,
    parse_dtype,
)
from engine.placement import NODE_PARAMS, MemorySettings, device_choices, settings_from_namespace
from engine.quant.loading import WeightTypes
from engine.settings import Settings, SettingsError, load_settings

COMPUTE_DEVICE = "auto"  # what a node's backend "auto" stands for (the workflow's and CLI's choice)
WEIGHT_DTYPES = ("default", "fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")  # ComfyUI's
CLIP_TYPES = {"stable_diffusion": None, "sd1": "sd1", "sd2": "sd2", "sdxl_refiner": "sdxl_refiner"}
DUAL_CLIP_TYPES = {"sdxl": "sdxl", "flux": "flux"}

_settings: Settings | None = None


def configure(settings: Settings | None) -> None:
    """The settings whose models folder the model-choice widgets list (None: read them when asked)."""
    global _settings
    _settings = settings


def current_settings(settings: Settings | None = None) -> Settings:
    """`settings` when given, else the configured ones, else `load_settings()`."""
    return settings or _settings or load_settings()


def model_choices(kind: str) -> Callable[[], list[str]]:
    """The callable choice list of a model widget: the files of `kind` in the models folder."""
    def choices() -> list[str]:
        try:
            return current_settings().list_models(kind)
        except SettingsError:  # an unreadable settings file: no choices; running the node reports it
            return []

    return choices


def model_path(settings: Settings | None, kind: str, name: str) -> Path:
    return current_settings(settings).resolve_model(kind, name)


def file_fingerprint(*paths: Path) -> tuple:
    """What changes when a model file is replaced: its modification time and size."""
    return tuple((str(p), os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths)


@dataclass(frozen=True)
class DeviceNameInput(Input):
    """A COMBO of the devices that exist (auto, cuda0, ..., cpu) that also accepts any name that resolves to
    one (CPU, cuda:1, gpu, a unique prefix), as workflow files and the CLI may give."""

    def check_value(self, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"{self.name}: expected a device name, got {value!r}"
        if value.strip().lower() in ("", "auto"):
            return None
        try:
            resolve_device(value)
        except DeviceError as error:
            return f"{self.name}: {error}"
        return None


def placement_inputs() -> tuple[Input, ...]:
    return (DeviceNameInput("backend", COMBO, "auto", choices=device_choices,
                            description="where it computes: auto, or a device that exists (cpu, cuda0, ...)"),
            combo_input("params_backend", NODE_PARAMS, "auto",
                        description="where the weights rest: auto (auto-fit), device (where it computes), "
                                    "cpu (pinned RAM), disk (re-read from the file)"))


def _memory_of(workflow: Any) -> dict[str, Any] | None:
    return None if workflow is None else workflow.settings.get("memory")


def _node_backend(backend: str) -> str:
    return COMPUTE_DEVICE if backend.strip().lower() in ("", "auto") else backend


def node_needs(node_id: str, node_type: type[NodeType], widgets: dict[str, Any], settings: Settings | None,
               workflow_memory: dict[str, Any] | None, runtime: MemoryRuntime) -> list[ComponentNeed]:
    """The header-only needs of one loader node's components, with explicit params choices fixed."""
    files = node_type.memory_files(settings, widgets)
    backend, params = _node_backend(widgets.get("backend", "auto")), widgets.get("params_backend", "auto")
    resolved = {m: runtime.resolve_placement(m, workflow_memory, backend, params) for m in files}
    dtype = parse_dtype(widgets.get("weight_dtype", "default"))
    memory = memory_settings(runtime, workflow_memory)
    types, ladder = explicit_weight_types(memory), memory.chooses_weight_types
    needs = []
    for module, paths in files.items():
        parts = [need for path in paths for need in
                 component_needs(path, {module: resolved[module].compute}, node_id, dtype, types, ladder,
                                 runtime.devices)]
        if parts:
            need = _joined(f"{node_id}/{module}", parts)
            needs.append(dataclasses.replace(need, fixed=resolved[module].params,
                                             split=tuple(resolved[module].devices[1:])))
    return needs


def _joined(name: str, parts: list[ComponentNeed]) -> ComponentNeed:
    """One need for a module read from several files (DualCLIPLoader): bytes summed, and each ladder rung
    any part has summed over the parts (a part without it at its own bytes)."""
    rungs = list(dict.fromkeys(v.variant for part in parts for v in part.variants))

    def rung_bytes(part: ComponentNeed, rung: str) -> tuple[int, int]:
        found = next((v for v in part.variants if v.variant == rung), part)
        return found.weight_bytes, found.largest_tensor_bytes

    variants = tuple(
        dataclasses.replace(parts[0], name=name, variant=rung, variants=(), type_reason="",
                            weight_bytes=sum(rung_bytes(p, rung)[0] for p in parts),
                            largest_tensor_bytes=max(rung_bytes(p, rung)[1] for p in parts))
        for rung in rungs)
    return dataclasses.replace(parts[0], name=name, weight_bytes=sum(p.weight_bytes for p in parts),
                               largest_tensor_bytes=max(p.largest_tensor_bytes for p in parts),
                               variants=variants)


def memory_settings(runtime: MemoryRuntime, workflow_memory: dict[str, Any] | None) -> MemorySettings:
    """The memory settings a loader runs under: the CLI flags over the workflow's settings["memory"]."""
    return settings_from_namespace(argparse.Namespace(**runtime.overrides),
                                   MemorySettings.from_dict(workflow_memory or {}))


def explicit_weight_types(settings: MemorySettings) -> WeightTypes | None:
    """--type and --tensor-type-rules as WeightTypes, or None when neither is given."""
    if not (settings.weight_type or settings.tensor_type_rules):
        return None
    return WeightTypes(settings.weight_type.upper() or None, settings.tensor_type_rules)


def workflow_plan(workflow: Any, settings: Settings | None, runtime: MemoryRuntime | None = None,
                  problems: list[str] | None = None) -> AutoFitPlan:
    """The auto-fit plan of every loader node of `workflow`, from file headers alone (nothing is loaded).
    A loader whose file cannot be read is left out; what was wrong with it is appended to `problems`
    ("node 4 (CheckpointLoaderSimple): ..."), when given."""
    runtime = runtime or get_runtime()
    needs = []
    for node_id, node in workflow.nodes.items():
        node_type = LOADERS.get(node.type)
        if node_type is None or node.mode != "normal":
            continue
        widgets = {**node_type.default_widget_values(), **node.widgets}
        try:
            needs += node_needs(node_id, node_type, widgets, settings, _memory_of(workflow), runtime)
        except (CheckpointError, SettingsError, OSError, ValueError) as error:
            if problems is not None:
                problems.append(f"node {node_id} ({node.type}): {error}")
    gpu_room, ram_room = planning_room(runtime.devices, runtime.settings)
    return plan_placements(needs, gpu_room, ram_room)


def _node_plan(ctx: RunContext, node_type: type[NodeType], widgets: dict[str, Any], runtime: MemoryRuntime,
               ) -> AutoFitPlan:
    """The auto-fit plan a running loader node takes its choices from (published once per change)."""
    if ctx.workflow is not None and ctx.node_id in ctx.workflow.nodes:
        plan = workflow_plan(ctx.workflow, ctx.settings, runtime)
    else:
        needs = node_needs(ctx.node_id, node_type, widgets, ctx.settings, _memory_of(ctx.workflow), runtime)
        plan = plan_placements(needs, *planning_room(runtime.devices, runtime.settings))
    if plan.format() != runtime.published_plan:
        runtime.published_plan = plan.format()
        publish_plan(plan, runtime.bus)
    return plan


def node_targets(ctx: RunContext, node_type: type[NodeType], widgets: dict[str, Any],
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """(compute device, params home) per module of a running loader node, auto-fit included."""
    runtime = get_runtime()
    memory = _memory_of(ctx.workflow)
    backend, params = _node_backend(widgets["backend"]), widgets["params_backend"]
    modules = list(node_type.memory_files(ctx.settings, widgets))
    resolved = {m: runtime.resolve_placement(m, memory, backend, params) for m in modules}
    homes = {m: r.params for m, r in resolved.items()}
    if any(home is None for home in homes.values()):
        plan = _node_plan(ctx, node_type, widgets, runtime)
        for module, home in homes.items():
            if home is None:
                try:
                    homes[module] = plan.choice(f"{ctx.node_id}/{module}").params
                except KeyError:
                    homes[module] = "device"
    return {m: "&".join(r.devices) for m, r in resolved.items()}, homes  # "cuda0&cuda1": a split module


def node_weight_types(ctx: RunContext, node_type: type[NodeType], widgets: dict[str, Any],
                      ) -> dict[str, WeightTypes | None]:
    """The weight types per module of a running loader node (None: the file's own): --type and
    --tensor-type-rules, else the auto-fit ladder's choice when it chooses them."""
    runtime = get_runtime()
    settings = memory_settings(runtime, _memory_of(ctx.workflow))
    modules = list(node_type.memory_files(ctx.settings, widgets))
    explicit = explicit_weight_types(settings)
    if explicit is not None or not settings.chooses_weight_types:
        return {m: explicit if m in TYPED_COMPONENTS else None for m in modules}
    plan = _node_plan(ctx, node_type, widgets, runtime)
    types: dict[str, WeightTypes | None] = {}
    for module in modules:
        try:
            variant = plan.choice(f"{ctx.node_id}/{module}").need.variant
        except KeyError:
            variant = ""
        types[module] = WeightTypes(variant) if variant else None
    return types


def _missing(name: str, component: str, kind: str) -> MissingComponent:
    return MissingComponent(kind, f"checkpoint {name!r} has no {COMPONENT_NAMES[component]}; "
                                  f"{ADD_LOADER_HINT[component]} and connect its {kind} output")


class CheckpointLoaderSimple(NodeType):
    display_name = "Load Checkpoint"
    category = "loaders"
    description = ("Loads a single-file SD1.x / SD2.x / SDXL / FLUX.1 checkpoint: diffusion model, text "
                   "encoder, VAE.")
    memory_module = "diffusion"
    inputs = (combo_input("ckpt_name", model_choices("checkpoints")), *placement_inputs())
    outputs = (Output("MODEL", "MODEL"), Output("CLIP", "CLIP"), Output("VAE", "VAE"))

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "checkpoints", widgets["ckpt_name"]))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        path = model_path(settings, "checkpoints", widgets["ckpt_name"])
        return {"diffusion": [path], "te": [path], "vae": [path]}

    def run(self, ctx: RunContext, ckpt_name: str, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        path = model_path(ctx.settings, "checkpoints", ckpt_name)
        widgets = {"ckpt_name": ckpt_name, "backend": backend, "params_backend": params_backend}
        devices, homes = node_targets(ctx, type(self), widgets)
        types = {m: t for m, t in node_weight_types(ctx, type(self), widgets).items() if t is not None}
        model, clip, vae = load_checkpoint(path, device=devices, params=homes, runtime=get_runtime(),
                                           types=types)
        return (model or _missing(ckpt_name, "diffusion", "MODEL"), clip or _missing(ckpt_name, "te", "CLIP"),
                vae or _missing(ckpt_name, "vae", "VAE"))


class UNETLoader(NodeType):
    display_name = "Load Diffusion Model"
    category = "advanced/loaders"
    description = "Loads a diffusion model (SD UNet or FLUX transformer) from diffusion_models/ (or unet/)."
    memory_module = "diffusion"
    inputs = (combo_input("unet_name", model_choices("diffusion_models")),
              combo_input("weight_dtype", WEIGHT_DTYPES, "default"), *placement_inputs())
    outputs = (Output("MODEL", "MODEL"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "diffusion_models", widgets["unet_name"]))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        return {"diffusion": [model_path(settings, "diffusion_models", widgets["unet_name"])]}

    def run(self, ctx: RunContext, unet_name: str, weight_dtype: str, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        path = model_path(ctx.settings, "diffusion_models", unet_name)
        widgets = {"unet_name": unet_name, "weight_dtype": weight_dtype, "backend": backend,
                   "params_backend": params_backend}
        devices, homes = node_targets(ctx, type(self), widgets)
        types = node_weight_types(ctx, type(self), widgets)["diffusion"]
        return (load_diffusion_model(path, weight_dtype, devices["diffusion"], homes["diffusion"],
                                     get_runtime(), types),)


class CLIPLoader(NodeType):
    display_name = "Load CLIP"
    category = "advanced/loaders"
    description = ("Loads a text encoder file from text_encoders/ (or clip/); stable_diffusion tells SD1, "
                   "SD2 and the SDXL refiner apart by the encoder in the file.")
    memory_module = "te"
    inputs = (combo_input("clip_name", model_choices("text_encoders")),
              combo_input("type", tuple(CLIP_TYPES), "stable_diffusion"), *placement_inputs())
    outputs = (Output("CLIP", "CLIP"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "text_encoders", widgets["clip_name"]))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        return {"te": [model_path(settings, "text_encoders", widgets["clip_name"])]}

    def run(self, ctx: RunContext, clip_name: str, type: str, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        path = model_path(ctx.settings, "text_encoders", clip_name)
        widgets = {"clip_name": clip_name, "backend": backend, "params_backend": params_backend}
        devices, homes = node_targets(ctx, CLIPLoader, widgets)
        types = node_weight_types(ctx, CLIPLoader, widgets)["te"]
        return (load_text_encoders([path], CLIP_TYPES[type], None, devices["te"], homes["te"],
                                   get_runtime(), types),)


class DualCLIPLoader(NodeType):
    display_name = "DualCLIPLoader"
    category = "advanced/loaders"
    description = ("Loads two text encoders from two files: SDXL's CLIP-L and OpenCLIP-bigG (type sdxl), or "
                   "FLUX's CLIP-L and T5-XXL (type flux).")
    memory_module = "te"
    inputs = (combo_input("clip_name1", model_choices("text_encoders")),
              combo_input("clip_name2", model_choices("text_encoders")),
              combo_input("type", tuple(DUAL_CLIP_TYPES), "sdxl"), *placement_inputs())
    outputs = (Output("CLIP", "CLIP"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(*(model_path(settings, "text_encoders", widgets[name])
                                  for name in ("clip_name1", "clip_name2")))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        return {"te": [model_path(settings, "text_encoders", widgets[name])
                       for name in ("clip_name1", "clip_name2")]}

    def run(self, ctx: RunContext, clip_name1: str, clip_name2: str, type: str, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        paths = [model_path(ctx.settings, "text_encoders", name) for name in (clip_name1, clip_name2)]
        widgets = {"clip_name1": clip_name1, "clip_name2": clip_name2, "backend": backend,
                   "params_backend": params_backend}
        devices, homes = node_targets(ctx, DualCLIPLoader, widgets)
        types = node_weight_types(ctx, DualCLIPLoader, widgets)["te"]
        return (load_text_encoders(paths, DUAL_CLIP_TYPES[type], None, devices["te"], homes["te"],
                                   get_runtime(), types),)


class VAELoader(NodeType):
    display_name = "Load VAE"
    category = "loaders"
    description = "Loads a VAE file from vae/."
    memory_module = "vae"
    inputs = (combo_input("vae_name", model_choices("vae")), *placement_inputs())
    outputs = (Output("VAE", "VAE"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "vae", widgets["vae_name"]))

    @classmethod
    def memory_files(cls, settings: Any, widgets: dict[str, Any]) -> dict[str, list[Path]]:
        return {"vae": [model_path(settings, "vae", widgets["vae_name"])]}

    def run(self, ctx: RunContext, vae_name: str, backend: str = "auto",
            params_backend: str = "auto") -> tuple:
        devices, homes = node_targets(ctx, VAELoader, {"vae_name": vae_name, "backend": backend,
                                                       "params_backend": params_backend})
        return (load_vae(model_path(ctx.settings, "vae", vae_name), None, devices["vae"], homes["vae"],
                         get_runtime()),)


NODE_TYPES = (CheckpointLoaderSimple, UNETLoader, CLIPLoader, DualCLIPLoader, VAELoader)
LOADERS = {node_type.type_name: node_type for node_type in NODE_TYPES}

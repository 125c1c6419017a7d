"""Placement strings of reference/000 (stable-diffusion.cpp backend.md) parsed into one placement per module.

Grammar shared by `--backend`, `--params-backend`, `--split-mode`, `--flash-attn` and `--conv-direct`:
a comma-separated list whose entries are either a bare value (the default for every module) or
`module=value`; `all=`, `default=` and `*=` also set the default. A module-specific entry wins over the
default regardless of position; within one string the last entry for the same key wins. Module names are
case-insensitive and ignore `-` and `_`. `&` lists devices (layer split) for diffusion and te only.
`disk` is a parameter residency mode: accepted by `--params-backend`, an error in `--backend`.

`--max-vram` takes GiB: a bare number is the budget of every GPU device (the CPU is budgeted only when
named, e.g. `cpu=8`), `device=GiB` entries set one device; positive = managed budget, 0 = current free
memory, negative = free memory at start minus that many GiB.

Compatibility flags: `--clip-on-cpu`, `--vae-on-cpu`, `--control-net-cpu` (deprecated, with a warning)
prepend `te=cpu`, `vae=cpu`, `controlnet=cpu` to `--backend`; `--offload-to-cpu` prepends `*=cpu` to
`--params-backend`, and edge-dit's `--dit-offload`, `--text-encoder-offload`, `--vae-offload` prepend
`diffusion=cpu`, `te=cpu`, `vae=cpu` (reference/004), so explicit entries still override them. A non-empty
`--params-backend` disables auto-fit. Parameters kept in `cpu` RAM for a CPU or unified-memory (mps)
compute device are simply on the device (edge-dit: offload there is a no-op).

Weight types (stable-diffusion.cpp's `--type` and `--tensor-type-rules`, engine/quant): the GGML type every
eligible weight is quantised to as it loads, and regex=type rules over tensor names. `--auto-fit` given
explicitly (on, or bare as edge-dit takes it) with neither also lets auto-fit choose the types
(reference/004's ladder, engine/memory/autofit.py); auto-fit's default-on placement alone never does.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from engine.devices import ComputeDevice, DeviceError, list_devices, resolve_device

log = logging.getLogger("sluice.placement")

MODULE_ALIASES: dict[str, tuple[str, ...]] = {
    "diffusion": ("model", "unet", "dit"),
    "te": ("clip", "text", "textencoder", "textencoders", "conditioner", "cond", "llm", "t5", "t5xxl"),
    "clip_vision": ("clipvision", "clip-vision", "vision"),
    "vae": ("firststage", "autoencoder", "tae"),
    "controlnet": ("control",),
    "photomaker": ("photomakerid", "pmid", "photo"),
    "upscaler": ("esrgan", "hires"),
    "detector": ("adetailer", "yolo"),
}
MODULES = tuple(MODULE_ALIASES)
AUDIO_ENCODER = "audio_encoder"  # has configurable attention (--flash-attn) but takes no device assignment
DEFAULT = "*"  # the key of the default entry in a parsed assignment
DEFAULT_KEYS = ("all", "default", "*")
LAYER_SPLIT_MODULES = ("diffusion", "te")
FLASH_ATTN_MODULES = ("diffusion", "te", "clip_vision", "vae", "controlnet", AUDIO_ENCODER)
CONV_DIRECT_MODULES = ("diffusion", "vae", "controlnet")
MODES = ("on", "off", "auto")
SPLIT_MODES = ("layer", "row")
_DEVICE_TOKEN = re.compile(r"[a-z][a-z0-9_.:]*")


class PlacementError(ValueError):
    """A placement string or flag combination that is not valid; the message names the bad part."""


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


_MODULE_OF_ALIAS = {
    _key(alias): module for module, aliases in MODULE_ALIASES.items() for alias in (module, *aliases)
}
_MODULE_OF_ALIAS[_key(AUDIO_ENCODER)] = AUDIO_ENCODER


def _accepted_modules(modules: Sequence[str]) -> str:
    return ", ".join(f"{m} ({', '.join(MODULE_ALIASES[m])})" if MODULE_ALIASES.get(m) else m for m in modules)


def _where(flag: str, text: str | None) -> str:
    return f"{flag} {text!r}" if text is not None else flag


def canonical_module(
    name: str, modules: Sequence[str] = MODULES, flag: str = "module name", text: str | None = None
) -> str:
    """The canonical module for `name` or an alias (`UNet` -> diffusion, `clip-vision` -> clip_vision)."""
    module = _MODULE_OF_ALIAS.get(_key(name))
    if module is None or (module == AUDIO_ENCODER and module not in modules):
        raise PlacementError(
            f"unknown module {name.strip()!r} in {_where(flag, text)}; accepted: {_accepted_modules(modules)}"
        )
    if module not in modules:
        raise PlacementError(
            f"module {module!r} is not accepted by {_where(flag, text)}; "
            f"accepted: {_accepted_modules(modules)}"
        )
    return module


def _entries(text: str | None, flag: str, modules: Sequence[str]) -> list[tuple[str, str, str]]:
    """(key, lower-case value, entry text) for each comma-separated entry; key is a module or DEFAULT."""
    if text is None or not text.strip():
        return []
    entries = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise PlacementError(
                f"empty entry in {flag} {text!r}; expected a value or module=value entries "
                f"separated by commas"
            )
        key_text, equals, value = item.partition("=")
        if not equals:
            key, value = DEFAULT, item
        elif key_text.strip().lower() in DEFAULT_KEYS:
            key = DEFAULT
        else:
            key = canonical_module(key_text, modules, flag, text)
        entries.append((key, value.strip().lower(), item))
    return entries


def parse_assignment(
    text: str | None, allow_disk: bool = False, allow_lists: bool = True, flag: str | None = None
) -> dict[str, tuple[str, ...]]:
    """Parse a device assignment (`--backend` or, with allow_disk, `--params-backend`) to module -> devices.

    The default entry has key DEFAULT. Device names are returned lower-case and unresolved; an empty value
    means the default device (`auto`).
    """
    flag = flag or ("--params-backend" if allow_disk else "--backend")
    parsed: dict[str, tuple[str, ...]] = {}
    for key, value, item in _entries(text, flag, MODULES):
        names = tuple(name.strip() for name in value.split("&")) if value else ("auto",)
        if len(names) > 1:
            if not allow_lists:
                raise PlacementError(f"{flag} accepts no device lists ('&'): {item!r} in {flag} {text!r}")
            if key not in LAYER_SPLIT_MODULES:
                raise PlacementError(
                    f"a device list ('&', layer split) is accepted only for diffusion and te; "
                    f"got {item!r} in {flag} {text!r}"
                )
            if len(set(names)) != len(names):
                raise PlacementError(f"device listed twice in {item!r} in {flag} {text!r}")
        for name in names:
            if name == "disk" and not allow_disk:
                raise PlacementError(
                    f"disk is a parameter residency mode, not a compute backend: {item!r} in "
                    f"{flag} {text!r}; use --params-backend disk"
                )
            if not _DEVICE_TOKEN.fullmatch(name):
                raise PlacementError(
                    f"bad device name {name!r} in {flag} {text!r}; expected a device name "
                    f"such as cpu, cuda0, mps, or auto, default, gpu" + (", disk" if allow_disk else "")
                )
        parsed[key] = names
    return parsed


def parse_modes(text: str | None, flag: str, values: Sequence[str], modules: Sequence[str]) -> dict[str, str]:
    """Parse a per-module mode string (`--flash-attn auto,te=off`, `--split-mode diffusion=row`)."""
    parsed: dict[str, str] = {}
    for key, value, item in _entries(text, flag, modules):
        if value not in values:
            raise PlacementError(
                f"bad value {value!r} in {item!r} in {flag} {text!r}; accepted: {', '.join(values)}"
            )
        parsed[key] = value
    return parsed


def _vram_value(value: str, item: str, text: str) -> float:
    try:
        gib = float(value)
        if not math.isfinite(gib):
            raise ValueError(value)
        return gib
    except ValueError:
        raise PlacementError(
            f"bad --max-vram value {value!r} in {item!r} in --max-vram {text!r}; expected GiB "
            f"(positive: managed budget, 0: current free memory, negative: free memory "
            f"at start minus that many GiB)"
        ) from None


def parse_max_vram(text: str | None) -> dict[str, float]:
    """Parse `--max-vram` to device name -> GiB; a bare number has key DEFAULT (every GPU device)."""
    parsed: dict[str, float] = {}
    if text is None or not text.strip():
        return parsed
    for item in text.split(","):
        item = item.strip()
        name, equals, value = item.partition("=")
        if not item or (
            equals and not _DEVICE_TOKEN.fullmatch(name.strip().lower()) and name.strip() not in DEFAULT_KEYS
        ):
            raise PlacementError(
                f"bad entry {item!r} in --max-vram {text!r}; expected GiB or device=GiB "
                f"entries separated by commas, e.g. 6 or cuda0=6,cuda1=14"
            )
        key = DEFAULT if not equals or name.strip().lower() in DEFAULT_KEYS else name.strip().lower()
        parsed[key] = _vram_value(value if equals else name, item, text)
    return parsed


def max_vram_for(
    device: ComputeDevice, max_vram: str, devices: Sequence[ComputeDevice] | None = None
) -> float | None:
    """The `--max-vram` GiB that applies to `device`, or None when no budget is set for it."""
    devices = list_devices() if devices is None else devices
    parsed = parse_max_vram(max_vram)
    for key, gib in parsed.items():
        if key != DEFAULT:
            try:
                named = resolve_device(key, devices)
            except DeviceError as error:
                raise PlacementError(f"--max-vram {max_vram!r}: {error}") from None
            if named.name == device.name:
                return gib
    return parsed.get(DEFAULT) if device.kind != "cpu" else None


def _on_off(value: Any, flag: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("on", "off"):
        return value.strip().lower() == "on"
    raise PlacementError(f"{flag} requires on or off, got {value!r}")


def _mode(value: str, flag: str) -> str:
    if value.strip().lower() not in MODES:
        raise PlacementError(f"{flag} requires on, off or auto, got {value!r}")
    return value.strip().lower()


@dataclass(frozen=True)
class ModulePlacement:
    module: str  # canonical module name: diffusion, te, vae, ...
    compute: tuple[str, ...]  # resolved compute device names; more than one = layer/row split, first is main
    params: str  # "device" (same as compute), "cpu" (RAM), "disk" (re-read from the file) or another device
    split_mode: str  # "layer" or "row" (matters only with several compute devices)
    flash_attn: str  # "on", "off" or "auto"; "off" for modules without configurable attention
    conv_direct: str  # "on", "off" or "auto"; "off" for modules without direct-convolution choice


# Compatibility flags: flag attribute -> (flag, module, which assignment it prepends to, deprecated)
_COMPAT_FLAGS = {
    "clip_on_cpu": ("--clip-on-cpu", "te", "backend", True),
    "vae_on_cpu": ("--vae-on-cpu", "vae", "backend", True),
    "control_net_cpu": ("--control-net-cpu", "controlnet", "backend", True),
    "offload_to_cpu": ("--offload-to-cpu", "*", "params_backend", False),
    "dit_offload": ("--dit-offload", "diffusion", "params_backend", False),
    "text_encoder_offload": ("--text-encoder-offload", "te", "params_backend", False),
    "vae_offload": ("--vae-offload", "vae", "params_backend", False),
}
_SETTING_FLAGS = (
    "backend",
    "params_backend",
    "split_mode",
    "max_vram",
    "flash_attn",
    "conv_direct",
    "vae_tiling",
    "cuda_graphs",
    "weight_type",
    "tensor_type_rules",
)
_BOOL_SETTINGS = ("auto_fit", "prefetch", "segmented", "auto_fit_types")


@dataclass(frozen=True)
class MemorySettings:
    backend: str = "auto"  # --backend assignment string
    params_backend: str | None = (
        None  # --params-backend assignment string; None = auto-fit or same as compute
    )
    split_mode: str = "layer"  # --split-mode
    max_vram: str = ""  # --max-vram; "" = no managed budget (live free memory only)
    flash_attn: str = "auto"  # --flash-attn
    conv_direct: str = "auto"  # --conv-direct
    auto_fit: bool = True  # --auto-fit; always False when params_backend is set
    prefetch: bool = True  # not --disable-prefetch
    segmented: bool = True  # not --disable-segmented-compute
    vae_tiling: str = "auto"  # --vae-tiling on|off|auto
    cuda_graphs: str = "auto"  # --cuda-graphs on|off|auto (auto = on: replay each module's steady call)
    weight_type: str = ""  # --type: GGML type of every eligible weight, e.g. q8_0 ("" = the files' own)
    tensor_type_rules: str = ""  # --tensor-type-rules: "regex=type,..." over tensor names
    auto_fit_types: bool = False  # --auto-fit given explicitly: auto-fit also picks weight types (ladder)
    warnings: tuple[str, ...] = ()  # deprecation warnings of the flags this was built from

    def __post_init__(self) -> None:
        if self.params_backend is not None and not self.params_backend.strip():
            object.__setattr__(self, "params_backend", None)
        if self.params_backend is not None:
            object.__setattr__(self, "auto_fit", False)
        parse_assignment(self.backend)
        parse_assignment(self.params_backend, allow_disk=True, allow_lists=False)
        parse_modes(self.split_mode, "--split-mode", SPLIT_MODES, LAYER_SPLIT_MODULES)
        parse_max_vram(self.max_vram)
        parse_modes(self.flash_attn, "--flash-attn", MODES, FLASH_ATTN_MODULES)
        parse_modes(self.conv_direct, "--conv-direct", MODES, CONV_DIRECT_MODULES)
        object.__setattr__(self, "vae_tiling", _mode(self.vae_tiling, "--vae-tiling"))
        object.__setattr__(self, "cuda_graphs", _mode(self.cuda_graphs, "--cuda-graphs"))
        if self.weight_type or self.tensor_type_rules:
            _check_weight_types(self.weight_type, self.tensor_type_rules)

    @property
    def chooses_weight_types(self) -> bool:
        """Whether auto-fit picks the weight types: --auto-fit given explicitly, and no --type or rules."""
        return self.auto_fit and self.auto_fit_types and not (self.weight_type or self.tensor_type_rules)

    @classmethod
    def from_args(cls, **flag_values: Any) -> MemorySettings:
        """Settings from CLI flag values by argparse name (backend, offload_to_cpu, disable_prefetch, ...)."""
        accepted = (
            *_SETTING_FLAGS,
            "auto_fit",
            "auto_fit_types",
            *_COMPAT_FLAGS,
            "disable_prefetch",
            "disable_segmented_compute",
        )
        unknown = sorted(set(flag_values) - set(accepted))
        if unknown:
            raise PlacementError(
                f"unknown memory flag(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}"
            )
        strings = {name: flag_values.get(name) for name in _SETTING_FLAGS}
        prepended: dict[str, list[str]] = {"backend": [], "params_backend": []}
        warnings = []
        for attribute, (flag, module, target, deprecated) in _COMPAT_FLAGS.items():
            if flag_values.get(attribute):
                prepended[target].append(f"{module}=cpu")
                if deprecated:
                    warnings.append(f"{flag} is deprecated; use --backend {module}=cpu")
        for target, prefix in prepended.items():
            if prefix:
                strings[target] = ",".join(prefix + ([strings[target]] if strings[target] else []))
        for message in warnings:
            log.warning(message)
        auto_fit = flag_values.get("auto_fit")
        return cls(
            backend=strings["backend"] or "auto",
            params_backend=strings["params_backend"],
            split_mode=strings["split_mode"] or "layer",
            max_vram=strings["max_vram"] or "",
            flash_attn=strings["flash_attn"] or "auto",
            conv_direct=strings["conv_direct"] or "auto",
            auto_fit=True if auto_fit is None else _on_off(auto_fit, "--auto-fit"),
            prefetch=not flag_values.get("disable_prefetch", False),
            segmented=not flag_values.get("disable_segmented_compute", False),
            vae_tiling=strings["vae_tiling"] or "auto",
            cuda_graphs=strings["cuda_graphs"] or "auto",
            weight_type=strings["weight_type"] or "",
            tensor_type_rules=strings["tensor_type_rules"] or "",
            auto_fit_types=bool(flag_values.get("auto_fit_types", False)),
            warnings=tuple(warnings),
        )

    def to_dict(self) -> dict[str, str]:
        """The workflow file's settings["memory"]: every value a string (warnings are not kept)."""
        data = {}
        for name, value in asdict(self).items():
            if name == "warnings" or value is None:
                continue
            data[name] = ("on" if value else "off") if isinstance(value, bool) else value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemorySettings:
        """Settings from a workflow file's settings["memory"] (the inverse of to_dict)."""
        accepted = [f.name for f in fields(cls) if f.name != "warnings"]
        unknown = sorted(set(data) - set(accepted))
        if unknown:
            raise PlacementError(
                f"unknown memory setting(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}"
            )
        values = dict(data)
        for name in _BOOL_SETTINGS:
            if name in values:
                values[name] = _on_off(values[name], f"memory setting {name}")
        for name, value in values.items():
            if (
                name not in _BOOL_SETTINGS
                and value is not None
                and not isinstance(value, str)
            ):
                raise PlacementError(f"memory setting {name} must be a string, got {value!r}")
        return cls(**values)


def _check_weight_types(weight_type: str, rules: str) -> None:
    """A --type or --tensor-type-rules value that engine.quant cannot write is a PlacementError."""
    from engine.quant.quantize import tensor_type_rules

    try:
        tensor_type_rules(weight_type or None, rules)
    except ValueError as error:
        raise PlacementError(str(error)) from None


def _resolve_names(
    names: Sequence[str], flag: str, text: str, devices: Sequence[ComputeDevice]
) -> tuple[ComputeDevice, ...]:
    try:
        resolved = tuple(resolve_device(name, devices) for name in names)
    except DeviceError as error:
        raise PlacementError(f"{flag} {text!r}: {error}") from None
    if len({d.name for d in resolved}) != len(resolved):
        raise PlacementError(f"{flag} {text!r}: the devices {'&'.join(names)} name the same device twice")
    return resolved


def placement_for(
    module: str, settings: MemorySettings, devices: Sequence[ComputeDevice] | None = None
) -> ModulePlacement:
    """The placement of `module` (any alias) under `settings`, with device names resolved on `devices`."""
    module = canonical_module(module)
    devices = list_devices() if devices is None else list(devices)
    backend = parse_assignment(settings.backend)
    names = backend.get(module, backend.get(DEFAULT, ("auto",)))
    compute = _resolve_names(names, "--backend", settings.backend, devices)
    params = "device"
    if settings.params_backend is not None:
        assignment = parse_assignment(settings.params_backend, allow_disk=True, allow_lists=False)
        value = assignment.get(module, assignment.get(DEFAULT))
        if value == ("disk",):
            params = "disk"
        elif value is not None:
            (home,) = _resolve_names(value, "--params-backend", settings.params_backend, devices)
            unified = len(compute) == 1 and compute[0].kind in ("cpu", "igpu") and home.kind == "cpu"
            if not unified and (len(compute) > 1 or home.name != compute[0].name):
                params = "cpu" if home.kind == "cpu" else home.name
    split = parse_modes(settings.split_mode, "--split-mode", SPLIT_MODES, LAYER_SPLIT_MODULES)
    flash = parse_modes(settings.flash_attn, "--flash-attn", MODES, FLASH_ATTN_MODULES)
    conv = parse_modes(settings.conv_direct, "--conv-direct", MODES, CONV_DIRECT_MODULES)
    return ModulePlacement(
        module=module,
        compute=tuple(d.name for d in compute),
        params=params,
        split_mode=split.get(module, split.get(DEFAULT, "layer"))
        if module in LAYER_SPLIT_MODULES
        else "layer",
        flash_attn=flash.get(module, flash.get(DEFAULT, "auto")) if module in FLASH_ATTN_MODULES else "off",
        conv_direct=conv.get(module, conv.get(DEFAULT, "auto")) if module in CONV_DIRECT_MODULES else "off",
    )


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the memory flags of reference/000 and /004 to `parser` (unset flags stay None or False)."""
    group = parser.add_argument_group("memory and placement (see reference/000)")
    group.add_argument(
        "--backend", help="compute device(s): cuda0, or te=cpu,vae=cuda0,diffusion=cuda0&cuda1"
    )
    group.add_argument("--params-backend", help="where parameters live: cpu, disk, a device, or module=...")
    group.add_argument("--split-mode", help="layer or row, or per module: diffusion=row,te=layer")
    group.add_argument(
        "--max-vram",
        help="GiB per GPU (positive budget, 0 free now, negative free minus GiB), or cuda0=6,cuda1=14",
    )
    group.add_argument("--flash-attn", help="on, off or auto, with module entries: auto,te=off,vae=on")
    group.add_argument("--conv-direct", help="on, off or auto, with module entries: auto,vae=off")
    group.add_argument("--auto-fit", choices=("on", "off"), nargs="?", const="on",
                       help="automatic placement (default on); given explicitly (bare or on) without --type, "
                            "it also picks the weight types: text encoders q8_0, the diffusion model the "
                            "highest of q8_0, q5, q4 that fits resident (reference/004)")
    group.add_argument("--type", dest="weight_type", metavar="TYPE",
                       help="quantise every eligible weight to TYPE as it loads: q8_0, q6_K, q5_K, q5_1, "
                            "q5_0, q4_K, q4_1, q4_0, iq4_nl, iq4_xs, q3_K, q2_K, f16, bf16, f32 "
                            "(stable-diffusion.cpp's --type)")
    group.add_argument("--tensor-type-rules", metavar="RULES",
                       help='per-tensor types over --type: "regex=type,..." on tensor names, e.g. '
                            '"^model.diffusion_model.double_blocks=q8_0"')
    group.add_argument("--vae-tiling", choices=MODES, help="decode the VAE in tiles (default auto)")
    group.add_argument(
        "--cuda-graphs", choices=MODES, help="replay a module's repeated calls as CUDA graphs (default on)"
    )
    for flag, module, target, deprecated in _COMPAT_FLAGS.values():
        assignment = "--backend" if target == "backend" else "--params-backend"
        note = "deprecated: " if deprecated else ""
        group.add_argument(flag, action="store_true", help=f"{note}same as {assignment} {module}=cpu first")
    group.add_argument(
        "--disable-prefetch", action="store_true", help="no asynchronous next-segment prefetch"
    )
    group.add_argument("--disable-segmented-compute", action="store_true", help="never split a module's run")


def settings_from_namespace(ns: argparse.Namespace, base: MemorySettings | None = None) -> MemorySettings:
    """Settings from parsed CLI flags over `base` (the workflow file's): a given flag replaces its string."""
    base = base or MemorySettings()
    values: dict[str, Any] = {name: getattr(base, name) for name in _SETTING_FLAGS}
    for name in _SETTING_FLAGS:
        if getattr(ns, name, None) is not None:
            values[name] = getattr(ns, name)
    auto_fit = getattr(ns, "auto_fit", None)
    values["auto_fit"] = base.auto_fit if auto_fit is None else auto_fit
    values["auto_fit_types"] = base.auto_fit_types if auto_fit is None else _on_off(auto_fit, "--auto-fit")
    values["disable_prefetch"] = bool(getattr(ns, "disable_prefetch", False)) or not base.prefetch
    values["disable_segmented_compute"] = (
        bool(getattr(ns, "disable_segmented_compute", False)) or not base.segmented
    )
    for attribute in _COMPAT_FLAGS:
        values[attribute] = bool(getattr(ns, attribute, False))
    settings = MemorySettings.from_args(**values)
    if base.warnings:
        settings = MemorySettings(**{**asdict(settings), "warnings": base.warnings + settings.warnings})
    return settings


NODE_PARAMS = ("auto", "device", "cpu", "disk")  # a loader node's params_backend choices (auto: inherit)
NODE_INHERIT = ("", "auto")  # a loader node's backend values that keep the workflow's (and CLI's) choice
CLI_PARAMS_FLAGS = ("params_backend", "offload_to_cpu", "dit_offload", "text_encoder_offload", "vae_offload")


@dataclass(frozen=True)
class NodePlacement:
    """One module of a loader node, placed by CLI flags > the node's own values > the workflow > defaults."""

    module: str  # canonical module: diffusion, te, vae, ...
    compute: tuple[str, ...]  # resolved compute device names, the main one first (several: a split)
    params: str | None  # device, cpu, disk or another device's name; None = auto-fit decides
    split_mode: str  # layer or row; matters only with several compute devices
    settings: MemorySettings  # the merged settings the placement came from (the node's backend included)
    placement: ModulePlacement  # what placement_for resolved from `settings`


def device_choices(devices: Sequence[ComputeDevice] | None = None) -> tuple[str, ...]:
    """What a loader node's backend may be set to: auto, then every device that exists (cuda0, ..., cpu)."""
    devices = list_devices() if devices is None else devices
    return ("auto", *(device.name for device in devices))


def resolve_node_placement(
    module: str,
    workflow_memory: Mapping[str, Any] | MemorySettings | None = None,
    node_backend: str = "auto",
    node_params: str = "auto",
    overrides: Mapping[str, Any] | None = None,
    devices: Sequence[ComputeDevice] | None = None,
) -> NodePlacement:
    """The placement of `module` as the executor runs it: CLI flags (`overrides`, by argparse name), then a
    loader node's `backend` / `params_backend` (when not auto), then the workflow's settings["memory"], then
    the defaults. The one resolution that the runtime, the node badge, the Inspector and the Devices view
    share. Raises PlacementError, or DeviceError for a node backend that names no device.

    Weights kept in RAM (`cpu`) for a CPU or unified-memory compute device are on the device (`device`).
    With no explicit params anywhere, `params` is None when auto-fit decides, else `device`.
    """
    module = canonical_module(module)
    devices = list_devices() if devices is None else list(devices)
    overrides = dict(overrides or {})
    params_choice = node_params.strip().lower()
    if params_choice not in NODE_PARAMS:
        raise PlacementError(f"unknown params_backend {node_params!r}; accepted: {', '.join(NODE_PARAMS)}")
    workflow = workflow_memory if isinstance(workflow_memory, MemorySettings) else (
        MemorySettings.from_dict(workflow_memory or {}))
    backend = workflow.backend
    if node_backend.strip().lower() not in NODE_INHERIT:
        resolve_device(node_backend, devices)  # a DeviceError naming the devices that exist
        backend = f"{backend},{module}={node_backend.strip()}"
    flags = argparse.Namespace(**overrides)
    settings = settings_from_namespace(flags, replace(workflow, backend=backend))
    placement = placement_for(module, settings, devices)
    main = resolve_device(placement.compute[0], devices)
    if any(overrides.get(flag) for flag in CLI_PARAMS_FLAGS) or (
        params_choice == "auto" and settings.params_backend is not None
    ):
        params: str | None = placement.params
    elif params_choice != "auto":
        unified = params_choice == "cpu" and main.kind in ("cpu", "igpu")
        params = "device" if unified else params_choice
    else:
        params = None if settings.auto_fit else "device"
    return NodePlacement(module, placement.compute, params, placement.split_mode, settings, placement)

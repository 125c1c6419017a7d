"""Load SD-family files into our models: detect the configs, build on `meta`, bind tensors read lazily.

Each component's tensors are read from the file with its prefix stripped, converted to the compute dtype
and bound without a second copy (engine/models/weights.py). A per-process cache keyed by (file, mtime,
size, component, dtype, device) returns the same bundle while anything still holds it, so loading a file
twice in a session is free without keeping unused models alive.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.devices import ComputeDevice, resolve_device
from engine.memory.file_reads import FileSpan
from engine.memory.runtime import MemoryRuntime, ModuleMemory
from engine.memory.weight_store import HOMES
from engine.models.bundles import (
    TEXT_FAMILIES,
    DiffusionModel,
    ManagedEncoder,
    MissingComponentError,
    TextEncoder,
    VAEModel,
    build_conditioner,
)
from engine.models.clip import UNUSED_CHECKPOINT_KEYS, CLIPTextModel, component_prefix, missing_key_segment
from engine.models.detect import (
    TEXT_ROOTS,
    UNET_ROOTS,
    VAE_ROOTS,
    ModelInfo,
    TextEncoderConfig,
    UnsupportedModelError,
    detect,
)
from engine.models.formats import CheckpointError, CheckpointReader, open_checkpoint
from engine.models.meta_init import skipping_meta_init
from engine.models.unet import UNetModel
from engine.models.vae import AutoencoderKL
from engine.models.weights import bind_weights
from engine.placement import LAYER_SPLIT_MODULES
from engine.quant.loading import WeightTypes, quantise_model, reopen
from engine.sampling.model_sampling import EpsPrediction, VPrediction

COMPONENTS = ("diffusion", "te", "vae")
COMPONENT_NAMES = {"diffusion": "diffusion model (UNet or FLUX transformer)", "te": "text encoder (CLIP, T5)",
                   "vae": "VAE"}
ADD_LOADER_HINT = {"diffusion": "add a UNETLoader", "te": "add a CLIPLoader", "vae": "add a VAELoader"}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3fn_fast": torch.float8_e4m3fn,  # fp8: storage only
          "fp8_e5m2": torch.float8_e5m2}
SDXL_LATENT_SCALE, SD_LATENT_SCALE = 0.13025, 0.18215

log = logging.getLogger("sluice.loader")
PerComponent = str | Mapping[str, str]  # one value for every component, or component -> value

_cache: weakref.WeakValueDictionary[tuple, Any] = weakref.WeakValueDictionary()
_cache_lock = threading.Lock()


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """None / "default" -> None (the device's default); a DTYPES name or a torch dtype. The fp8 names
    (ComfyUI's weight_dtype choices) give float8 types, which store weights but do not compute."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "default":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown weight dtype {name!r}; accepted: default, {', '.join(DTYPES)}")
    return DTYPES[name]


def default_dtype(component: str, device: torch.device, stored: torch.dtype | None) -> torch.dtype:
    """float32 on the CPU; on a GPU the file's half type (fp16 unless it holds bf16), and float32 (or bf16
    where supported) for the VAE, whose fp16 decode overflows on SDXL."""
    if device.type == "cpu":
        return torch.float32
    if component == "vae":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return torch.bfloat16 if stored == torch.bfloat16 else torch.float16


def _file_key(path: Path) -> tuple:
    if not path.is_file():
        raise CheckpointError(f"model file not found: {path}")
    stat = path.stat()
    return (str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def _cached(key: tuple, build: Any) -> Any:
    with _cache_lock:
        found = _cache.get(key)
    if found is not None:
        return found
    value = build()
    with _cache_lock:
        _cache[key] = value
    return value


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


def _component_tensors(reader: CheckpointReader, prefix: str, roots: set[str], dtype: torch.dtype,
                       device: torch.device, skip: Iterable[str] = (), segment: str = ""
                       ) -> dict[str, torch.Tensor]:
    """The component's tensors named without `prefix` (only names under `roots`), read and converted;
    `segment` is put before each name (a part of the parameter names that the file's keys lack)."""
    skipped = set(skip)
    tensors = {}
    for key in reader.keys():
        if not key.startswith(prefix):
            continue
        name = segment + key[len(prefix):]
        if name.split(".", 1)[0] not in roots or name in skipped:
            continue
        tensor = reader.get(key)
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.to(device)
    return tensors


def _stored_dtype(reader: CheckpointReader, prefix: str) -> torch.dtype | None:
    key = next((k for k in reader.keys() if k.startswith(prefix) and k.endswith(".weight")), None)
    return reader.info(key).dtype if key is not None else None


def _bind(module: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str, path: Path) -> None:
    try:
        bind_weights(module, tensors)
    except ValueError as error:
        raise ValueError(f"{path}: the {what} does not match its detected configuration: {error}") from None


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where one component goes: its compute device, its weights' home and the runtime (None: plain)."""

    device: ComputeDevice
    home: str = "device"  # device, cpu or disk (reference/000 parameter residency)
    runtime: MemoryRuntime | None = None
    devices: tuple[str, ...] = ()  # every compute device (main first) of a split module; () = one device
    split_mode: str = "layer"  # layer or row, with several devices

    def cache_key(self) -> tuple:
        return (self.device.name, self.home, None if self.runtime is None else id(self.runtime), self.devices,
                self.split_mode)


def _place(model: torch.nn.Module, reader: CheckpointReader, prefix: str, roots: set[str], dtype: torch.dtype,
           target: _Target, kind: str, what: str, skip: Iterable[str] = (), segment: str = "") -> str | None:
    """Bind the component's weights: read and bound now (plain), or registered in the runtime under its home
    (disk: nothing is read now; the store re-reads from its own memory-mapped reader). Returns the name.
    A parameter `segment + name` is read from the file's key `prefix + name`."""
    if target.runtime is None:
        tensors = _component_tensors(reader, prefix, roots, dtype, target.device.torch_device, skip, segment)
        _bind(model, tensors, what, reader.path)
        return None
    source_reader = reopen(reader) if target.home == "disk" else reader
    source = _ReaderSource(source_reader, prefix, segment)
    return target.runtime.register(kind, model, target.home, target.device.name, source,
                                   target.devices or None, target.split_mode)


class _ReaderSource:
    """A weight store's source for one component: parameter `segment + name` is the file's key
    `prefix + name`; it also tells where a tensor's bytes lie in the file, so that the store reads them
    straight into their homes."""

    def __init__(self, reader: CheckpointReader, prefix: str, segment: str) -> None:
        self.reader, self.prefix, self.segment = reader, prefix, segment

    def __call__(self, name: str) -> torch.Tensor:
        return self.reader.get(self.prefix + name.removeprefix(self.segment))

    def file_span(self, name: str) -> FileSpan | None:
        return self.reader.file_span(self.prefix + name.removeprefix(self.segment))


def place_network(model: torch.nn.Module, target: _Target, kind: str, get: Callable[[str], torch.Tensor],
                  disk_get: Callable[[], Callable[[str], torch.Tensor]], path: Path, what: str) -> str | None:
    """A network whose parameters `get(name)` reads (raising KeyError for a missing one): read and bound now
    (plain), or registered in the runtime under its home, re-reading through `disk_get()` when that home is
    disk. Returns the runtime's name (None when plain)."""
    if target.runtime is None:
        device = target.device.torch_device
        try:
            bind_weights(model, {name: get(name).to(device, parameter.dtype)
                                 for name, parameter in model.named_parameters()})
        except KeyError as error:
            raise ValueError(f"{path}: the {what} lacks tensor {error}; the file is incomplete") from None
        return None
    source = disk_get() if target.home == "disk" else get
    return target.runtime.register(kind, model, target.home, target.device.name, source)


def module_memory(target: _Target, kind: str, names: Sequence[str | None], models: Sequence[torch.nn.Module],
            ) -> ModuleMemory | None:
    if target.runtime is None:
        return None
    return ModuleMemory(target.runtime, tuple(n for n in names if n is not None), kind, target.device.name,
                        target.home, tuple(models))


def adopt_lifetime(bundle: Any, memory: ModuleMemory | None) -> Any:
    """Unregister the weights when nothing uses them any more: the anchor is what every clone of the bundle
    shares (its model; for a text encoder its conditioner) and what the weight store does not hold."""
    if memory is not None:
        anchor = bundle.conditioner if isinstance(bundle, TextEncoder) else memory.models[0]
        memory.runtime.bind_lifetime(anchor, memory.names)
    return bundle


def _latent_scale(info: ModelInfo) -> float:
    if info.vae is not None:
        return info.vae.scale_factor
    return SDXL_LATENT_SCALE if info.layout in ("sdxl", "sdxl_refiner") else SD_LATENT_SCALE


def _build_diffusion(reader: CheckpointReader, info: ModelInfo, dtype: torch.dtype | None,
                     target: _Target, types: WeightTypes | None = None) -> DiffusionModel:
    prefix, config, device = info.components["diffusion"], info.unet, target.device
    dtype = dtype or default_dtype("diffusion", device.torch_device, _stored_dtype(reader, prefix))
    if dtype.itemsize == 1:
        raise CheckpointError(f"weight dtype {dtype} is not supported for the {info.layout} UNet, which "
                              f"computes in its weights' dtype; accepted: default, fp32, fp16, bf16")
    unet = UNetModel(config, dtype=dtype, device="meta")
    reader = quantise_model(unet, reader, lambda name: prefix + name, types, device.torch_device)
    name = _place(unet, reader, prefix, UNET_ROOTS, dtype, target, "diffusion", "diffusion model")
    sampling = VPrediction() if config.prediction == "v" else EpsPrediction()
    memory = module_memory(target, "diffusion", [name], [unet])
    return adopt_lifetime(DiffusionModel(unet=unet, model_sampling=sampling, family=info.layout,
                                 latent_channels=config.out_channels, latent_scale=_latent_scale(info),
                                 latent_shift=0.0, compute_device=device.name, params_location=target.home,
                                 source=reader.path, memory=memory), memory)


def _build_vae(reader: CheckpointReader, info: ModelInfo, dtype: torch.dtype | None,
               target: _Target) -> VAEModel:
    prefix, device = info.components["vae"], target.device
    dtype = dtype or default_dtype("vae", device.torch_device, _stored_dtype(reader, prefix))
    # The VAE works in raw latents (ComfyUI's LATENT); the diffusion model applies the scale factor.
    config = dataclasses.replace(info.vae, scale_factor=1.0, shift_factor=0.0)
    autoencoder = AutoencoderKL(config, device="meta", dtype=dtype)
    reader = quantise_model(autoencoder, reader, lambda name: prefix + name, None, device.torch_device)
    name = _place(autoencoder, reader, prefix, VAE_ROOTS, dtype, target, "vae", "VAE")
    memory = module_memory(target, "vae", [name], [autoencoder])
    return adopt_lifetime(VAEModel(autoencoder=autoencoder, compute_device=device.name,
                                   params_location=target.home,
                           source=reader.path, memory=memory), memory)


def _build_clip(reader: CheckpointReader, config: TextEncoderConfig, dtype: torch.dtype | None,
                target: _Target, types: WeightTypes | None = None) -> tuple[CLIPTextModel, str | None]:
    prefix, segment = component_prefix(config), missing_key_segment(config)
    dtype = dtype or default_dtype("te", target.device.torch_device, _stored_dtype(reader, prefix))
    model = CLIPTextModel(config, dtype=dtype, device="meta")
    reader = quantise_model(model, reader, lambda name: prefix + name.removeprefix(segment), types,
                            target.device.torch_device)
    name = _place(model, reader, prefix, TEXT_ROOTS, dtype, target, "te", f"{config.kind} text encoder",
                  UNUSED_CHECKPOINT_KEYS, segment)
    return model, name


def _detect(reader: CheckpointReader) -> ModelInfo:
    try:
        return detect(reader)
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"not a model file Sluice reads (SD1.x, SD2.x, SDXL, FLUX.1, T5-XXL): "
                                    f"{error}") from None


def _build_flux_component(reader: CheckpointReader, info: ModelInfo, component: str,
                          dtype: torch.dtype | None, target: _Target, types: WeightTypes | None = None,
                          ) -> Any:
    """The FLUX transformer, or the CLIP-L + T5 text encoder, of a FLUX file."""
    from engine.models.flux_loader import build_flux_diffusion, flux_text_encoder

    if component == "diffusion":
        return build_flux_diffusion(reader, info, dtype, target, types)
    if not info.text_encoders or info.t5 is None:
        return None  # reported as a missing component by the caller
    return flux_text_encoder((reader, info.text_encoders[0]), (reader, info.t5, info.t5_prefix), dtype,
                             target, types)


def _targets(components: Sequence[str], device: PerComponent, params: PerComponent,
             runtime: MemoryRuntime | None) -> dict[str, _Target]:
    """Each component's compute device(s) (`cuda0&cuda1`: split, with the runtime's split mode) and weight
    home; a params home on another GPU is kept in RAM."""
    targets = {}
    for component in components:
        device_name = device if isinstance(device, str) else device.get(component, "auto")
        home = params if isinstance(params, str) else params.get(component, "device")
        names = [name.strip() for name in device_name.split("&")]
        compute = resolve_device(names[0])
        split = tuple(resolve_device(name).name for name in names) if len(names) > 1 else ()
        if split and (runtime is None or component not in LAYER_SPLIT_MODULES):
            raise ValueError(f"{component}: computing on several devices ({device_name!r}) needs the memory "
                             f"runtime and is for {', '.join(LAYER_SPLIT_MODULES)} only")
        split_mode = runtime.split_mode(component) if split else "layer"
        if home not in HOMES:
            other = resolve_device(home)
            if other.name == compute.name:
                home = "device"
            else:
                log.warning("%s: parameters on another device (%s) are kept in RAM instead; the weight store "
                            "stages from RAM or disk only", component, other.name)
                home = "cpu"
        if runtime is None and home != "device":
            raise ValueError(f"{component}: parameters at {home!r} need the memory runtime; pass runtime=")
        targets[component] = _Target(compute, home, runtime, split, split_mode)
    return targets


def load_checkpoint(path: str | os.PathLike[str], dtype: torch.dtype | str | None = None,
                    device: PerComponent = "cpu", components: Sequence[str] = COMPONENTS,
                    params: PerComponent = "device", runtime: MemoryRuntime | None = None,
                    types: Mapping[str, WeightTypes] | None = None,
                    ) -> tuple[DiffusionModel | None, TextEncoder | None, VAEModel | None]:
    """(diffusion model, text encoder, VAE) of a single-file checkpoint; None for a component not asked for
    or not in the file. `dtype` None (or "default") picks each component's default for the device.

    `device` and `params` give every component (or each, by component name) its compute device and weight
    home (device, cpu, disk). With a `runtime`, the weights belong to its weight stores and the bundles run
    through it; without one, they are bound to the model directly (params must then be "device").
    Weights a GGUF file stores quantised rest quantised; `types` (component -> WeightTypes: `--type`,
    `--tensor-type-rules`) quantises the diffusion model's and the text encoder's float weights as they load.
    """
    types = types or {}
    unknown = [c for c in components if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"unknown components {unknown}; accepted: {', '.join(COMPONENTS)}")
    path, dtype = Path(path), parse_dtype(dtype)
    targets = _targets(components, device, params, runtime)
    file_key = _file_key(path)
    keys = {c: (*file_key, c, dtype, types.get(c), *targets[c].cache_key()) for c in components}
    with _cache_lock:
        found = {c: _cache.get(key) for c, key in keys.items()}
    missing = [c for c in components if found[c] is None]
    if missing:
        with open_checkpoint(path) as reader, skipping_meta_init():
            info = _detect(reader)
            for component in missing:
                if component not in info.components:
                    continue
                chosen = types.get(component)
                if info.flux is not None and component != "vae":
                    value: Any = _build_flux_component(reader, info, component, dtype, targets[component],
                                                       chosen)
                elif component == "diffusion":
                    value = _build_diffusion(reader, info, dtype, targets[component], chosen)
                elif component == "vae":
                    value = _build_vae(reader, info, dtype, targets[component])
                else:
                    sources = [(reader, config) for config in info.text_encoders]
                    value = _text_encoder(info.layout, sources, dtype, targets[component], chosen)
                found[component] = value
                with _cache_lock:
                    _cache[keys[component]] = value
    return found.get("diffusion"), found.get("te"), found.get("vae")


FILE_KINDS = {"t5xxl": "a T5-XXL text encoder (load it with DualCLIPLoader type flux)",
              "vae": "a VAE (load it with VAELoader)"}


def _require(value: Any, component: str, path: Path) -> Any:
    if value is None:
        raise MissingComponentError(f"{path} has no {COMPONENT_NAMES[component]}{_what_it_holds(path)}; "
                                    f"{ADD_LOADER_HINT[component]} with a file that has one")
    return value


def _what_it_holds(path: Path) -> str:
    """", it is a T5-XXL text encoder (...)": what a file that lacks the asked component is, where known."""
    try:
        with open_checkpoint(path) as reader:
            info = detect(reader)
    except (CheckpointError, UnsupportedModelError, OSError):
        return ""
    if info.family in FILE_KINDS:
        return f": it is {FILE_KINDS[info.family]}"
    if set(info.components) == {"te"}:
        kinds = ", ".join(config.kind for config in info.text_encoders)
        return f": it is a text encoder ({kinds}; load it with CLIPLoader or DualCLIPLoader)"
    return ""


def load_diffusion_model(path: str | os.PathLike[str], dtype: torch.dtype | str | None = None,
                         device: str = "cpu", params: str = "device", runtime: MemoryRuntime | None = None,
                         types: WeightTypes | None = None) -> DiffusionModel:
    """The UNet of a diffusion-model file (or of a full checkpoint)."""
    chosen = {"diffusion": types} if types is not None else None
    model = load_checkpoint(path, dtype, device, ("diffusion",), params, runtime, chosen)[0]
    return _require(model, "diffusion", Path(path))


def load_vae(path: str | os.PathLike[str], dtype: torch.dtype | str | None = None, device: str = "cpu",
             params: str = "device", runtime: MemoryRuntime | None = None) -> VAEModel:
    """The VAE of a VAE file (or of a full checkpoint)."""
    return _require(load_checkpoint(path, dtype, device, ("vae",), params, runtime)[2], "vae", Path(path))


# ---------------------------------------------------------------- text encoders

FAMILY_ROLES = {"sd1": ("clip_l",), "sd2": ("openclip_h",), "sdxl": ("clip_l", "openclip_g"),
                "sdxl_refiner": ("openclip_g",)}


def _with_role(config: TextEncoderConfig, kind: str) -> TextEncoderConfig:
    """The config under the role the family gives it (custom-width encoders are detected by layout only)."""
    return dataclasses.replace(config, kind=kind, activation="quick_gelu" if kind == "clip_l" else "gelu")


def _assign_roles(family: str, configs: list[TextEncoderConfig]) -> list[int]:
    """Indices of `configs` in the family's encoder order: CLIP-L (hf layout) first, OpenCLIP after."""
    roles = FAMILY_ROLES[family]
    if len(configs) != len(roles):
        raise ValueError(f"a {family} text encoder needs {len(roles)} encoder(s) ({', '.join(roles)}); "
                         f"the file(s) hold {len(configs)}: {', '.join(c.kind for c in configs) or 'none'}")
    order = sorted(range(len(configs)), key=lambda i: configs[i].layout != "hf")
    for index, role in zip(order, roles, strict=True):
        wanted_layout = "hf" if role == "clip_l" else "open_clip"
        if configs[index].layout != wanted_layout and configs[index].kind != role:
            raise ValueError(f"a {family} text encoder needs {', '.join(roles)}; got "
                             f"{', '.join(c.kind for c in configs)}")
    return order


def _text_encoder(family: str, sources: list[tuple[CheckpointReader, TextEncoderConfig]],
                  dtype: torch.dtype | None, target: _Target, types: WeightTypes | None = None,
                  ) -> TextEncoder:
    if family not in TEXT_FAMILIES:
        raise ValueError(f"no text conditioning for model family {family!r}; "
                         f"accepted: {', '.join(TEXT_FAMILIES)}")
    order = _assign_roles(family, [config for _, config in sources])
    built = [_build_clip(sources[i][0], _with_role(sources[i][1], role), dtype, target, types)
             for i, role in zip(order, FAMILY_ROLES[family], strict=True)]
    encoders = tuple(model for model, _ in built)
    memory = module_memory(target, "te", [name for _, name in built], encoders)
    runners = encoders if memory is None else [ManagedEncoder(m, memory, i) for i, m in enumerate(encoders)]
    paths = tuple(dict.fromkeys(reader.path for reader, _ in sources))
    conditioner = build_conditioner(family, runners)
    return adopt_lifetime(TextEncoder(family=family, encoders=encoders, conditioner=conditioner,
                              compute_device=target.device.name, params_location=target.home, sources=paths,
                              memory=memory), memory)


def load_text_encoders(paths: Sequence[str | os.PathLike[str]], family: str | None = None,
                       dtype: torch.dtype | str | None = None, device: str = "cpu", params: str = "device",
                       runtime: MemoryRuntime | None = None, types: WeightTypes | None = None) -> TextEncoder:
    """One text encoder (ComfyUI CLIP) from one file (SD1, SD2, refiner) or two (SDXL: CLIP-L + bigG).

    `family` None detects it from the encoders found (one CLIP-L: sd1; one OpenCLIP: sd2, or the refiner for
    bigG; CLIP-L + OpenCLIP: sdxl); given, it assigns the roles, which custom-width encoders need.
    """
    if not paths:
        raise ValueError("load_text_encoders needs at least one file")
    if family is not None and family not in (*TEXT_FAMILIES, "flux"):
        raise ValueError(f"unknown text encoder family {family!r}; "
                         f"accepted: {', '.join(TEXT_FAMILIES)}, flux")
    dtype, target = parse_dtype(dtype), _targets(["te"], device, params, runtime)["te"]
    file_paths = [Path(p) for p in paths]
    key = (tuple(_file_key(p) for p in file_paths), "te", family, dtype, types, *target.cache_key())

    def build() -> TextEncoder:
        readers = [open_checkpoint(p) for p in file_paths]
        try:
            with skipping_meta_init():
                sources, t5_sources = [], []
                for reader in readers:
                    info = _detect(reader)
                    if info.t5 is not None:
                        t5_sources.append((reader, info.t5, info.t5_prefix))
                    elif not info.text_encoders:
                        _require(None, "te", reader.path)
                    sources += [(reader, config) for config in info.text_encoders]
                if t5_sources and family not in (None, "flux"):
                    raise ValueError(f"a {family} text encoder takes no T5-XXL "
                                     f"({', '.join(str(reader.path) for reader, *_ in t5_sources)}); "
                                     f"T5-XXL is FLUX's: use type flux")
                if family == "flux" or t5_sources:
                    return _flux_text_encoder(sources, t5_sources, dtype, target, types)
                chosen = family or _family_of([config for _, config in sources])
                return _text_encoder(chosen, sources, dtype, target, types)
        finally:
            for reader in readers:
                reader.close()

    return _cached(key, build)


def _flux_text_encoder(sources: list[tuple[CheckpointReader, TextEncoderConfig]], t5_sources: list[tuple],
                       dtype: torch.dtype | None, target: _Target, types: WeightTypes | None = None,
                       ) -> TextEncoder:
    """FLUX's CLIP-L + T5-XXL from the given files: exactly one of each."""
    from engine.models.flux_loader import flux_text_encoder

    clip_l = [(reader, config) for reader, config in sources if config.layout == "hf"]
    if len(clip_l) != 1 or len(t5_sources) != 1 or len(sources) != 1:
        found = [c.kind for _, c in sources] + ["t5xxl"] * len(t5_sources)
        raise ValueError(f"a flux text encoder needs one CLIP-L and one T5-XXL file; the files hold "
                         f"{', '.join(found) or 'no text encoder'}")
    return flux_text_encoder(clip_l[0], t5_sources[0], dtype, target, types)


def _family_of(configs: list[TextEncoderConfig]) -> str:
    layouts = sorted(config.layout for config in configs)
    if layouts == ["hf"]:
        return "sd1"
    if layouts == ["hf", "open_clip"]:
        return "sdxl"
    if layouts == ["open_clip"]:
        return "sdxl_refiner" if configs[0].kind == "openclip_g" else "sd2"
    raise ValueError(f"cannot tell the model family of text encoders {', '.join(c.kind for c in configs)}; "
                     f"accepted: one CLIP-L (sd1), one OpenCLIP (sd2, sdxl_refiner), "
                     f"CLIP-L + OpenCLIP-G (sdxl)")


def load_embedding(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A textual-inversion file's vectors: {"clip_l": ..., "clip_g": ...} (SDXL) or {"emb_params": ...}."""
    with open_checkpoint(path) as reader:
        tensors = {key: reader.get(key).float() for key in reader.keys()}
    if "string_to_param.*" in tensors:  # A1111 layout flattened into one state dict
        tensors = {"emb_params": tensors["string_to_param.*"]}
    vectors = {k: v for k, v in tensors.items() if v.is_floating_point() and v.ndim in (1, 2)}
    if not vectors:
        raise ValueError(f"{path} holds no embedding vectors; "
                         f"accepted: tensors of shape (width,) or (n, width)")
    return vectors

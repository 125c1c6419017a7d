"""Load ControlNet and T2I-Adapter files into `ControlModel` bundles (ComfyUI's load_controlnet).

A file is a ControlNet when it has `zero_convs.0.0.weight` (ldm layout, bare or under `control_model.` as in
the original .pth files, which may also hold a whole SD checkpoint: only `control_model.*` is read) or
`controlnet_cond_embedding.conv_in.weight` (diffusers layout); otherwise a T2I-Adapter when it has the keys of
one (engine/models/t2i_adapter.py); otherwise it is refused with what it is. The network is built on `meta`
and its parameters bound to tensors read by name, as the SD loader does (engine/models/loader.py): read and
bound now, or registered in the memory runtime as module `controlnet` with its own compute device and weight
home. A file whose name ends in `_shuffle` (or `_shuffle_fp16`) is a shuffle ControlNet, whose residuals are
averaged over the pixels (ComfyUI's rule).

A "difference" ControlNet (a `difference` key beside `control_model.*`) stores its weights minus the SD1.5
UNet's; DiffControlNetLoader's model supplies them: each ControlNet weight whose name the UNet shares is read
as the file's plus the UNet's, from the UNet's own file (LoRAs applied to the model are not added).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from engine.memory.autofit import ComponentNeed
from engine.memory.runtime import MemoryRuntime
from engine.models import controlnet as controlnet_layout
from engine.models import t2i_adapter as adapter_layout
from engine.models.bundles import DiffusionModel
from engine.models.control import MEMORY_MODULE, ControlModel
from engine.models.controlnet import ControlNetModel, controlnet_config, controlnet_prefix, is_controlnet
from engine.models.detect import UnsupportedModelError, detect
from engine.models.formats import CheckpointError, CheckpointReader, open_checkpoint
from engine.models.loader import (
    _cached,
    _file_key,
    _Target,
    _targets,
    adopt_lifetime,
    default_dtype,
    module_memory,
    parse_dtype,
    place_network,
)
from engine.models.t2i_adapter import T2IAdapterModel, is_t2i_adapter, t2i_adapter_config

DIFFERENCE_KEY = "difference"
SHUFFLE_SUFFIXES = ("_shuffle", "_shuffle_fp16")
Getter = Callable[[str], torch.Tensor]


def file_names(reader: CheckpointReader) -> tuple[str, dict[str, str]]:
    """(kind, our parameter name -> the file's key) of a control file: kind "controlnet" or "t2i_adapter"."""
    keys = reader.keys()
    if is_controlnet(keys) or any(marker in keys for marker in controlnet_layout.UNSUPPORTED_MARKERS):
        layout, prefix = controlnet_prefix(keys)
        if layout == "diffusers":
            return "controlnet", controlnet_layout.diffusers_names(keys)
        return "controlnet", {key[len(prefix):]: key for key in keys
                              if key.startswith(prefix) and key != DIFFERENCE_KEY}
    if adapter_layout.DIFFUSERS_MARKER in keys:
        return "t2i_adapter", adapter_layout.diffusers_names(keys)
    if is_t2i_adapter(keys):
        return "t2i_adapter", {key: key for key in keys}
    raise UnsupportedModelError(f"{reader.path}: not a ControlNet or T2I-Adapter file Sluice reads; "
                                f"accepted: SD1.x / SD2.x / SDXL ControlNets (ldm or diffusers layout) and "
                                f"T2I-Adapters (full, SDXL, light)")


def network_for(reader: CheckpointReader, dtype: torch.dtype, device: str | torch.device = "meta",
                ) -> tuple[ControlNetModel | T2IAdapterModel, dict[str, str]]:
    """The network a control file holds, built on `device`, and its parameter name -> file key map."""
    kind, names = file_names(reader)
    shapes = {name: reader.shape(key) for name, key in names.items()}
    if kind == "controlnet":
        return ControlNetModel(controlnet_config(shapes), dtype=dtype, device=device), names
    return T2IAdapterModel(t2i_adapter_config(shapes), dtype=dtype, device=device), names


def _getter(reader: CheckpointReader, names: Mapping[str, str], base: Getter | None) -> Getter:
    """Our name -> the file's tensor (plus the base UNet's of the same name for a difference ControlNet)."""
    def get(name: str) -> torch.Tensor:
        if name not in names:
            raise KeyError(name)
        tensor = reader.get(names[name])
        if base is not None:
            shared = base(name)
            if shared is not None:
                tensor = tensor.float() + shared.float()
        return tensor
    return get


def _base_unet(model: DiffusionModel) -> Getter:
    """The UNet weights of `model` by parameter name, read from its file (None for a name it lacks)."""
    if model.source is None:
        raise ValueError("a difference ControlNet needs the weights of the model it was made against; this "
                         "model has no source file")
    reader = open_checkpoint(model.source)
    prefix = detect(reader).components.get("diffusion")
    if prefix is None:
        raise ValueError(f"{model.source} holds no UNet to add to the difference ControlNet")
    keys = set(reader.keys())

    def get(name: str) -> torch.Tensor | None:
        return reader.get(prefix + name) if prefix + name in keys else None
    return get


def _build(path: Path, dtype: torch.dtype | None, target: _Target, base: DiffusionModel | None,
           ) -> ControlModel:
    with open_checkpoint(path) as reader:
        difference = DIFFERENCE_KEY in reader.keys()
        stored = next((reader.dtype(key) for key in reader.keys() if key.endswith(".weight")), None)
        dtype = dtype or default_dtype("diffusion", target.device.torch_device, stored)
        network, names = network_for(reader, dtype)
        if difference and base is None:
            raise ValueError(f"{path} is a difference ControlNet: load it with DiffControlNetLoader and the "
                             f"model it was made against")
        base_get = _base_unet(base) if difference else None

        def from_disk() -> Callable[[str], torch.Tensor]:  # its own readers, the file's and the base UNet's
            return _getter(open_checkpoint(path), names, _base_unet(base) if difference else None)

        get = _getter(reader, names, base_get)
        name = place_network(network, target, MEMORY_MODULE, get, from_disk, path, "control model")
    memory = module_memory(target, MEMORY_MODULE, [name], [network])
    shuffle = path.stem.endswith(SHUFFLE_SUFFIXES) and isinstance(network, ControlNetModel)
    bundle = ControlModel(network, target.device.name, target.home, path, shuffle, memory)
    return adopt_lifetime(bundle, memory)


def load_control_model(path: str | os.PathLike[str], dtype: torch.dtype | str | None = None,
                       device: str = "cpu", params: str = "device", runtime: MemoryRuntime | None = None,
                       base: DiffusionModel | None = None) -> ControlModel:
    """The ControlNet or T2I-Adapter of a file (ComfyUI's CONTROL_NET) on `device` with its weights at
    `params` (device, cpu, disk; cpu and disk need the runtime). `base` is DiffControlNetLoader's model,
    whose UNet weights a difference ControlNet adds to its own. `dtype` None picks the device's default."""
    path, dtype = Path(path), parse_dtype(dtype)
    target = _targets([MEMORY_MODULE], device, params, runtime)[MEMORY_MODULE]
    if target.devices:
        raise ValueError(f"a control model computes on one device; got {device!r}")
    file_key = _file_key(path)
    if base is not None:
        with open_checkpoint(path) as reader:
            if DIFFERENCE_KEY not in reader.keys():
                base = None  # DiffControlNetLoader with a whole ControlNet: the model is not needed
    key = (*file_key, MEMORY_MODULE, dtype, *target.cache_key(), None if base is None else id(base.unet))
    return _cached(key, lambda: _build(path, dtype, target, base))


def control_needs(path: str | Path, compute: str, label: str, dtype: torch.dtype | None = None,
                  ) -> list[ComponentNeed]:
    """The header-only memory need of a control file (for auto-fit): its network's weights at the compute
    dtype and its largest tensor."""
    from engine.devices import resolve_device

    device = resolve_device(compute)
    try:
        with open_checkpoint(path) as reader:
            _, names = file_names(reader)
            shapes = [reader.shape(key) for key in names.values()]
            stored = next((reader.dtype(key) for key in names.values() if key.endswith(".weight")), None)
    except (CheckpointError, UnsupportedModelError):
        return []
    element = (dtype or default_dtype("diffusion", device.torch_device, stored)).itemsize
    sizes = [math.prod(shape) * element for shape in shapes]
    return [ComponentNeed(f"{label}/{MEMORY_MODULE}", MEMORY_MODULE, device.name, sum(sizes),
                          max(sizes, default=0))]

"""Load CLIP vision towers (ComfyUI's comfy.clip_vision.load and the unCLIP checkpoints' image embedder).

A file holds a tower when `find_layout` finds one in its keys (transformers or open_clip layout, under any
prefix: bare, `visual.`, `embedder.model.visual.`); anything else is refused with what it holds. The tower is
built on `meta` and its parameters bound to tensors read by name (engine/models/clip_vision.py maps names),
as the SD loader does (engine/models/loader.py): read and bound now, or registered in the memory runtime as
module `clip_vision` with its own compute device and weight home.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from engine.memory.autofit import ComponentNeed
from engine.memory.runtime import MemoryRuntime
from engine.models.clip_vision import (
    MEMORY_MODULE,
    CLIPVision,
    CLIPVisionModel,
    FileTensor,
    config_from_shapes,
    find_layout,
    read_tensor,
    weight_names,
)
from engine.models.detect import UnsupportedModelError
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


def has_clip_vision(reader: CheckpointReader) -> bool:
    return find_layout(reader.keys()) is not None


def file_names(reader: CheckpointReader) -> dict[str, FileTensor]:
    """Our parameter name -> where the file holds it; UnsupportedModelError for a file without a tower."""
    keys = reader.keys()
    found = find_layout(keys)
    if found is None:
        raise UnsupportedModelError(f"{reader.path}: the clip vision file is invalid and does not contain a "
                                    f"valid vision model; accepted: CLIP ViT-L/14, ViT-H/14, ViT-bigG/14 "
                                    f"vision towers in transformers or open_clip layout")
    layout, prefix = found
    if layout == "hf":
        return weight_names(keys, layout, prefix, 0)
    layers = 1 + max(int(key[len(prefix):].split(".")[2]) for key in keys
                     if key.startswith(prefix + "transformer.resblocks."))
    return weight_names(keys, layout, prefix, layers)


def _shape(reader: CheckpointReader, where: FileTensor) -> tuple[int, ...]:
    shape = reader.shape(where.key)
    if where.chunk is not None:
        shape = (shape[0] // 3, *shape[1:])
    if where.transpose:
        shape = (shape[1], shape[0])
    return shape


def network_for(reader: CheckpointReader, dtype: torch.dtype, device: str | torch.device = "meta",
                ) -> tuple[CLIPVisionModel, dict[str, FileTensor]]:
    """The tower a file holds, built on `device`, and its parameter name -> FileTensor map."""
    names = file_names(reader)
    config = config_from_shapes({name: _shape(reader, where) for name, where in names.items()},
                                reader.metadata())
    model = CLIPVisionModel(config, dtype=dtype, device=device)
    wanted = {name for name, _ in model.named_parameters()}
    return model, {name: where for name, where in names.items() if name in wanted}


def _getter(reader: CheckpointReader, names: dict[str, FileTensor]) -> Callable[[str], torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        if name not in names:
            raise KeyError(name)
        return read_tensor(reader.get, names[name])
    return get


def _build(path: Path, dtype: torch.dtype | None, target: _Target) -> CLIPVision:
    with open_checkpoint(path) as reader:
        names = file_names(reader)
        stored = next((reader.dtype(w.key) for w in names.values() if w.key.endswith(".weight")), None)
        dtype = dtype or default_dtype("te", target.device.torch_device, stored)
        model, names = network_for(reader, dtype)
        name = place_network(model, target, MEMORY_MODULE, _getter(reader, names),
                             lambda: _getter(open_checkpoint(path), names), path, "CLIP vision tower")
    memory = module_memory(target, MEMORY_MODULE, [name], [model])
    return adopt_lifetime(CLIPVision(model, target.device.name, target.home, path, memory), memory)


def load_clip_vision(path: str | os.PathLike[str], dtype: torch.dtype | str | None = None,
                     device: str = "cpu", params: str = "device", runtime: MemoryRuntime | None = None,
                     ) -> CLIPVision:
    """The CLIP vision tower of a file (a clip_vision/ file, or an unCLIP checkpoint's image embedder) on
    `device` with its weights at `params` (device, cpu, disk; cpu and disk need the runtime). `dtype` None
    picks the device's text-encoder default (float32 on the CPU)."""
    path, dtype = Path(path), parse_dtype(dtype)
    target = _targets([MEMORY_MODULE], device, params, runtime)[MEMORY_MODULE]
    if target.devices:
        raise ValueError(f"a CLIP vision tower computes on one device; got {device!r}")
    key = (*_file_key(path), MEMORY_MODULE, dtype, *target.cache_key())
    return _cached(key, lambda: _build(path, dtype, target))


def clip_vision_needs(path: str | Path, compute: str, label: str, dtype: torch.dtype | None = None,
                      ) -> list[ComponentNeed]:
    """The header-only memory need of a CLIP vision file (for auto-fit): its tower's weights at the compute
    dtype and its largest tensor; [] for a file without one."""
    from engine.devices import resolve_device

    device = resolve_device(compute)
    try:
        with open_checkpoint(path) as reader:
            names = file_names(reader)
            shapes = [_shape(reader, where) for where in names.values()]
            stored = next((reader.dtype(w.key) for w in names.values() if w.key.endswith(".weight")), None)
    except (CheckpointError, UnsupportedModelError):
        return []
    element = (dtype or default_dtype("te", device.torch_device, stored)).itemsize
    sizes = [math.prod(shape) * element for shape in shapes]
    return [ComponentNeed(f"{label}/{MEMORY_MODULE}", MEMORY_MODULE, device.name, sum(sizes),
                          max(sizes, default=0))]

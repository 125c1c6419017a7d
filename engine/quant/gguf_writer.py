"""Write GGUF v3 files, one tensor at a time (a 12B model never sits in memory whole).

The file is what ggml's `gguf_init_from_file` (stable-diffusion.cpp) and gguf-py's GGUFReader (ComfyUI-GGUF)
both read: fields, then tensor infos with offsets in file order, each tensor's data aligned to 32 bytes and
padded to the next multiple of 32 (ggml checks that every offset is the running, padded total). The file
is written under OUT.part and renamed when complete.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.quant.gguf_file import DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS
from engine.quant.types import GGML_TYPES

MAX_NAME_LENGTH = 127  # ComfyUI-GGUF's limit (stable-diffusion.cpp's ggml allows 159, llama.cpp's 63)
FieldValue = str | int | list[int]


@dataclass(frozen=True)
class GGUFTensorPlan:
    name: str
    shape: tuple[int, ...]  # torch order; written reversed (innermost first)
    type_name: str  # GGML type of the bytes

    @property
    def nbytes(self) -> int:
        t = GGML_TYPES[self.type_name]
        elements = 1
        for d in self.shape:
            elements *= d
        return elements // t.block_size * t.type_size


def write_gguf(path: str | os.PathLike[str], fields: dict[str, FieldValue], plans: Sequence[GGUFTensorPlan],
               tensor_bytes: Callable[[GGUFTensorPlan], torch.Tensor]) -> None:
    """Write `fields` (str: STRING, int: UINT32, list of ints: ARRAY of INT32) and the tensors of `plans`,
    in order, whose bytes `tensor_bytes(plan)` returns (a uint8 tensor of plan.nbytes elements, any shape)."""
    path = Path(path)
    _check_plans(plans)
    header = bytearray(MAGIC + struct.pack("<IQQ", 3, len(plans), len(fields)))
    for key, value in fields.items():
        header += _text(key) + _field_value(key, value)
    offset = 0
    for plan in plans:
        dims = tuple(reversed(plan.shape))
        header += _text(plan.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims,
                                                 GGML_TYPES[plan.type_name].type_id, offset)
        offset += _padded(plan.nbytes)
    header += bytes(_padded(len(header)) - len(header))
    partial = path.with_name(path.name + ".part")
    try:
        with open(partial, "wb") as f:
            f.write(header)
            for plan in plans:
                data = tensor_bytes(plan)
                if data.dtype != torch.uint8 or data.numel() != plan.nbytes:
                    raise ValueError(f"tensor '{plan.name}': expected {plan.nbytes} bytes of "
                                     f"{plan.type_name}, got {data.numel()} {data.dtype} elements")
                f.write(memoryview(data.detach().cpu().contiguous().numpy()).cast("B"))
                f.write(bytes(_padded(plan.nbytes) - plan.nbytes))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _check_plans(plans: Sequence[GGUFTensorPlan]) -> None:
    names = set()
    for plan in plans:
        if plan.name in names:
            raise ValueError(f"tensor '{plan.name}' is planned twice")
        names.add(plan.name)
        if len(plan.name.encode()) > MAX_NAME_LENGTH:
            raise ValueError(f"tensor name '{plan.name}' has {len(plan.name.encode())} bytes; ComfyUI-GGUF "
                             f"reads at most {MAX_NAME_LENGTH}")
        if len(plan.shape) > MAX_DIMS:
            raise ValueError(f"tensor '{plan.name}' of shape {plan.shape} has {len(plan.shape)} dims; GGUF "
                             f"holds at most {MAX_DIMS}")
        if plan.type_name not in GGML_TYPES:
            raise ValueError(f"tensor '{plan.name}': unknown GGML type {plan.type_name!r}")
        block = GGML_TYPES[plan.type_name].block_size
        if plan.shape and plan.shape[-1] % block:
            raise ValueError(f"tensor '{plan.name}' of shape {plan.shape}: rows of {plan.shape[-1]} elements "
                             f"are not whole {plan.type_name} blocks ({block} elements each)")


def _padded(n: int) -> int:
    return -(-n // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT


def _text(value: str) -> bytes:
    data = value.encode()
    return struct.pack("<Q", len(data)) + data


def _field_value(key: str, value: FieldValue) -> bytes:
    if isinstance(value, str):
        return struct.pack("<I", 8) + _text(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32:
        return struct.pack("<II", 4, value)
    if isinstance(value, list) and all(isinstance(v, int) and -(1 << 31) <= v < 1 << 31 for v in value):
        return struct.pack(f"<IIQ{len(value)}i", 9, 5, len(value), *value)
    raise ValueError(f"field {key!r}: cannot write {value!r}; accepted: a string, an int in [0, 2^32), "
                     f"a list of int32")

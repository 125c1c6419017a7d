"""The GGUF container (v2/v3, little-endian): header, key-value fields and tensor infos, read and checked.

Layout: magic "GGUF", u32 version, u64 tensor count, u64 field count; the fields (string key, u32 value
type, value); the tensor infos (string name, u32 n_dims, u64 dims innermost first, u32 GGML type, u64
offset into the data section); padding to `general.alignment` (default 32); the data section.

Every count and length in the header is checked against the bytes that remain before anything is built
from it, so a file that lies (a billion fields, a terabyte string, a tensor larger than the file) is a
`GGUFFormatError` after reading at most the file itself; the header is parsed from a memory map.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.quant.types import GGML_TYPES_BY_ID, GGMLType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8

# GGUF value types: id -> (name, struct format of a scalar; "" for string and array)
VALUE_TYPES: dict[int, tuple[str, str]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"),
    4: ("UINT32", "<I"), 5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"),
    8: ("STRING", ""), 9: ("ARRAY", ""), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}
STRING, ARRAY = 8, 9
MIN_FIELD_BYTES = 8 + 4 + 1  # empty key, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims, type, offset (+ 8 per dim)


class GGUFFormatError(ValueError):
    """A GGUF file whose header is malformed, lies about its sizes, or whose data is cut short."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (row) first
    ggml_type: GGMLType
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch order: the GGUF dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the innermost dim) of stored blocks."""
        inner = self.dims[0] if self.dims else 1
        return inner // self.ggml_type.block_size * self.ggml_type.type_size


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, Any]  # key -> value (str, int, float, bool, or a list of these / of lists)
    field_types: dict[str, str]  # key -> value type name ("STRING", "UINT32", "ARRAY[INT32]", ...)
    tensors: dict[str, GGUFTensor]  # in file order
    alignment: int
    data_start: int  # absolute offset of the data section
    file_size: int


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and check `path`'s header; tensor data is not read, only checked to lie within the file."""
    file_size = path.stat().st_size
    if file_size < 24:
        raise GGUFFormatError(f"truncated GGUF file: {file_size} bytes, the fixed header alone needs 24")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        return _Parser(buffer).header(file_size)


class _Parser:
    def __init__(self, buffer: mmap.mmap):
        self.buffer = buffer
        self.pos = 0

    def remaining(self) -> int:
        return len(self.buffer) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.remaining():
            raise GGUFFormatError(f"truncated GGUF file: {what} needs {n} bytes at byte {self.pos}, "
                                  f"only {self.remaining()} remain")
        data = self.buffer[self.pos:self.pos + n]
        self.pos += n
        return data

    def scalar(self, fmt: str, what: str) -> Any:
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))
        return value

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        if length > self.remaining():
            raise GGUFFormatError(f"corrupt GGUF header: {what} claims a string of {length} bytes at byte "
                                  f"{self.pos}, only {self.remaining()} remain")
        return self.take(length, what).decode("utf-8", "replace")

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """`n` items of at least `min_bytes` each must fit in what remains of the file."""
        if n * min_bytes > self.remaining():
            raise GGUFFormatError(f"corrupt GGUF header: it claims {n} {what}, which need at least "
                                  f"{n * min_bytes} bytes, but only {self.remaining()} remain")
        return n

    def value(self, value_type: int, what: str, depth: int = 0) -> tuple[Any, str]:
        if value_type not in VALUE_TYPES:
            raise GGUFFormatError(f"corrupt GGUF header: {what} has unknown value type {value_type}; "
                                  f"known: {', '.join(f'{k} ({n})' for k, (n, _) in VALUE_TYPES.items())}")
        name, fmt = VALUE_TYPES[value_type]
        if value_type == STRING:
            return self.string(what), name
        if value_type != ARRAY:
            return self.scalar(fmt, what), name
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFFormatError(f"corrupt GGUF header: {what} nests arrays deeper than {MAX_ARRAY_NESTING}")
        item_type = self.scalar("<I", what)
        length = self.scalar("<Q", what)
        if item_type not in VALUE_TYPES:
            raise GGUFFormatError(f"corrupt GGUF header: array {what} has unknown element type {item_type}")
        item_name, item_fmt = VALUE_TYPES[item_type]
        item_bytes = struct.calcsize(item_fmt) if item_fmt else {STRING: 8, ARRAY: 12}[item_type]
        self.count(length, item_bytes, f"elements in array {what}")
        if item_fmt:
            values = struct.unpack(f"<{length}{item_fmt[1]}", self.take(length * item_bytes, what))
            return list(values), f"ARRAY[{item_name}]"
        items = [self.value(item_type, what, depth + 1) for _ in range(length)]
        return [v for v, _ in items], f"ARRAY[{items[0][1] if items else item_name}]"

    def header(self, file_size: int) -> GGUFHeader:
        magic = self.take(4, "the magic")
        if magic != MAGIC:
            raise GGUFFormatError(f"not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
        version = self.scalar("<I", "the version")
        if version not in (2, 3):
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            hint = " (a big-endian GGUF file, which is not supported)" if swapped in (2, 3) else ""
            raise GGUFFormatError(f"unsupported GGUF version {version}{hint}; accepted: 2, 3")
        n_tensors = self.scalar("<Q", "the tensor count")
        n_fields = self.scalar("<Q", "the field count")
        self.count(n_fields, MIN_FIELD_BYTES, "key-value fields")
        self.count(n_tensors, MIN_TENSOR_INFO_BYTES, "tensors")
        fields: dict[str, Any] = {}
        field_types: dict[str, str] = {}
        for index in range(n_fields):
            key = self.string(f"the key of field {index}")
            if key in fields:
                raise GGUFFormatError(f"corrupt GGUF header: field {key!r} appears twice")
            fields[key], field_types[key] = self.value(self.scalar("<I", f"field {key!r}"), f"field {key!r}")
        infos = [self.tensor_info(index) for index in range(n_tensors)]
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
                or alignment & (alignment - 1):
            raise GGUFFormatError(f"corrupt GGUF header: general.alignment is {alignment!r}, "
                                  "not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        for name, dims, ggml_type, offset in infos:
            if name in tensors:
                raise GGUFFormatError(f"corrupt GGUF header: tensor {name!r} appears twice")
            tensors[name] = self.checked_tensor(name, dims, ggml_type, data_start + offset, file_size)
        return GGUFHeader(version, fields, field_types, tensors, alignment, data_start, file_size)

    def tensor_info(self, index: int) -> tuple[str, tuple[int, ...], GGMLType, int]:
        name = self.string(f"the name of tensor {index}")
        n_dims = self.scalar("<I", f"tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(f"corrupt GGUF header: tensor {name!r} has {n_dims} dims; GGUF allows "
                                  f"at most {MAX_DIMS}")
        dims = struct.unpack(f"<{n_dims}Q", self.take(8 * n_dims, f"the dims of tensor {name!r}"))
        type_id = self.scalar("<I", f"tensor {name!r}")
        offset = self.scalar("<Q", f"tensor {name!r}")
        if type_id not in GGML_TYPES_BY_ID:
            known = ", ".join(f"{t.name} ({i})" for i, t in GGML_TYPES_BY_ID.items())
            raise GGUFFormatError(f"tensor {name!r} has unknown GGML type id {type_id}; known: {known}")
        return name, dims, GGML_TYPES_BY_ID[type_id], offset

    @staticmethod
    def checked_tensor(name: str, dims: tuple[int, ...], ggml_type: GGMLType, start: int,
                       file_size: int) -> GGUFTensor:
        if dims and dims[0] % ggml_type.block_size:
            raise GGUFFormatError(f"corrupt GGUF header: tensor {name!r} has rows of {dims[0]} elements, "
                                  f"not whole {ggml_type.name} blocks ({ggml_type.block_size} elements each)")
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // ggml_type.block_size * ggml_type.type_size
        shape = list(reversed(dims))
        if start > file_size:
            raise GGUFFormatError(f"corrupt GGUF file: tensor {name!r} starts at byte {start}, past the end "
                                  f"of the file ({file_size} bytes)")
        if start + nbytes > file_size:
            raise GGUFFormatError(f"truncated GGUF file: tensor {name!r} ({ggml_type.name}{shape}, {nbytes} "
                                  f"bytes) ends at byte {start + nbytes}, the file holds {file_size}")
        return GGUFTensor(name, dims, ggml_type, start, nbytes)

"""Lazy checkpoint readers: safetensors, torch zip pickles (.ckpt/.pt/.pth) and GGUF, chosen by magic bytes.

Every reader lists names, shapes, dtypes and byte sizes from the file's header alone; tensor data is read
only by `get`. Bad files fail with a `CheckpointError` naming the file (and the tensor where one is at fault).
"""

from __future__ import annotations

import collections
import difflib
import io
import math
import os
import pickle
import struct
import threading
import zipfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.jsonfile import JsonInputError, load_json
from engine.memory.file_reads import FileSpan
from engine.quant.dequant import dequantize
from engine.quant.gguf_file import GGUFFormatError, read_gguf_header
from engine.quant.types import DEQUANTIZABLE

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


WRAPPER_KEYS = ("state_dict", "params_ema", "params")  # keys that hold the real state dict in .pth files


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: unknown format, corrupt or truncated data, lying header."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle that asks for something other than tensors and plain containers."""


class UnsupportedTensorTypeError(CheckpointError):
    """A tensor stored in a type this engine cannot turn into a torch tensor yet (quantised GGUF types)."""


class MissingTensorError(KeyError):
    """A tensor name that is not in the file; the message names the file and the closest names."""

    def __init__(self, path: Path, key: str, available: list[str]):
        matches = difflib.get_close_matches(key, available, n=3, cutoff=0.6)
        hint = (
            f"; close matches: {', '.join(matches)}"
            if matches
            else f"; the file holds {len(available)} tensors"
        )
        self.message = f"no tensor '{key}' in {path}{hint}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # torch order (GGUF dims already reversed)
    type_name: str  # "F32", "F16", "BF16", ... or a GGUF quantised type such as "Q4_K"
    dtype: torch.dtype | None  # None for quantised GGUF types
    nbytes: int


class CheckpointReader(ABC):
    """Header-first access to the tensors of one checkpoint file; use as a context manager."""

    format: str

    def __init__(self, path: Path, tensors: dict[str, TensorInfo], metadata: dict[str, str]):
        self.path = path
        self._tensors = tensors
        self._metadata = metadata

    def keys(self) -> list[str]:
        return list(self._tensors)

    def info(self, key: str) -> TensorInfo:
        try:
            return self._tensors[key]
        except KeyError:
            raise MissingTensorError(self.path, key, self.keys()) from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.info(key).shape

    def type_name(self, key: str) -> str:
        return self.info(key).type_name

    def dtype(self, key: str) -> torch.dtype:
        info = self.info(key)
        if info.dtype is None:
            raise UnsupportedTensorTypeError(self._unsupported_type_message(key, info.type_name))
        return info.dtype

    def nbytes(self, key: str) -> int:
        return self.info(key).nbytes

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def get(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor:
        info = self.info(key)
        if info.dtype is None:
            raise UnsupportedTensorTypeError(self._unsupported_type_message(key, info.type_name))
        return self._load(key, info).to(device)

    def file_span(self, key: str) -> FileSpan | None:
        """Where the tensor's bytes lie in the file, for readers that store tensors as plain bytes (None
        otherwise, and for a name the file lacks): the weight store then reads many straight into their
        homes (engine/memory/file_reads.py)."""
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _unsupported_type_message(self, key: str, type_name: str) -> str:
        return (f"tensor {key} is quantised (GGML type {type_name}) and has no torch dtype; read its bytes "
                f"with get_raw, or get it dequantised (file {self.path})")

    @abstractmethod
    def _load(self, key: str, info: TensorInfo) -> torch.Tensor: ...

    @abstractmethod
    def close(self) -> None: ...


def open_checkpoint(path: str | os.PathLike[str]) -> CheckpointReader:
    """Open `path` with the reader its first bytes call for (the extension is not trusted)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == b"GGUF":
        return GGUFCheckpointReader(path)
    if head[:4] == b"PK\x03\x04":
        return TorchZipReader(path)
    if head[8:9] == b"{":  # checked before pickles: a header length may start with the byte 0x80
        return SafetensorsReader(path)
    if head[:1] == b"\x80":
        _reject_plain_pickle(path)
    raise CheckpointError(
        f"unrecognised checkpoint format: {path} (first bytes {head[:8]!r}); accepted: safetensors, "
        "GGUF, torch zip checkpoints (.ckpt/.pt/.pth)"
    )


# ---------------------------------------------------------------- safetensors


class SafetensorsReader(CheckpointReader):
    """safetensors: the JSON header is parsed and checked here; data is memory-mapped by `safe_open`."""

    format = "safetensors"

    def __init__(self, path: Path):
        tensors, metadata, self._offsets = _read_safetensors_header(path)
        super().__init__(path, tensors, metadata)
        self._handle: Any = None

    def file_span(self, key: str) -> FileSpan | None:
        info = self._tensors.get(key)
        if info is None or info.dtype is None:
            return None
        return FileSpan(self.path, self._offsets[key], info.nbytes, info.dtype, info.shape)

    def _load(self, key: str, info: TensorInfo) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        try:
            if self._handle is None:
                self._handle = safe_open(str(self.path), framework="pt")
            return self._handle.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read tensor {key!r} of safetensors file {self.path}: "
                                  f"{exc}") from None

    def close(self) -> None:
        self._handle = None


def _read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], dict[str, int]]:
    """The tensors' infos, the metadata, and each tensor's offset from the start of the file."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"truncated safetensors file {path}: {file_size} bytes, no header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(file_size - 8, MAX_SAFETENSORS_HEADER):
            raise CheckpointError(
                f"corrupt safetensors file {path}: header length {header_len} exceeds the file "
                f"({file_size} bytes)"
            )
        raw = f.read(header_len)
    try:
        header = load_json(raw, "header")
    except JsonInputError as exc:
        raise CheckpointError(f"corrupt safetensors file {path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt safetensors file {path}: header is not a JSON object")
    raw_metadata = header.pop("__metadata__", None) or {}
    if not isinstance(raw_metadata, dict):
        raise CheckpointError(f"corrupt safetensors file {path}: __metadata__ is a JSON "
                              f"{type(raw_metadata).__name__}; accepted: an object of strings")
    metadata = {str(k): str(v) for k, v in raw_metadata.items()}
    data_size = file_size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    spans = []  # (begin, end, key)
    for key, entry in header.items():
        tensors[key], begin, end = _checked_safetensors_entry(path, key, entry, data_size)
        spans.append((begin, end, key))
    _check_safetensors_tiling(path, sorted(spans), data_size)
    offsets = {key: 8 + header_len + begin for begin, _, key in spans}
    return tensors, metadata, offsets


def _check_safetensors_tiling(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors, in order of their offsets, must cover the data region exactly, without overlap or gap
    (what the safetensors library checks when it opens the file, there without the file's name)."""
    previous_end, previous_key = 0, None
    for begin, end, key in spans:
        if begin != previous_end:
            before = ("the data begins at byte 0" if previous_key is None
                      else f"the tensor before it ({previous_key!r}) ends at byte {previous_end}")
            raise CheckpointError(f"corrupt safetensors file {path}: tensor {key!r} starts at byte {begin} "
                                  f"of the data region, but {before}; the tensors must cover it in order, "
                                  f"without overlap or gap")
        previous_end, previous_key = end, key
    if previous_end != data_size:
        raise CheckpointError(f"corrupt safetensors file {path}: the tensors end at byte {previous_end} of "
                              f"the data region, but it holds {data_size} bytes")


def _checked_safetensors_entry(path: Path, key: str, entry: Any,
                               data_size: int) -> tuple[TensorInfo, int, int]:
    """The tensor's info and its data offsets [begin, end)."""
    try:
        type_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(
            f"corrupt safetensors file {path}: bad header entry for tensor '{key}'"
        ) from None
    if not isinstance(type_name, str) or type_name not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"safetensors file {path}: tensor '{key}' has dtype {type_name!r}; accepted: "
            f"{', '.join(SAFETENSORS_DTYPES)}"
        )
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (*shape, begin, end)) \
            or end < begin:
        raise CheckpointError(f"corrupt safetensors file {path}: bad shape or offsets for tensor '{key}'")
    dtype = SAFETENSORS_DTYPES[type_name]
    nbytes = math.prod(shape) * dtype.itemsize  # exact: dimensions of 40 digits do not wrap around
    if end - begin != nbytes:
        raise CheckpointError(
            f"corrupt safetensors file {path}: tensor '{key}' is {type_name}{list(shape)} ({nbytes} bytes) "
            f"but its data_offsets [{begin}, {end}] span {end - begin} bytes"
        )
    if end > data_size:
        raise CheckpointError(
            f"truncated safetensors file {path}: tensor '{key}' ends at byte {end} of the data region, "
            f"which holds only {data_size} bytes"
        )
    return TensorInfo(shape, type_name, dtype, nbytes), begin, end


# ---------------------------------------------------------------- torch zip pickles


STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _LazyTensor:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: _StorageRef, offset: int, size: tuple, stride: tuple, *_: Any) -> _LazyTensor:
    return _LazyTensor(storage, int(offset), tuple(size), tuple(stride))


def _rebuild_parameter(data: _LazyTensor, *_: Any) -> _LazyTensor:
    return data


class _InertObject:
    """Stands in for a training-time object (a Lightning callback) without importing or running its code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    # original SD 1.x .ckpt files carry their Lightning checkpoint callback; it becomes an inert placeholder
    ("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint"): _InertObject,
    **{("torch", name): _StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only tensor rebuild functions, storages and OrderedDict; tensors stay lazy."""

    def __init__(self, data: bytes, path: Path):
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise UnsafeCheckpointError(
                f"refusing to load {self.path}: the file asks for '{module}.{name}'; only tensors and plain "
                "containers are accepted"
            )
        return allowed

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
        ):
            raise CheckpointError(
                f"corrupt torch checkpoint {self.path}: unexpected persistent id {pid!r:.80}"
            )
        _, storage_type, key, _location, numel = pid
        return _StorageRef(str(key), storage_type.dtype, int(numel))


def _unpickle(data: bytes, path: Path) -> Any:
    try:
        return _RestrictedUnpickler(data, path).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"corrupt torch checkpoint {path}: cannot unpickle ({exc})") from None


def _reject_plain_pickle(path: Path) -> None:
    """A bare pickle is either torch's legacy (pre-1.6) format or not a checkpoint; neither is read."""
    with open(path, "rb") as f:
        first = _unpickle(f.read(1 << 16), path)
    if isinstance(first, int):
        raise CheckpointError(
            f"{path} uses torch's legacy (pre-1.6) serialization, which is not supported; re-save it with "
            "torch.save or convert it to safetensors"
        )
    raise CheckpointError(
        f"{path} is a bare pickle, not a torch checkpoint; accepted: safetensors, GGUF, torch zip"
    )


class TorchZipReader(CheckpointReader):
    """torch.save zip archives (data.pkl + data/N) through an allowlisting unpickler; no pickle code runs."""

    format = "torch"

    def __init__(self, path: Path):
        self.path = path
        try:
            self._zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(f"corrupt or truncated torch checkpoint {path}: {exc}") from None
        try:
            tensors = self._read_tensor_table()
        except BaseException:
            self._zip.close()
            raise
        super().__init__(path, tensors, {})

    def _read_tensor_table(self) -> dict[str, TensorInfo]:
        path = self.path
        pickles = [n for n in self._zip.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if not pickles:
            raise CheckpointError(f"{path} is a zip file without data.pkl; it is not a torch checkpoint")
        self._root = pickles[0][: -len("data.pkl")]
        try:
            obj = _unpickle(self._zip.read(pickles[0]), path)
        except zipfile.BadZipFile as exc:
            raise CheckpointError(f"corrupt torch checkpoint {path}: {exc}") from None
        for wrapper in WRAPPER_KEYS:  # Lightning's "state_dict", BasicSR's "params_ema" / "params"
            if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
                obj = obj[wrapper]
                break
        if not isinstance(obj, dict):
            raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict of tensors")
        self._lazy = {str(k): v for k, v in obj.items() if isinstance(v, _LazyTensor)}
        if not self._lazy and obj:
            raise CheckpointError(
                f"{path} holds no tensors (top-level keys: {', '.join(map(str, list(obj)[:8]))})"
            )
        return {key: self._checked_info(key, lazy) for key, lazy in self._lazy.items()}

    def _checked_info(self, key: str, lazy: _LazyTensor) -> TensorInfo:
        name = f"{self._root}data/{lazy.storage.key}"
        try:
            stored = self._zip.getinfo(name).file_size
        except KeyError:
            raise CheckpointError(
                f"corrupt torch checkpoint {self.path}: tensor '{key}' needs missing {name}"
            ) from None
        extent = lazy.offset + sum((s - 1) * st for s, st in zip(lazy.size, lazy.stride, strict=False)) + 1
        needed = (extent if all(lazy.size) else 0) * lazy.storage.dtype.itemsize
        if needed > stored:
            raise CheckpointError(
                f"corrupt torch checkpoint {self.path}: tensor '{key}' needs {needed} bytes of {name}, "
                f"which holds {stored}"
            )
        dtype = lazy.storage.dtype
        return TensorInfo(
            lazy.size, TYPE_NAMES[dtype], dtype, int(np.prod(lazy.size, dtype=np.int64)) * dtype.itemsize
        )

    def _load(self, key: str, info: TensorInfo) -> torch.Tensor:
        lazy = self._lazy[key]
        try:
            raw = bytearray(self._zip.read(f"{self._root}data/{lazy.storage.key}"))
        except (zipfile.BadZipFile, OSError) as exc:
            raise CheckpointError(
                f"corrupt torch checkpoint {self.path}: cannot read tensor '{key}' ({exc})"
            ) from None
        storage = (
            torch.frombuffer(raw, dtype=lazy.storage.dtype)
            if raw
            else torch.empty(0, dtype=lazy.storage.dtype)
        )
        tensor = storage.as_strided(lazy.size, lazy.stride, lazy.offset)
        return tensor.clone() if tensor.numel() < storage.numel() else tensor

    def close(self) -> None:
        self._zip.close()


# ---------------------------------------------------------------- GGUF


GGUF_TORCH_TYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}
ORIG_SHAPE_FIELD = "comfy.gguf.orig_shape."  # ComfyUI-GGUF: the logical shape of a tensor stored reshaped


class GGUFCheckpointReader(CheckpointReader):
    """GGUF, header parsed and checked by engine.quant.gguf_file; GGUF dims run innermost-first, torch shapes
    reverse them (or are ComfyUI-GGUF's stored original shape). Quantised tensors are read as their bytes
    (`get_raw`); `get` dequantises them to float32."""

    format = "gguf"

    def __init__(self, path: Path):
        try:
            header = read_gguf_header(path)
        except GGUFFormatError as exc:
            raise CheckpointError(f"{exc} ({path})") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"corrupt or truncated GGUF file {path}: {exc}") from None
        self.header = header
        self._file: io.BufferedReader | None = None
        self._lock = threading.Lock()
        tensors = {
            name: TensorInfo(self._logical_shape(name), t.ggml_type.name,
                             GGUF_TORCH_TYPES.get(t.ggml_type.name), t.nbytes)
            for name, t in header.tensors.items()
        }
        from dataclasses import replace

        from engine.models.gguf_layout import gguf_layout  # names and shapes of ComfyUI-GGUF and sd.cpp files

        tensors, names = gguf_layout(header.fields.get("general.architecture"), tensors, path)
        self.header = replace(header, tensors={key: header.tensors[name] for key, name in names.items()})
        metadata = {key: str(value) for key, value in header.fields.items() if not isinstance(value, list)}
        super().__init__(path, tensors, metadata)

    def fields(self) -> dict[str, Any]:
        """Every key-value field with its typed value (lists for arrays: tokenizer vocabularies, shapes)."""
        return dict(self.header.fields)

    def get_raw(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's stored bytes, uint8 (rows, row_bytes), rows of the innermost GGUF dim; read into `out`
        (a contiguous CPU uint8 tensor of `nbytes(key)` elements, pinned memory for instance) when given.
        Types engine.quant.dequantize cannot turn into floats are an error naming the tensor."""
        info = self.info(key)
        entry = self.header.tensors[key]
        if info.dtype is None and info.type_name not in DEQUANTIZABLE:
            raise UnsupportedTensorTypeError(
                f"tensor '{key}' of {self.path} has GGML type {info.type_name}, which is not supported; "
                f"accepted: {', '.join(DEQUANTIZABLE)}"
            )
        if out is None:
            out = torch.empty(entry.nbytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() \
                or out.numel() != entry.nbytes:
            raise ValueError(f"get_raw('{key}'): out must be a contiguous CPU uint8 tensor of {entry.nbytes} "
                             f"elements, got {out.dtype} {tuple(out.shape)} on {out.device}")
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "rb")  # kept open until close()
            self._file.seek(entry.start)
            read = self._file.readinto(memoryview(out.numpy()).cast("B")) if entry.nbytes else 0
        if read != entry.nbytes:
            raise CheckpointError(f"truncated GGUF file {self.path}: tensor '{key}' needs {entry.nbytes} "
                                  f"bytes at byte {entry.start}, read {read} (changed since opened?)")
        row_bytes = entry.row_bytes
        return out.view(entry.nbytes // row_bytes if row_bytes else 0, row_bytes)

    def _load(self, key: str, info: TensorInfo) -> torch.Tensor:
        raw = self.get_raw(key)
        if info.dtype is None:
            return dequantize(raw, info.type_name, info.shape)
        return raw.view(-1).view(info.dtype).reshape(info.shape)

    def get(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor as torch; a quantised one dequantised to float32."""
        return self._load(key, self.info(key)).to(device)

    def _logical_shape(self, name: str) -> tuple[int, ...]:
        stored = self.header.tensors[name].shape
        orig = self.header.fields.get(ORIG_SHAPE_FIELD + name)
        if isinstance(orig, list) and all(isinstance(d, int) and d >= 0 for d in orig) \
                and int(np.prod(orig, dtype=np.int64)) == int(np.prod(stored, dtype=np.int64)):
            return tuple(orig)
        return stored

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

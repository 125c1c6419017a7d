"""Loading a model whose Linear and Conv2d weights rest quantised: from a quantised file or quantised on load.

`quantise_model(model, reader, key_of, types, device)` decides, from the file's header, which weights of a
model built on `meta` rest quantised, turns their layers into quantised ones (engine/quant/modules.py) and
returns a `QuantisedReader`: the reader the loader then binds or registers the model from, unchanged
otherwise. Through it

- a weight the file stores quantised (a GGUF Q8_0, Q4_K, ... tensor) reads as its bytes, (rows, row bytes)
  uint8, never expanded;
- a float weight that `types` (`--type`, `--tensor-type-rules`, or the auto-fit ladder) gives a quantised
  type is moved to the compute device and quantised there as it is read;
- any other tensor the file stores quantised (a norm, an embedding, a weight no layer of ours rests
  quantised) reads dequantised to float32 (the reader's `get`), and the loader casts it to its parameter's
  dtype as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.memory.file_reads import FileSpan
from engine.models.formats import CheckpointReader, TensorInfo, open_checkpoint
from engine.quant.modules import QuantSpec, quantisable_weights, quantise_modules, weight_shape
from engine.quant.quantize import quantize, tensor_type_rules
from engine.quant.types import GGML_TYPES, QUANTIZED

KeyOf = Callable[[str], str | None]  # parameter name -> the file key it is read from (None: not one tensor)


@dataclass(frozen=True)
class WeightTypes:
    """What `--type` and `--tensor-type-rules` ask of one model (stable-diffusion.cpp's meaning): the type of
    every eligible weight, with regex rules over the file's tensor names first. Hashable: a loaded model's
    cache key holds it."""

    default: str | None = None  # e.g. "q8_0"; None: the file's own types (rules may still name some)
    rules: str = ""  # "regex=type,regex=type" in stable-diffusion.cpp's syntax

    @functools.cached_property
    def _target(self) -> Callable[[str, tuple[int, ...]], str | None]:
        return tensor_type_rules(self.default, self.rules)

    def type_for(self, key: str, shape: tuple[int, ...]) -> str | None:
        """The GGML type (upper case) the tensor `key` of logical `shape` should rest in, or None to keep it
        as the file has it (stable-diffusion.cpp's eligibility rules: engine.quant.quantize)."""
        return self._target(key, shape)


class QuantisedReader(CheckpointReader):
    """A checkpoint reader whose `get` gives the stored form of each tensor of one model: quantised bytes for
    the weights in `specs` (file key -> spec), float tensors for everything else (see the module docstring).
    """

    def __init__(self, inner: CheckpointReader, specs: dict[str, QuantSpec], device: torch.device):
        super().__init__(inner.path, {key: inner.info(key) for key in inner.keys()}, inner.metadata())
        self.format = inner.format
        self.inner = inner
        self.specs = specs
        self.device = device  # where weights quantised on load are quantised (the compute device)

    def get(self, key: str, device: str | torch.device | None = None) -> torch.Tensor:
        """The tensor in its stored form, on `device` (None: where it was made: the CPU for what the file
        holds, the compute device for a weight quantised on load)."""
        spec = self.specs.get(key)
        if spec is None:
            tensor = self.inner.get(key)  # a quantised tensor comes dequantised to float32
        elif self.info(key).type_name == spec.qtype:
            tensor = self.inner.get_raw(key).reshape(spec.raw_shape)
        else:
            tensor = quantize(self.inner.get(key).to(self.device), spec.qtype).reshape(spec.raw_shape)
        return tensor if device is None else tensor.to(device)

    def file_span(self, key: str) -> FileSpan | None:
        """Where a tensor kept as the file has it lies in the file (None for one that rests quantised)."""
        return None if key in self.specs else self.inner.file_span(key)

    def _load(self, key: str, info: TensorInfo) -> torch.Tensor:
        return self.get(key)

    def reopen(self) -> QuantisedReader:
        """The same view over a newly opened reader of the file (a disk home re-reads through its own)."""
        return QuantisedReader(reopen(self.inner), self.specs, self.device)

    def close(self) -> None:
        self.inner.close()


def reopen(reader: CheckpointReader) -> CheckpointReader:
    """A newly opened reader of `reader`'s file, with the same quantised view when it has one."""
    return reader.reopen() if isinstance(reader, QuantisedReader) else open_checkpoint(reader.path)


def quantise_model(model: torch.nn.Module, reader: CheckpointReader, key_of: KeyOf,
                   types: WeightTypes | None = None, device: torch.device | str = "cpu") -> QuantisedReader:
    """Make the layers of `model` (built on meta) whose weights rest quantised quantised ones, and return
    the reader to bind it from (see the module docstring). `key_of` maps a parameter name to the file key
    it is read from; a name it maps to None (a tensor assembled from several, e.g. a diffusers FLUX qkv)
    reads as float."""
    specs: dict[str, QuantSpec] = {}  # parameter name -> spec
    keys: dict[str, str] = {}  # parameter name -> file key
    for name, layer in quantisable_weights(model).items():
        key = key_of(name)
        if key is None or key not in reader:
            continue
        info, shape = reader.info(key), tuple(weight_shape(layer))
        if info.shape != shape:
            continue  # binding reports the mismatch, naming the tensor
        qtype = info.type_name if info.type_name in QUANTIZED else None
        if qtype is None and types is not None and info.dtype is not None and info.dtype.is_floating_point:
            wanted = types.type_for(key, shape)
            qtype = wanted if wanted in QUANTIZED and shape[-1] % GGML_TYPES[wanted].block_size == 0 else None
        if qtype is not None:
            specs[name], keys[name] = QuantSpec(qtype, shape), key
    quantise_modules(model, specs)
    return QuantisedReader(reader, {keys[name]: spec for name, spec in specs.items()}, torch.device(device))


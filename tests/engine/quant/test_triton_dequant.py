"""The Triton dequantisation kernels (engine/quant/triton_dequant.py) against the PyTorch reference
(engine/quant/dequant.py, itself bit-exact against gguf): bit-identical on random blocks with extreme fp16
scales (infinities, NaN, subnormals, largest finite, signed zeros) in float32, float16 and bfloat16; the one
choice point (dequant_backend) and its fallback.

These run in CI on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set for the kernel module while
this file's tests run), a few blocks each; they skip where Triton is not installed. Under the interpreter the
kernels round to bfloat16 on the bits (the interpreter's own conversion truncates); the GPU's conversion,
which they use when compiled, is checked on a GPU by test_triton_dequant_cuda.py."""

from __future__ import annotations

import importlib
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")
# the interpreter computes in numpy, which warns of the infinities and NaNs the extreme scales make
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from engine.quant import dequant  # noqa: E402
from engine.quant.dequant import dequant_backend, dequantize, set_dequant_backend  # noqa: E402
from engine.quant.modules import QuantSpec, quantise_modules, raw_shape  # noqa: E402
from engine.quant.types import GGML_TYPES, QUANTIZED  # noqa: E402

# byte offsets of each type's fp16 scale fields inside its block
FP16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}
# fp16 bits: inf, -inf, two NaNs, subnormals, smallest normal, largest finite, signed zeros, 1
EXTREME_HALVES = np.array([0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x0000,
                           0x8000, 0x3C00], dtype=np.uint16)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture(scope="module")
def kernels():
    """engine.quant.triton_dequant with its kernels made under Triton's interpreter (they then run on CPU
    tensors); made again for the GPU afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        module = importlib.reload(importlib.import_module("engine.quant.triton_dequant"))
    yield module
    importlib.reload(module)


@pytest.fixture
def forced_triton(kernels):
    set_dequant_backend("triton")
    yield kernels
    set_dequant_backend("auto")


def random_blocks(qtype: str, n_blocks: int, seed: int) -> torch.Tensor:
    """Random bytes of `n_blocks` blocks, (n_blocks, bytes), whose fp16 fields take each extreme value
    above at least once and random bits (any exponent, inf and NaN included) elsewhere."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, GGML_TYPES[qtype].type_size), dtype=np.uint8)
    for field, offset in enumerate(FP16_FIELDS[qtype]):
        halves = rng.integers(0, 1 << 16, n_blocks, dtype=np.uint16)
        shown = min(n_blocks, len(EXTREME_HALVES))
        halves[:shown] = np.roll(EXTREME_HALVES, field)[:shown]
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return torch.from_numpy(blocks)


def assert_same_values(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits, except that a NaN need only be a NaN where the reference has one."""
    assert ours.shape == expected.shape and ours.dtype == expected.dtype
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan), "NaNs in other places"
    differ = (ours.view(BITS[ours.dtype]) != expected.view(BITS[ours.dtype])) & ~nan
    assert not differ.any(), f"{differ.sum().item()} of {ours.numel()} values differ in their bits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", QUANTIZED)
def test_kernel_is_bit_exact_against_the_pytorch_path_with_extreme_scales(kernels, qtype, dtype):
    t = GGML_TYPES[qtype]
    n_blocks = kernels.ELEMENTS_PER_PROGRAM // t.block_size + 3  # a whole program and a partial one
    raw = random_blocks(qtype, n_blocks, seed=sum(map(ord, qtype)))
    shape = (n_blocks * t.block_size // 32, 32)
    ours = kernels.dequantize_triton(raw, qtype, shape, dtype)
    expected = dequant.DEQUANTIZERS[qtype](raw, dtype).reshape(shape)
    assert expected.isnan().any() and expected.isinf().any()  # the extreme scales reached the values
    assert_same_values(ours, expected)


def test_every_quantised_type_has_a_kernel(kernels):
    assert set(kernels.KERNELS) == set(QUANTIZED) == set(dequant.DEQUANTIZERS)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_dequantize_through_the_kernel_reads_an_unaligned_slice_in_any_shape(forced_triton, qtype):
    t = GGML_TYPES[qtype]
    flat = random_blocks(qtype, 8 * 256 // t.block_size, seed=5).reshape(-1)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]  # storage offset 1
    ours = dequantize(shifted, qtype.lower(), (2, 4, 256), torch.bfloat16)
    assert_same_values(ours, dequant.DEQUANTIZERS[qtype](flat.reshape(-1, t.type_size),
                                                         torch.bfloat16).reshape(2, 4, 256))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_quant_linear_computes_the_same_through_the_kernel_and_through_pytorch(kernels, qtype):
    model = nn.Sequential(nn.Linear(256, 16, device="meta"))
    quantise_modules(model, {"0.weight": QuantSpec(qtype, (16, 256))})
    t = GGML_TYPES[qtype]
    raw = random_blocks(qtype, 16 * 256 // t.block_size, seed=9)
    raw[:, [offset + 1 for offset in FP16_FIELDS[qtype]]] &= 0xBF  # finite scales, below 2: no NaN output
    model.load_state_dict({"0.weight": raw.reshape(raw_shape(qtype, (16, 256))), "0.bias": torch.randn(16)},
                          assign=True)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    expected = model[0](x)
    set_dequant_backend("triton")
    try:
        ours = model[0](x)
    finally:
        set_dequant_backend("auto")
    assert torch.equal(ours, expected) and torch.equal(ours, F.linear(
        x, dequant.DEQUANTIZERS[qtype](raw, torch.bfloat16).reshape(16, 256), model[0].bias.bfloat16()))


def test_the_choice_point_takes_triton_on_cuda_only_for_types_and_dtypes_with_a_kernel(kernels):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert dequant_backend(cuda, "Q8_0", torch.bfloat16) == "triton"
    assert dequant_backend(cuda, "Q4_K", torch.float16) == "triton"
    assert dequant_backend(cuda, "Q4_K", torch.float64) == "torch"
    assert dequant_backend(cpu, "Q4_K", torch.bfloat16) == "torch"
    set_dequant_backend("compile")
    try:
        assert dequant_backend(cuda, "Q8_0", torch.bfloat16) == "compile"
    finally:
        set_dequant_backend("auto")
    with pytest.raises(ValueError, match="unknown dequantisation backend 'cuda'; accepted: auto, triton"):
        set_dequant_backend("cuda")


def test_a_kernel_that_cannot_launch_turns_the_triton_path_off_with_a_warning(kernels, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("Python.h: No such file or directory")

    monkeypatch.setattr(kernels, "dequantize_triton", broken)
    monkeypatch.setattr(dequant, "_triton_failed", [])
    raw = random_blocks("Q8_0", 2, seed=1)
    with caplog.at_level(logging.WARNING, logger="engine.quant.dequant"):
        assert dequant._dequantize_triton(raw, "Q8_0", (64,), torch.bfloat16) is None
    assert "Triton dequantisation failed (RuntimeError: Python.h" in caplog.text
    assert dequant_backend(torch.device("cuda", 0), "Q8_0", torch.bfloat16) == "torch"
    set_dequant_backend("triton")  # asked for explicitly, the error is raised
    try:
        with pytest.raises(RuntimeError, match="Python.h"):
            dequant._dequantize_triton(raw, "Q8_0", (64,), torch.bfloat16)
    finally:
        set_dequant_backend("auto")

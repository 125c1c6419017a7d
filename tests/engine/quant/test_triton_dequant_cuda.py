"""The compiled Triton dequantisation kernels on a CUDA device (skipped without one, as in CI; the
interpreter tests in test_triton_dequant.py cover the same arithmetic there): bit-identical to the PyTorch
path on the same device for every quantised type and output dtype, chosen by default on CUDA, and captured
and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine.quant import dequant  # noqa: E402
from engine.quant.dequant import dequant_backend, dequantize, set_dequant_backend  # noqa: E402
from engine.quant.modules import QuantSpec, quantise_modules, raw_shape  # noqa: E402
from engine.quant.types import GGML_TYPES, QUANTIZED  # noqa: E402

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def random_bytes(qtype: str, n_blocks: int, seed: int, offset: int = 0) -> torch.Tensor:
    """Random bytes of `n_blocks` blocks on the GPU (every fp16 scale, infinities and NaNs included),
    starting `offset` bytes into their allocation."""
    generator = torch.Generator("cuda").manual_seed(seed)
    size = n_blocks * GGML_TYPES[qtype].type_size
    return torch.randint(0, 256, (size + offset,), dtype=torch.uint8, device="cuda",
                         generator=generator)[offset:]


def assert_same_values(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits, except that a NaN need only be a NaN where the reference has one."""
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan), "NaNs in other places"
    differ = (ours.view(BITS[ours.dtype]) != expected.view(BITS[ours.dtype])) & ~nan
    assert not differ.any(), f"{differ.sum().item()} of {ours.numel()} values differ in their bits"


def torch_path(raw: torch.Tensor, qtype: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    set_dequant_backend("torch")
    try:
        return dequantize(raw, qtype, shape, dtype)
    finally:
        set_dequant_backend("auto")


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", QUANTIZED)
def test_kernel_is_bit_exact_against_the_pytorch_path_on_the_gpu(qtype, dtype, offset):
    t = GGML_TYPES[qtype]
    n_blocks = 3 * 8192 // t.block_size + 5  # several programs and a partial one
    raw = random_bytes(qtype, n_blocks, seed=sum(map(ord, qtype)), offset=offset)
    shape = (n_blocks * t.block_size // 32, 32)
    assert dequant_backend(raw.device, qtype, dtype) == "triton"
    assert_same_values(dequantize(raw, qtype, shape, dtype), torch_path(raw, qtype, shape, dtype))
    assert not dequant._triton_failed


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_the_kernel_is_captured_in_a_cuda_graph_and_reads_the_bytes_as_they_are_at_replay(qtype):
    shape = (256, 512)
    raw = random_bytes(qtype, shape[0] * shape[1] // GGML_TYPES[qtype].block_size, seed=3)
    dequantize(raw, qtype, shape, torch.bfloat16)  # the first call compiles the kernel: never in a capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weight = dequantize(raw, qtype, shape, torch.bfloat16)
    raw.copy_(random_bytes(qtype, raw.numel() // GGML_TYPES[qtype].type_size, seed=4))
    graph.replay()
    torch.cuda.synchronize()
    assert_same_values(weight, torch_path(raw, qtype, shape, torch.bfloat16))


def test_a_quant_linear_computes_through_the_kernel_by_default(monkeypatch):
    from engine.quant import triton_dequant

    calls = []
    kernel = triton_dequant.dequantize_triton

    def spy(*args):
        calls.append(args[1])
        return kernel(*args)

    monkeypatch.setattr(triton_dequant, "dequantize_triton", spy)
    model = nn.Sequential(nn.Linear(512, 64, device="meta"))
    quantise_modules(model, {"0.weight": QuantSpec("Q4_K", (64, 512))})
    raw = random_bytes("Q4_K", 64 * 2, seed=5).reshape(raw_shape("Q4_K", (64, 512))).clone()
    raw[:, [1, 3]] &= 0xBF  # finite d and dmin below 2
    model.load_state_dict({"0.weight": raw, "0.bias": torch.randn(64, device="cuda")}, assign=True)
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x, torch_path(raw, "Q4_K", (64, 512), torch.bfloat16), model[0].bias.bfloat16())
    # exact, NaN for NaN: random scales overflow some bf16 products (found on the H200, session 17)
    torch.testing.assert_close(model[0](x), expected, rtol=0, atol=0, equal_nan=True)
    assert calls == ["Q4_K"]

"""FLUX's transformer and T5 over two device names (CPU stand-ins for two GPUs): a layer split gives exactly
the one-device output, a row split the same within float noise, and both keep each device's budget."""

import sys
from pathlib import Path

import pytest
import torch
from split_models import fake_gpu_runtime

from engine.memory.row_split import block_linears
from engine.models.flux import FluxTransformer
from engine.models.t5 import T5Encoder
from engine.models.weights import bind_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.engine.models.flux_checkpoints import flux_state, t5_state, tiny_flux_config, tiny_t5_config  # noqa: E402

TWO = ["cuda0", "cuda1"]


def flux_inputs() -> tuple:
    generator = torch.Generator().manual_seed(5)
    config = tiny_flux_config()
    return (torch.randn(1, 16, 8, 6, generator=generator), torch.tensor([0.6]),
            torch.randn(1, 10, config.context_in_dim, generator=generator),
            torch.randn(1, config.vec_in_dim, generator=generator), torch.tensor([3.5]))


def single_device(model_class, config, weights, *inputs) -> torch.Tensor:
    model = model_class(config, device="meta")
    bind_weights(model, dict(weights))
    with torch.no_grad():
        return model(*inputs)


def run(runtime, name, model, *inputs) -> torch.Tensor:
    with torch.no_grad():
        state = runtime.run(name, model, model.stages(), model.initial_state(*inputs))
    return state["h"] if "h" in state else state["hidden"]


@pytest.mark.parametrize("home", ["device", "cpu"])
def test_layer_split_flux_is_bit_identical_and_puts_blocks_on_both_devices(home):
    weights, inputs = flux_state(), flux_inputs()
    expected = single_device(FluxTransformer, tiny_flux_config(), weights, *inputs)
    runtime = fake_gpu_runtime(budgets_mib=(3, 3))
    model = FluxTransformer(tiny_flux_config(), device="meta")
    name = runtime.register("diffusion", model, home, "cuda0", weights.__getitem__, devices=TWO)
    for _ in range(2):
        assert torch.equal(run(runtime, name, model, *inputs), expected)
    module = runtime.snapshot()["modules"][name]
    assert module["split"] == "layer" and [part["device"] for part in module["parts"]] == TWO
    first, second = (part["stages"] for part in module["parts"])
    assert first[0][0] == "embed" and first[-1][-1] == "final" and second  # embed and final stay on the main
    runtime.unregister(name)


def test_row_split_flux_shards_every_block_linear_and_keeps_the_output():
    weights, inputs = flux_state(), flux_inputs()
    expected = single_device(FluxTransformer, tiny_flux_config(), weights, *inputs)
    runtime = fake_gpu_runtime(budgets_mib=(8, 8))
    model = FluxTransformer(tiny_flux_config(), device="meta")
    linears = block_linears(FluxTransformer(tiny_flux_config(), device="meta"))
    assert {n.split(".")[0] for n in linears} == {"double_blocks", "single_blocks"}
    assert any(n.endswith("img_attn.qkv") for n in linears) and any(n.endswith("linear2") for n in linears)
    name = runtime.register("diffusion", model, "device", "cuda0", weights.__getitem__, TWO, "row")
    torch.testing.assert_close(run(runtime, name, model, *inputs), expected, rtol=1e-5, atol=1e-5)
    module = runtime.snapshot()["modules"][name]
    assert module["split"] == "row" and module["parts"][1]["row_slices"] > 0
    runtime.unregister(name)


@pytest.mark.parametrize("mode", ["layer", "row"])
def test_t5_over_two_devices_matches_one(mode):
    weights = {k: v.float() for k, v in t5_state().items()}
    tokens = torch.tensor([[37, 1000, 423, 1, 0, 0]])
    expected = single_device(T5Encoder, tiny_t5_config(), weights, tokens)
    runtime = fake_gpu_runtime(budgets_mib=(8, 8))
    model = T5Encoder(tiny_t5_config(), device="meta")
    name = runtime.register("te", model, "device", "cuda0", weights.__getitem__, TWO, mode)
    assert runtime.snapshot()["modules"][name]["split"] == mode
    torch.testing.assert_close(run(runtime, name, model, tokens), expected, rtol=1e-5, atol=1e-5)
    runtime.unregister(name)

"""LoRAs on quantised weights (issue 17): applied at runtime, as stable-diffusion.cpp's at_runtime mode (each
call dequantises the weight, the LoRA adds its delta's product), bit-identical to the same runtime LoRA on the
dequantised float32 copy and close to merging it there; merging into quantised weights is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.memory.ledger import DeviceLedger
from engine.memory.runtime import MemoryRuntime
from engine.models.loader import clear_cache, load_diffusion_model
from engine.models.lora import parse_lora
from engine.models.lora_apply import apply_lora
from engine.quant.modules import QUANT_LAYERS, weight_shape
from tests.engine.models.sd_checkpoints import checkpoint_shapes, random_state_dict
from tests.engine.quant.gguf_models import write_quantised_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TARGETS = (
    "input_blocks.1.1.transformer_blocks.0.attn1.to_q",  # Linear (Q8_0, 64-wide rows)
    "middle_block.1.transformer_blocks.0.attn1.to_out.0",  # Linear with a bias
    "input_blocks.1.1.proj_in",  # 1x1 convolution
    "input_blocks.1.0.in_layers.2",  # 3x3 convolution stored in 256-element rows: LoCon
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    unet = {k.removeprefix("model.diffusion_model."): v for k, v in
            random_state_dict(checkpoint_shapes("sd1", "tiny", ["diffusion"]), seed=8).items()}
    copy = write_quantised_gguf(folder / "unet.gguf", unet, "Q8_0", "sd1")
    save_file(copy, folder / "copy.safetensors")
    clear_cache()
    runtime = MemoryRuntime(ledgers={"cpu": DeviceLedger("cpu", 10**9)})
    quantised = load_diffusion_model(folder / "unet.gguf", runtime=runtime)
    reference = load_diffusion_model(folder / "copy.safetensors", runtime=runtime)
    yield quantised, reference
    clear_cache()


def lora_file(model) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    tensors = {}
    for name in TARGETS:
        shape = weight_shape(model.unet.get_submodule(name))
        key = "lora_unet_" + name.replace(".", "_")
        tensors[f"{key}.lora_down.weight"] = torch.randn(4, *shape[1:], generator=generator) * 0.2
        tensors[f"{key}.lora_up.weight"] = torch.randn(shape[0], 4, *(1,) * (len(shape) - 2),
                                                       generator=generator) * 0.2
        tensors[f"{key}.alpha"] = torch.tensor(2.0)
    ff, ff_name = "lora_unet_output_blocks_0_1_transformer_blocks_0_ff_net_2", \
        "output_blocks.0.1.transformer_blocks.0.ff.net.2"
    out_features, in_features = weight_shape(model.unet.get_submodule(ff_name))  # a LoHa: its whole delta
    tensors[f"{ff}.hada_w1_a"] = torch.randn(out_features, 2, generator=generator) * 0.3
    tensors[f"{ff}.hada_w1_b"] = torch.randn(2, in_features, generator=generator) * 0.3
    tensors[f"{ff}.hada_w2_a"] = torch.randn(out_features, 2, generator=generator) * 0.3
    tensors[f"{ff}.hada_w2_b"] = torch.randn(2, in_features, generator=generator) * 0.3
    tensors[f"{ff}.alpha"] = torch.tensor(2.0)
    return tensors


def unet_output(model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x, context = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 5, 64, generator=generator)
    return model.apply(x, torch.tensor([999.0, 300.0]), context)


def test_a_lora_on_quantised_weights_runs_at_runtime_like_on_their_dequantised_copy(models):
    quantised, reference = models
    assert all(isinstance(quantised.unet.get_submodule(name), QUANT_LAYERS) for name in TARGETS)
    lora = parse_lora(lora_file(quantised))
    applied = apply_lora(quantised, None, lora, 0.7)
    assert applied.modes == {"unet": "runtime"} and applied.match.unmatched == {}
    on_copy = apply_lora(reference, None, lora, 0.7, mode="runtime")
    got = unet_output(applied.model)
    assert torch.equal(got, unet_output(on_copy.model))
    merged = apply_lora(reference, None, lora, 0.7, mode="merge")
    torch.testing.assert_close(got, unet_output(merged.model), rtol=1e-5, atol=1e-5)  # float32 sums reordered
    assert not torch.equal(got, unet_output(quantised))  # the LoRA did something
    assert torch.equal(unet_output(quantised), unet_output(reference))  # and the base stayed as it was


def test_merging_into_quantised_weights_is_refused_naming_the_type(models):
    quantised, _ = models
    lora = parse_lora(lora_file(quantised))
    with pytest.raises(ValueError, match=r"cannot merge a LoRA into this model: .* is quantised \(Q8_0\): "
                                         r"quantised weights take LoRAs at runtime only; use mode 'runtime'"):
        apply_lora(quantised, None, lora, mode="merge")

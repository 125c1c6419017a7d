"""The GGUF layouts users have (engine/models/gguf_layout.py): stable-diffusion.cpp's files (no architecture,
the checkpoint's own names with `model.diffusion_model.`, an SDXL UNet's 4-D linear projections), llama.cpp's
T5 names, and architectures Sluice does not run refused by name."""

from __future__ import annotations

import pytest
import torch

from engine.memory.ledger import DeviceLedger
from engine.memory.runtime import MemoryRuntime
from engine.models.detect import detect
from engine.models.formats import CheckpointError, open_checkpoint
from engine.models.gguf_layout import t5_name
from engine.models.loader import clear_cache, load_diffusion_model
from engine.quant.modules import QUANT_LAYERS
from tests.engine.models.sd_checkpoints import checkpoint_shapes, random_state_dict
from tests.engine.quant.gguf_models import count_types, write_quantised_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PREFIX = "model.diffusion_model."


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def unet_state(family: str) -> dict[str, torch.Tensor]:
    shapes = checkpoint_shapes(family, "tiny", ["diffusion"])
    return {PREFIX + k.removeprefix(PREFIX): v for k, v in random_state_dict(shapes, seed=6).items()}


def step(model, context_dim: int, adm: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    context = torch.randn(1, 7, context_dim, generator=generator)
    y = None if adm is None else torch.randn(1, adm, generator=generator)
    return model.apply(x, torch.tensor([400.0]), context, y)


def same_outputs(quantised_path, copy, tmp_path, context_dim, adm=None) -> None:
    from safetensors.torch import save_file

    save_file(copy, tmp_path / "copy.safetensors")
    runtime = MemoryRuntime(ledgers={"cpu": DeviceLedger("cpu", 10**9)})
    model = load_diffusion_model(quantised_path, runtime=runtime)
    reference = load_diffusion_model(tmp_path / "copy.safetensors", runtime=runtime)
    assert sum(isinstance(m, QUANT_LAYERS) for m in model.unet.modules()) > 5
    assert torch.equal(step(model, context_dim, adm), step(reference, context_dim, adm))


def test_a_stable_diffusion_cpp_file_without_architecture_loads_with_its_prefixed_names(tmp_path):
    path = tmp_path / "sd1-Q8_0.gguf"
    copy = write_quantised_gguf(path, unet_state("sd1"), "Q8_0", None)
    with open_checkpoint(path) as reader:
        assert "general.architecture" not in reader.metadata()
        info = detect(reader)
    assert info.components == {"diffusion": PREFIX} and info.unet.use_linear_in_transformer is False
    same_outputs(path, copy, tmp_path, 64)


def test_a_stable_diffusion_cpp_sdxl_unet_has_its_linear_projections_squeezed(tmp_path):
    state = unet_state("sdxl")
    stored = {k: v[..., None, None] if k.endswith((".proj_in.weight", ".proj_out.weight")) else v
              for k, v in state.items()}  # (out, in, 1, 1), as stable-diffusion.cpp writes them
    path = tmp_path / "sdxl-Q8_0.gguf"
    copy = write_quantised_gguf(path, stored, "Q8_0", None)
    copy = {k: v.reshape(state[k].shape) for k, v in copy.items()}
    with open_checkpoint(path) as reader:
        key = next(k for k in reader.keys() if k.endswith(".proj_in.weight"))
        assert len(reader.shape(key)) == 2
        info = detect(reader)
    assert info.unet.use_linear_in_transformer and info.unet.adm_in_channels is not None
    same_outputs(path, copy, tmp_path, info.unet.context_dim, info.unet.adm_in_channels)


def test_architectures_sluice_does_not_run_are_refused_by_name(tmp_path):
    path = tmp_path / "wan.gguf"
    write_quantised_gguf(path, {"blocks.0.weight": torch.randn(64, 64)}, "Q8_0", "wan")
    assert count_types(path) == {"Q8_0": 1}
    with pytest.raises(CheckpointError, match=r"architecture 'wan' is not a model Sluice runs; "
                                              r"accepted: flux, sd1, sdxl, t5, t5encoder, clip"):
        open_checkpoint(path)


def test_llama_cpp_t5_names_read_as_transformers_t5_keys():
    assert t5_name("enc.blk.3.attn_q.weight") == "encoder.block.3.layer.0.SelfAttention.q.weight"
    assert t5_name("enc.blk.0.attn_rel_b.weight") == (
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    assert t5_name("enc.blk.1.ffn_gate.weight") == "encoder.block.1.layer.1.DenseReluDense.wi_0.weight"
    assert t5_name("enc.blk.1.ffn_up.weight") == "encoder.block.1.layer.1.DenseReluDense.wi_1.weight"
    assert t5_name("enc.blk.1.ffn_down.weight") == "encoder.block.1.layer.1.DenseReluDense.wo.weight"
    assert t5_name("enc.blk.1.ffn_norm.weight") == "encoder.block.1.layer.1.layer_norm.weight"
    assert t5_name("enc.output_norm.weight") == "encoder.final_layer_norm.weight"
    assert t5_name("token_embd.weight") == "shared.weight"

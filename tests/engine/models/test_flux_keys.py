"""engine.models.flux_keys: recognising a diffusers FLUX file, its BFL shapes, and reading it lazily.

That the mapping is right (which tensors, in which order, the swapped final adaLN halves) is checked by
the parity tests in test_flux_parity.py; these check the interface around it.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel

from engine.models.flux import FluxTransformer, flux_schnell_config
from engine.models.flux_keys import (
    BFL_PREFIX,
    diffusers_flux_getter,
    diffusers_flux_shapes,
    is_diffusers_flux,
    strip_prefix,
)


@pytest.fixture(scope="module")
def diffusers_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                   pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    return model.state_dict()


def test_recognises_diffusers_layout_only(diffusers_state):
    bfl_keys = FluxTransformer(flux_schnell_config(), device="meta").state_dict().keys()
    assert is_diffusers_flux(diffusers_state)
    assert not is_diffusers_flux(bfl_keys)
    assert not is_diffusers_flux({"encoder.block.0.layer.0.SelfAttention.q.weight"})


def test_strip_prefix_keeps_the_diffusion_model_of_a_full_checkpoint():
    full = {BFL_PREFIX + "img_in.weight": 1, BFL_PREFIX + "txt_in.weight": 2, "vae.decoder.conv_in.weight": 3}
    assert strip_prefix(full) == {"img_in.weight": 1, "txt_in.weight": 2}
    bare = {"img_in.weight": 1, "txt_in.weight": 2}
    assert strip_prefix(bare) == bare


def test_getter_reads_only_the_tensors_of_the_asked_name(diffusers_state):
    read_keys = []

    def get(key: str) -> torch.Tensor:
        read_keys.append(key)
        return diffusers_state[key]

    read = diffusers_flux_getter(get, diffusers_state.keys())
    assert read_keys == []
    linear1 = read("single_blocks.0.linear1.weight")
    prefix = "single_transformer_blocks.0."
    sources = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "proj_mlp.weight")
    assert read_keys == [prefix + name for name in sources]
    assert torch.equal(linear1, torch.cat([diffusers_state[key] for key in read_keys]))


def test_shapes_match_the_tensors_the_getter_makes(diffusers_state):
    shapes = diffusers_flux_shapes({key: tuple(t.shape) for key, t in diffusers_state.items()})
    read = diffusers_flux_getter(diffusers_state.__getitem__, diffusers_state)
    assert {name: tuple(read(name).shape) for name in shapes} == shapes
    assert shapes["double_blocks.0.img_attn.qkv.weight"] == (96, 32)
    assert shapes["final_layer.adaLN_modulation.1.bias"] == (64,)


def test_missing_diffusers_tensor_is_named(diffusers_state):
    shapes = {key: tuple(t.shape) for key, t in diffusers_state.items()}
    del shapes["transformer_blocks.0.attn.add_k_proj.weight"]
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.attn\.add_k_proj\.weight to make "
                                         r"double_blocks\.0\.txt_attn\.qkv\.weight"):
        diffusers_flux_shapes(shapes)


def test_unknown_name_is_a_key_error(diffusers_state):
    read = diffusers_flux_getter(diffusers_state.__getitem__, diffusers_state)
    with pytest.raises(KeyError, match="double_blocks.5.img_mod.lin.weight"):
        read("double_blocks.5.img_mod.lin.weight")

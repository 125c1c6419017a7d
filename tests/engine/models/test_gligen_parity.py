"""engine.models.gligen inside our UNet against diffusers' UNet2DConditionModel with attention_type="gated"
(GLIGEN's GatedSelfAttentionDense fusers and GLIGENTextBoundingboxProjection position net) on a tiny random
SD1-like UNet in float32. The GLIGEN file is written in the original layout (fusers under the LDM block names,
`position_net.*`) from the diffusers modules' weights; the boxes follow ComfyUI's Gligen.set_position,
written down here by hand.
"""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
from safetensors.torch import save_file

from engine.models.gligen import MAX_OBJECTS, GLIGENPosition, fourier_embedding, gligen_names, load_gligen
from engine.models.unet import SpatialTransformer, UNetModel
from tests.engine.models.test_unet_parity import (
    SMALL_CASES,
    diffusers_config,
    init_random_,
    prefixed_state_dict,
    relative_l2,
)

PARITY_TOLERANCE = 1e-5  # relative L2 error in float32
HEADS = 2  # the sd1_like case's heads per transformer, which the fusers share


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    config, ldm_params = SMALL_CASES["sd1_like"]
    ours = UNetModel(config, device="cpu").eval()
    init_random_(ours, seed=11)
    reference_config = diffusers_config(ldm_params)
    reference = UNet2DConditionModel(**reference_config, attention_type="gated").eval()
    converted = convert_ldm_unet_checkpoint(prefixed_state_dict(ours), reference_config)
    missing, unexpected = reference.load_state_dict(converted, strict=False)
    assert not unexpected and all(".fuser." in key or key.startswith("position_net.") for key in missing)
    gligen_parts = [module for name, module in reference.named_modules()
                    if name.endswith(".fuser") or name == "position_net"]
    for index, module in enumerate(gligen_parts):
        init_random_(module, seed=100 + index)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith(("alpha_attn", "alpha_dense")):
                parameter.fill_(0.9 if name.endswith("alpha_attn") else -0.7)  # tanh gates well away from 0
    path = tmp_path_factory.mktemp("gligen") / "gligen_tiny.safetensors"
    save_file(ldm_gligen_state(ours, reference), str(path), metadata={"sluice.num_heads": str(HEADS)})
    return ours, reference, path


def ldm_gligen_state(ours: UNetModel, reference: UNet2DConditionModel) -> dict[str, torch.Tensor]:
    """The diffusers fusers under the LDM names of the transformers they sit in (both in execution order),
    plus the position net, as the original GLIGEN files store them."""
    ldm_transformers = [name for name, module in ours.named_modules()
                        if isinstance(module, SpatialTransformer)]
    order = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}

    def place(key: str) -> tuple:
        kind = key.split(".")[0]
        numbers = [int(n) for n in re.findall(r"\.(\d+)\.", key.split(".transformer_blocks.")[0] + ".")]
        return (order[kind], *numbers)

    state = reference.state_dict()
    fusers = sorted({key.split(".fuser.")[0] for key in state if ".fuser." in key}, key=place)
    assert len(fusers) == len(ldm_transformers) == 11  # 4 down, 1 middle, 6 up
    out = {}
    for diffusers_name, ldm_name in zip(fusers, ldm_transformers, strict=True):
        for key, value in state.items():
            if key.startswith(diffusers_name + ".fuser."):
                rest = key.split(".fuser.", 1)[1]
                ldm_key = f"model.diffusion_model.{ldm_name}.transformer_blocks.0.fuser.{rest}"
                out[ldm_key] = value.contiguous()
    out |= {key: value.contiguous() for key, value in state.items() if key.startswith("position_net.")}
    return out


def comfy_boxes(boxes: list, batch: int, height: int, width: int, key_dim: int):
    """ComfyUI's Gligen.set_position: xyxy fractions of the latent, zero-padded to 30, with a 0/1 mask."""
    masks = torch.zeros([MAX_OBJECTS])
    xyxy, texts = [], []
    for p in boxes:
        x1, y1 = p[4] / width, p[3] / height
        x2, y2 = (p[4] + p[2]) / width, (p[3] + p[1]) / height
        masks[len(xyxy)] = 1.0
        xyxy.append(torch.tensor((x1, y1, x2, y2)).unsqueeze(0))
        texts.append(p[0])
    xyxy.append(torch.zeros([MAX_OBJECTS - len(boxes), 4]))
    texts.append(torch.zeros([MAX_OBJECTS - len(boxes), key_dim]))
    return {"boxes": torch.cat(xyxy).unsqueeze(0).repeat(batch, 1, 1),
            "masks": masks.unsqueeze(0).repeat(batch, 1),
            "positive_embeddings": torch.cat(texts).unsqueeze(0).repeat(batch, 1, 1)}


@pytest.mark.parametrize("size", [(16, 16), (12, 20)])
def test_unet_with_gligen_boxes_matches_diffusers_gated_attention(models, size):
    ours, reference, path = models
    gligen = load_gligen(path)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, *size, generator=generator)
    timesteps = torch.tensor([17.0, 803.0])
    context = torch.randn(2, 7, 32, generator=generator)
    boxes = [(torch.randn(1, 32, generator=generator), 4, 6, 2, 3),
             (torch.randn(1, 32, generator=generator), 8, 4, 0, 9)]
    patch = GLIGENPosition(gligen, boxes).middle_patch(x)
    with torch.no_grad():
        got = ours(x, timesteps, context, middle_patch=patch)
        plain = ours(x, timesteps, context)
        expected = reference(x, timesteps, encoder_hidden_states=context, cross_attention_kwargs={
            "gligen": comfy_boxes(boxes, 2, *size, 32)}).sample
    assert relative_l2(plain, expected) > 1e-2  # the boxes change the prediction
    assert relative_l2(got, expected) <= PARITY_TOLERANCE


def test_fourier_embedding_matches_diffusers():
    from diffusers.models.embeddings import get_fourier_embeds_from_boundingbox

    boxes = torch.rand(2, 5, 4, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fourier_embedding(boxes), get_fourier_embeds_from_boundingbox(8, boxes))


def test_fusers_are_numbered_in_the_unets_transformer_order():
    keys = [f"{block}.fuser.linear.weight" for block in (
        "output_blocks.10.1.transformer_blocks.0", "input_blocks.2.1.transformer_blocks.0",
        "middle_block.1.transformer_blocks.0", "input_blocks.11.1.transformer_blocks.0",
        "output_blocks.3.1.transformer_blocks.0")] + ["position_net.null_positive_feature"]
    names = gligen_names(keys)
    assert [names[f"fusers.{i}.linear.weight"].split(".fuser")[0] for i in range(5)] == [
        "input_blocks.2.1.transformer_blocks.0", "input_blocks.11.1.transformer_blocks.0",
        "middle_block.1.transformer_blocks.0", "output_blocks.3.1.transformer_blocks.0",
        "output_blocks.10.1.transformer_blocks.0"]
    with pytest.raises(ValueError, match="not a GLIGEN file"):
        gligen_names(["model.diffusion_model.out.2.weight"])

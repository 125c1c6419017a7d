"""engine.models.clip_vision against transformers' CLIPVisionModelWithProjection on tiny random configs in
float32, in both key layouts a file may use (transformers', and open_clip's with stacked q/k/v and a
transposed projection, written here from the transformers weights by hand), and ComfyUI's clip_preprocess as
written down from comfy/clip_vision.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import CLIPVisionModelWithProjection

from engine.models.clip_vision import (
    CLIP_MEAN,
    CLIP_STD,
    CLIPVisionModel,
    clip_preprocess,
    config_from_shapes,
    find_layout,
    vit_g_config,
    vit_h_config,
    vit_l_config,
)
from engine.models.clip_vision_loader import file_names, load_clip_vision
from engine.models.formats import open_checkpoint
from engine.models.weights import bind_weights
from tests.engine.models.clip_vision_checkpoints import (
    HEADS,
    IMAGE,
    hf_state,
    open_clip_state,
    ours_config,
    reference,
)

TOLERANCE = 1e-5  # largest absolute difference in float32 (outputs are O(1))


def pixels(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed))


def expected_outputs(model: CLIPVisionModelWithProjection, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = model(pixel_values=x, output_hidden_states=True)
    # hidden_states[0] is the embeddings (after pre_layrnorm), [i] the output of layer i
    return out.image_embeds, out.last_hidden_state, out.hidden_states[-2]


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("activation", ["quick_gelu", "gelu"])
def test_vision_tower_matches_transformers(activation: str) -> None:
    hf = reference(activation)
    model = CLIPVisionModel(ours_config(activation))
    bind_weights(model, hf_state(hf))
    x = pixels()
    out = model(x)
    embeds, last, penultimate = expected_outputs(hf, x)
    assert_close(out.image_embeds, embeds)
    assert_close(out.last_hidden_state, last)
    assert_close(out.penultimate_hidden_states, penultimate)


@pytest.mark.parametrize("layout", ["hf", "open_clip"])
def test_files_in_either_layout_load_to_the_same_tower(tmp_path, layout: str) -> None:
    hf = reference("gelu", seed=3)
    if layout == "hf":
        tensors = {"vision_model.embeddings.position_ids": torch.arange(17)[None], **hf_state(hf)}
        prefix = ""
    else:
        prefix = "embedder.model.visual."  # the SD2.1 unCLIP checkpoints' image embedder
        tensors = {**open_clip_state(hf, prefix), "model.diffusion_model.out.2.bias": torch.zeros(4)}
    path = tmp_path / "vision.safetensors"
    save_file(tensors, str(path), metadata={"sluice.num_heads": str(HEADS), "sluice.activation": "gelu"})
    with open_checkpoint(path) as reader:
        assert find_layout(reader.keys()) == (layout, prefix)
    vision = load_clip_vision(path)
    assert vision.model.config == ours_config("gelu")
    x = pixels(seed=4)
    out = vision.model(x)
    embeds, last, penultimate = expected_outputs(hf, x)
    assert_close(out.image_embeds, embeds)
    assert_close(out.last_hidden_state, last)
    assert_close(out.penultimate_hidden_states, penultimate)


def test_canonical_configs_follow_comfyui_by_width() -> None:
    for factory, width, layers, activation in ((vit_l_config, 1024, 24, "quick_gelu"),
                                               (vit_h_config, 1280, 32, "gelu"),
                                               (vit_g_config, 1664, 48, "gelu")):
        expected = factory()
        model = CLIPVisionModel(expected, device="meta")
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        assert config_from_shapes(shapes) == expected
        assert (expected.width, expected.layers, expected.activation, expected.heads) == (
            width, layers, activation, 16)
        assert expected.positions == 257


def test_a_file_without_a_vision_tower_is_refused_with_what_is_accepted(tmp_path) -> None:
    path = tmp_path / "not_vision.safetensors"
    save_file({"model.diffusion_model.out.2.bias": torch.zeros(4)}, str(path))
    with open_checkpoint(path) as reader, pytest.raises(ValueError, match="ViT-H/14"):
        file_names(reader)


def comfy_clip_preprocess(image: torch.Tensor, size: int, crop: bool) -> torch.Tensor:
    """ComfyUI's comfy/clip_vision.py clip_preprocess, written down step by step."""
    x = image[:, :, :, :3].movedim(-1, 1)
    if not (x.shape[2] == size and x.shape[3] == size):
        if crop:
            scale = size / min(x.shape[2], x.shape[3])
            target = (round(scale * x.shape[2]), round(scale * x.shape[3]))
        else:
            target = (size, size)
        x = torch.nn.functional.interpolate(x, size=target, mode="bicubic", antialias=True)
        h, w = (x.shape[2] - size) // 2, (x.shape[3] - size) // 2
        x = x[:, :, h:h + size, w:w + size]
    x = torch.clip(255.0 * x, 0, 255).round() / 255.0
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
    return (x - mean) / std


@pytest.mark.parametrize("crop", [True, False])
@pytest.mark.parametrize("shape", [(1, 40, 60, 3), (2, 57, 31, 4), (1, 28, 28, 3)])
def test_preprocess_is_comfyuis(shape: tuple[int, ...], crop: bool) -> None:
    image = torch.rand(*shape, generator=torch.Generator().manual_seed(5))
    got = clip_preprocess(image, IMAGE, crop)
    assert got.shape == (shape[0], 3, IMAGE, IMAGE)
    assert torch.equal(got, comfy_clip_preprocess(image, IMAGE, crop))
    assert CLIP_MEAN == (0.48145466, 0.4578275, 0.40821073)
    assert CLIP_STD == (0.26862954, 0.26130258, 0.27577711)


def test_centre_crop_keeps_the_middle_and_none_squashes() -> None:
    image = torch.zeros(1, IMAGE, 3 * IMAGE, 3)
    image[:, :, IMAGE:2 * IMAGE] = 1.0  # a white middle third
    centred = clip_preprocess(image, IMAGE, crop=True)
    white = (1.0 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    assert torch.allclose(centred[0, :, :, 2:-2], white.view(3, 1, 1).expand(3, IMAGE, IMAGE - 4), atol=1e-5)
    squashed = clip_preprocess(image, IMAGE, crop=False)
    assert squashed[0, :, :, 0].max() < 0  # the black left third stays in view

"""CLIP text encoder parity with transformers' CLIPTextModel / CLIPTextModelWithProjection.

Random weights at a reduced size in float32; tolerance: relative L2 error <= 1e-5 for every layer's
output, the final hidden state, the pooled output and the projected text embedding. The open_clip
layout is compared after converting its state dict with diffusers' own single-file converter
(`convert_open_clip_checkpoint`, which splits the fused in_proj into q, k, v).
Full-size models are only built on the meta device (parameter counts and key sets).
"""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint, convert_open_clip_checkpoint
from transformers import CLIPTextConfig
from transformers import CLIPTextModel as HFCLIPTextModel
from transformers import CLIPTextModelWithProjection as HFCLIPTextModelWithProjection

from engine.models.clip import (
    CLIPTextModel,
    clip_l_config,
    component_prefix,
    openclip_bigg_config,
    openclip_h_config,
    text_encoder_weights,
)
from engine.models.detect import TextEncoderConfig, detect
from engine.models.staged import run_stages
from engine.models.weights import bind_weights

TOLERANCE = 1e-5
BOS, EOS = 49406, 49407
SDXL_G_PREFIX = "conditioner.embedders.1.model."


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def small_config(kind: str, activation: str, projection_dim: int | None,
                 layout: str = "hf") -> TextEncoderConfig:
    return TextEncoderConfig(kind=kind, vocab_size=49408, max_positions=77, width=64, layers=3, heads=4,
                             intermediate=256, projection_dim=projection_dim, activation=activation,
                             key_prefix="", layout=layout)


def hf_config(config: TextEncoderConfig) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=config.vocab_size, hidden_size=config.width,
                          intermediate_size=config.intermediate, num_hidden_layers=config.layers,
                          num_attention_heads=config.heads, max_position_embeddings=config.max_positions,
                          hidden_act=config.activation, projection_dim=config.projection_dim or config.width,
                          bos_token_id=BOS, eos_token_id=EOS)


def randomize(state_dict: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Random tensors of the same shapes; LayerNorm scales around 1 so every layer stays well conditioned."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, value in state_dict.items():
        noise = torch.randn(value.shape, generator=generator) * 0.1
        is_norm_scale = key.endswith("weight") and value.ndim == 1
        out[key] = noise + 1.0 if is_norm_scale else noise
    return out


def prompt_tokens() -> torch.Tensor:
    """Two prompts [2, 77]: CLIP-L padding (EOS repeated) and OpenCLIP padding (zeros)."""
    generator = torch.Generator().manual_seed(7)
    words = torch.randint(1, 49000, (2, 20), generator=generator)
    first = [BOS, *words[0, :12].tolist(), EOS] + [EOS] * 63
    second = [BOS, *words[1].tolist(), EOS] + [0] * 55
    return torch.tensor([first, second])


def stage_outputs(model: CLIPTextModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream after the embeddings and after each layer, read between stages."""
    state = model.initial_state(tokens, clip_skip=1, return_pooled=True)
    outputs = []

    def record(index: int, stage) -> None:
        if stage.name != "final":
            outputs.append(state["x"].clone())

    run_stages(model.stages(), state, after=record)
    return outputs


@pytest.fixture(scope="module")
def hf_layout_pair():
    config = small_config("clip_l", "quick_gelu", projection_dim=32)
    reference = HFCLIPTextModelWithProjection(hf_config(config)).eval()
    weights = randomize(reference.state_dict(), seed=0)
    reference.load_state_dict(weights)
    ours = CLIPTextModel(config)  # built on meta, then bound
    ours.load_state_dict(weights, strict=True, assign=True)
    return ours, reference


@pytest.fixture(scope="module")
def open_clip_layout_pair():
    config = small_config("openclip_g", "gelu", projection_dim=48, layout="open_clip")
    ours = CLIPTextModel(config)
    weights = randomize(ours.state_dict(), seed=1)
    ours.load_state_dict(weights, strict=True, assign=True)
    reference = HFCLIPTextModelWithProjection(hf_config(config)).eval()
    checkpoint = {SDXL_G_PREFIX + key: value for key, value in weights.items()}
    converted = convert_open_clip_checkpoint(reference, checkpoint, prefix=SDXL_G_PREFIX)
    reference.load_state_dict(converted, strict=True)
    return ours, reference


@pytest.mark.parametrize("pair", ["hf_layout_pair", "open_clip_layout_pair"])
def test_every_stage_matches_transformers_hidden_states(pair, request):
    ours, reference = request.getfixturevalue(pair)
    tokens = prompt_tokens()
    with torch.no_grad():
        expected = reference(tokens, output_hidden_states=True).hidden_states  # embeddings + each layer
        outputs = stage_outputs(ours, tokens)
    assert len(outputs) == len(expected) == ours.config.layers + 1
    errors = [relative_error(o, e) for o, e in zip(outputs, expected, strict=True)]
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize("pair", ["hf_layout_pair", "open_clip_layout_pair"])
def test_last_hidden_state_and_projected_pooled_match_transformers(pair, request):
    ours, reference = request.getfixturevalue(pair)
    tokens = prompt_tokens()
    with torch.no_grad():
        expected = reference(tokens)
        hidden, pooled = ours(tokens, clip_skip=1, return_pooled=True, norm_hidden=True)
    assert relative_error(hidden, expected.last_hidden_state) <= TOLERANCE
    assert pooled.shape == expected.text_embeds.shape
    assert relative_error(pooled, expected.text_embeds) <= TOLERANCE


@pytest.mark.parametrize("clip_skip", [1, 2, 3])
def test_clip_skip_without_norm_returns_that_layers_residual_stream(hf_layout_pair, clip_skip):
    ours, reference = hf_layout_pair
    tokens = prompt_tokens()
    with torch.no_grad():
        expected = reference(tokens, output_hidden_states=True).hidden_states[-clip_skip]
        hidden, pooled = ours(tokens, clip_skip=clip_skip, norm_hidden=False)
    assert pooled is None
    assert relative_error(hidden, expected) <= TOLERANCE


def test_unprojected_pooled_output_matches_transformers_pooler_output():
    config = small_config("clip_l", "quick_gelu", projection_dim=None)
    reference = HFCLIPTextModel(hf_config(config)).eval()
    weights = randomize(reference.state_dict(), seed=2)
    reference.load_state_dict(weights)
    ours = CLIPTextModel(config)
    ours.load_state_dict({"text_model." + key: value for key, value in weights.items()}, assign=True)
    tokens = prompt_tokens()
    with torch.no_grad():
        expected = reference(tokens).pooler_output
        _, pooled = ours(tokens, return_pooled=True)
    assert relative_error(pooled, expected) <= TOLERANCE


def test_stage_names_follow_the_checkpoint_layout():
    config = small_config("clip_l", "quick_gelu", projection_dim=None)
    hf_names = [stage.name for stage in CLIPTextModel(config, "hf").stages()]
    open_clip_names = [stage.name for stage in CLIPTextModel(config, "open_clip").stages()]
    assert hf_names == ["embeddings", "layers.0", "layers.1", "layers.2", "final"]
    assert open_clip_names == ["embeddings", "resblocks.0", "resblocks.1", "resblocks.2", "final"]


@pytest.mark.parametrize("layout", ["hf", "open_clip"])
def test_stages_own_every_parameter_exactly_once(layout):
    model = CLIPTextModel(small_config("openclip_g", "gelu", projection_dim=16), layout)
    owned = [id(p) for stage in model.stages() for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())


def test_full_size_clip_l_matches_transformers_parameter_count_and_sd1_keys():
    ours = CLIPTextModel(clip_l_config(), layout="hf")
    with torch.device("meta"):
        reference = HFCLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072,
                                                   num_hidden_layers=12, num_attention_heads=12))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == 123_060_480
    checkpoint = {"cond_stage_model.transformer." + key: value for key, value in ours.state_dict().items()}
    converted = convert_ldm_clip_checkpoint(checkpoint)
    assert set(converted) == {"text_model." + key for key in reference.state_dict()}


def bigg_reference_on_meta() -> HFCLIPTextModelWithProjection:
    with torch.device("meta"):
        return HFCLIPTextModelWithProjection(CLIPTextConfig(
            hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
            projection_dim=1280, hidden_act="gelu"))


def test_full_size_bigg_matches_transformers_parameter_count_and_sdxl_keys():
    ours = CLIPTextModel(openclip_bigg_config(), layout="open_clip")
    reference = bigg_reference_on_meta()
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())
    checkpoint = {SDXL_G_PREFIX + key: value for key, value in ours.state_dict().items()}
    converted = convert_open_clip_checkpoint(reference, checkpoint, prefix=SDXL_G_PREFIX)
    assert set(converted) == set(reference.state_dict())
    assert all(converted[key].shape == value.shape for key, value in reference.state_dict().items())


def test_full_size_openclip_h_keys_convert_like_an_sd2_checkpoint():
    """diffusers drops the last resblock and the projection of SD2 (it reads the penultimate layer)."""
    ours = CLIPTextModel(openclip_h_config(), layout="open_clip")
    with torch.device("meta"):
        reference = HFCLIPTextModelWithProjection(CLIPTextConfig(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
            projection_dim=1024, hidden_act="gelu"))
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())
    prefix = "cond_stage_model.model."
    checkpoint = {prefix + key: value for key, value in ours.state_dict().items()}
    converted = convert_open_clip_checkpoint(reference, checkpoint, prefix=prefix)
    dropped = {key for key in reference.state_dict()
               if ".layers.23." in key or key == "text_projection.weight"}
    assert set(converted) == set(reference.state_dict()) - dropped


def test_detect_reads_the_presets_back_from_the_model_parameter_names():
    sdxl_l = clip_l_config("conditioner.embedders.0.transformer.text_model.")
    for presets in ([clip_l_config()], [openclip_h_config()], [sdxl_l, openclip_bigg_config()]):
        checkpoint = {}
        for config in presets:
            model = CLIPTextModel(config)
            checkpoint.update({component_prefix(config) + key: value
                               for key, value in model.state_dict().items()})
        assert detect(checkpoint).text_encoders == presets


@pytest.mark.parametrize("config, unused_key", [
    (clip_l_config(), "cond_stage_model.transformer.text_model.embeddings.position_ids"),
    (openclip_bigg_config(), SDXL_G_PREFIX + "logit_scale"),
])
def test_checkpoint_weights_bind_after_prefix_and_unused_keys_are_dropped(config, unused_key):
    checkpoint = {component_prefix(config) + key: value
                  for key, value in CLIPTextModel(config).state_dict().items()}
    checkpoint[unused_key] = torch.zeros((), device="meta")
    checkpoint["first_stage_model.decoder.conv_in.weight"] = torch.zeros(1, device="meta")
    bind_weights(CLIPTextModel(config), text_encoder_weights(checkpoint, config))
    with pytest.raises(KeyError, match="no openclip_h text encoder tensors under prefix 'cond_stage_model"):
        text_encoder_weights(checkpoint, openclip_h_config())


def test_bad_arguments_raise_errors_naming_the_accepted_values():
    config = small_config("clip_l", "quick_gelu", projection_dim=None)
    with pytest.raises(ValueError, match="accepted: hf, open_clip"):
        CLIPTextModel(config, layout="openclip")
    model = CLIPTextModel(config, "hf")
    with pytest.raises(ValueError, match="accepted: 1 .* to 3"):
        model.initial_state(prompt_tokens(), clip_skip=4)
    with pytest.raises(ValueError, match="tokens must be"):
        model.initial_state(torch.zeros(1, 78, dtype=torch.long))

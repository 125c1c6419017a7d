"""Family text conditioning (SD1, SD2, SDXL) against transformers' CLIP run with ComfyUI's conventions.

References: transformers CLIPTextModel / CLIPTextModelWithProjection on the same random weights
(reduced size, float32; the open_clip layout converted with diffusers' single-file converter),
diffusers' `Timesteps` for SDXL's size embedding, and ComfyUI's weighting formula written out here.
Tolerance: relative L2 error <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
from diffusers.models.embeddings import Timesteps
from transformers import CLIPTextConfig
from transformers import CLIPTextModel as HFCLIPTextModel
from transformers import CLIPTextModelWithProjection as HFCLIPTextModelWithProjection

from engine.models.clip import CLIPTextModel, clip_l_config, openclip_bigg_config
from engine.models.conditioning import (
    SD1Conditioner,
    SD2Conditioner,
    SDXLConditioner,
    SDXLRefinerConditioner,
    sdxl_adm,
    sdxl_refiner_adm,
)
from engine.models.detect import TextEncoderConfig
from engine.models.tokenizer import CLIPTokenizer, EmbeddingVector

TOLERANCE = 1e-5
BOS, EOS = 49406, 49407
G_PREFIX = "conditioner.embedders.1.model."


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def small_config(kind: str, width: int, activation: str, projection_dim: int | None) -> TextEncoderConfig:
    return TextEncoderConfig(kind=kind, vocab_size=49408, max_positions=77, width=width, layers=3, heads=4,
                             intermediate=4 * width, projection_dim=projection_dim, activation=activation,
                             key_prefix="", layout="hf" if kind == "clip_l" else "open_clip")


def hf_config(config: TextEncoderConfig) -> CLIPTextConfig:
    return CLIPTextConfig(hidden_size=config.width, intermediate_size=config.intermediate,
                          num_hidden_layers=config.layers, num_attention_heads=config.heads,
                          hidden_act=config.activation, projection_dim=config.projection_dim or config.width,
                          bos_token_id=BOS, eos_token_id=EOS)


def random_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, value in model.state_dict().items():
        noise = torch.randn(value.shape, generator=generator) * 0.1
        out[key] = noise + 1.0 if key.endswith("weight") and value.ndim == 1 else noise
    return out


@pytest.fixture(scope="module")
def clip_l():
    """(ours, transformers) CLIP-L-like pair in the "hf" layout, no projection."""
    config = small_config("clip_l", 64, "quick_gelu", projection_dim=None)
    reference = HFCLIPTextModel(hf_config(config)).eval()
    weights = random_weights(reference, seed=0)
    reference.load_state_dict(weights)
    ours = CLIPTextModel(config)
    ours.load_state_dict({"text_model." + key: value for key, value in weights.items()}, assign=True)
    return ours, reference


def open_clip_pair(kind: str, seed: int) -> tuple[CLIPTextModel, HFCLIPTextModelWithProjection]:
    config = small_config(kind, 80, "gelu", projection_dim=48)
    ours = CLIPTextModel(config)
    weights = random_weights(ours, seed)
    ours.load_state_dict(weights, assign=True)
    reference = HFCLIPTextModelWithProjection(hf_config(config)).eval()
    checkpoint = {G_PREFIX + key: value for key, value in weights.items()}
    reference.load_state_dict(convert_open_clip_checkpoint(reference, checkpoint, prefix=G_PREFIX))
    return ours, reference


@pytest.fixture(scope="module")
def clip_g():
    return open_clip_pair("openclip_g", seed=1)


@pytest.fixture(scope="module")
def clip_h():
    return open_clip_pair("openclip_h", seed=2)


def ids_of(words: list[int], pad: int) -> list[int]:
    return [BOS, *words, EOS] + [pad] * (75 - len(words))


def chunk_of(words: list[int], weights: dict[int, float] | None = None) -> list[tuple[int, float]]:
    """A 77-token chunk as CLIP-L's tokenizer makes it (EOS padding); weights by position."""
    weights = weights or {}
    return [(token, weights.get(position, 1.0)) for position, token in enumerate(ids_of(words, EOS))]


WORDS = [320, 1125, 539, 320, 2368, 530, 518, 4119]  # any ids below the special tokens
MORE_WORDS = [1929, 593, 2153, 267, 3144]


def reference_layers(reference, words: list[int], pad: int,
                     ) -> tuple[tuple[torch.Tensor, ...], torch.nn.Module]:
    """transformers' hidden states (embeddings + each layer) and its final LayerNorm."""
    with torch.no_grad():
        out = reference(torch.tensor([ids_of(words, pad)]), output_hidden_states=True)
    text_model = getattr(reference, "text_model", reference)
    return out.hidden_states, text_model.final_layer_norm


def test_sd1_reads_the_last_layer_through_the_final_norm(clip_l):
    ours, reference = clip_l
    with torch.no_grad():
        context = SD1Conditioner(ours).encode([chunk_of(WORDS)]).context
        expected = reference(torch.tensor([ids_of(WORDS, EOS)])).last_hidden_state
    assert context.shape == (1, 77, 64)
    assert relative_error(context, expected) <= TOLERANCE


def test_sd1_clip_skip_2_reads_the_penultimate_layer_through_the_final_norm(clip_l):
    ours, reference = clip_l
    hidden_states, final_norm = reference_layers(reference, WORDS, EOS)
    with torch.no_grad():
        context = SD1Conditioner(ours).encode([chunk_of(WORDS)], clip_skip=2).context
        expected = final_norm(hidden_states[-2])
    assert relative_error(context, expected) <= TOLERANCE


def test_sd2_reads_the_zero_padded_penultimate_layer_through_the_final_norm(clip_h):
    ours, reference = clip_h
    hidden_states, final_norm = reference_layers(reference, WORDS, pad=0)
    with torch.no_grad():
        context = SD2Conditioner(ours).encode([chunk_of(WORDS)]).context  # EOS-padded chunk, re-padded
        expected = final_norm(hidden_states[-2])
    assert relative_error(context, expected) <= TOLERANCE


def test_sdxl_concatenates_unnormed_penultimate_layers_and_pools_from_bigg_projection(clip_l, clip_g):
    (ours_l, reference_l), (ours_g, reference_g) = clip_l, clip_g
    hidden_l, _ = reference_layers(reference_l, WORDS, EOS)
    hidden_g, _ = reference_layers(reference_g, WORDS, pad=0)
    with torch.no_grad():
        cond = SDXLConditioner(ours_l, ours_g).encode([chunk_of(WORDS)])
        expected_pooled = reference_g(torch.tensor([ids_of(WORDS, 0)])).text_embeds
    assert cond.context.shape == (1, 77, 64 + 80)
    assert relative_error(cond.context[..., :64], hidden_l[-2]) <= TOLERANCE
    assert relative_error(cond.context[..., 64:], hidden_g[-2]) <= TOLERANCE
    assert relative_error(cond.pooled, expected_pooled) <= TOLERANCE


def test_sdxl_refiner_reads_bigg_alone(clip_g):
    ours, reference = clip_g
    hidden_g, _ = reference_layers(reference, WORDS, pad=0)
    with torch.no_grad():
        cond = SDXLRefinerConditioner(ours).encode([chunk_of(WORDS)])
        expected_pooled = reference(torch.tensor([ids_of(WORDS, 0)])).text_embeds
    assert relative_error(cond.context, hidden_g[-2]) <= TOLERANCE
    assert relative_error(cond.pooled, expected_pooled) <= TOLERANCE


def test_full_size_sdxl_conditioning_shapes_on_meta():
    sdxl_clip_l = clip_l_config("conditioner.embedders.0.transformer.text_model.")
    conditioner = SDXLConditioner(CLIPTextModel(sdxl_clip_l), CLIPTextModel(openclip_bigg_config()))
    cond = conditioner.encode([chunk_of(WORDS), chunk_of(MORE_WORDS)])
    assert cond.context.shape == (1, 154, 2048)
    assert cond.pooled.shape == (1, 1280)
    assert sdxl_adm(cond.pooled, 1024, 1024).shape == (1, 2816)
    assert sdxl_refiner_adm(cond.pooled, 1024, 1024).shape == (1, 2560)


def test_long_prompt_encodes_each_chunk_alone_and_concatenates_154_tokens(clip_l):
    ours, reference = clip_l
    with torch.no_grad():
        context = SD1Conditioner(ours).encode([chunk_of(WORDS), chunk_of(MORE_WORDS)]).context
        expected = reference(torch.tensor([ids_of(WORDS, EOS), ids_of(MORE_WORDS, EOS)])).last_hidden_state
    assert context.shape == (1, 154, 64)
    assert relative_error(context, expected.reshape(1, 154, 64)) <= TOLERANCE


def test_tokenizer_chunks_give_the_same_conditioning_whichever_padding_they_carry(clip_l, clip_g):
    (ours_l, _), (ours_g, _) = clip_l, clip_g
    prompt = "a photo of a (cat:1.2) by the " + "river " * 80
    eos_padded = CLIPTokenizer(pad_with="eos").tokenize_weighted(prompt)
    zero_padded = CLIPTokenizer(pad_with="zero").tokenize_weighted(prompt)
    conditioner = SDXLConditioner(ours_l, ours_g)
    with torch.no_grad():
        shared = conditioner.encode(eos_padded)
        per_encoder = conditioner.encode({"clip_l": eos_padded, "openclip_g": zero_padded})
    assert shared.context.shape == (1, 154, 64 + 80)
    assert torch.equal(shared.context, per_encoder.context)
    assert torch.equal(shared.pooled, per_encoder.pooled)


def comfy_weighting(z: torch.Tensor, z_empty: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ComfyUI, comfy/sd1_clip.py encode_token_weights: z[j] = (z[j] - z_empty[j]) * weight + z_empty[j]
    for every position whose weight is not 1."""
    out = z.clone()
    for j, weight in enumerate(weights.tolist()):
        if weight != 1.0:
            out[:, j] = (z[:, j] - z_empty[:, j]) * weight + z_empty[:, j]
    return out


def test_prompt_weights_move_positions_away_from_the_empty_prompt(clip_l):
    ours, reference = clip_l
    weights = {2: 1.3, 3: 1.3, 5: 0.7}
    with torch.no_grad():
        context = SD1Conditioner(ours).encode([chunk_of(WORDS, weights)]).context
        z = reference(torch.tensor([ids_of(WORDS, EOS)])).last_hidden_state
        z_empty = reference(torch.tensor([ids_of([], EOS)])).last_hidden_state
    expected = comfy_weighting(z, z_empty, torch.tensor([w for _, w in chunk_of(WORDS, weights)]))
    assert relative_error(context, expected) <= TOLERANCE
    assert relative_error(context, z) > 1e-3  # the weights did change something


def test_sdxl_bigg_weighting_uses_a_zero_padded_empty_prompt(clip_l, clip_g):
    (ours_l, _), (ours_g, reference_g) = clip_l, clip_g
    weights = {1: 1.2, 4: 0.5}
    hidden_g, _ = reference_layers(reference_g, WORDS, pad=0)
    empty_g, _ = reference_layers(reference_g, [], pad=0)
    with torch.no_grad():
        cond = SDXLConditioner(ours_l, ours_g).encode([chunk_of(WORDS, weights)])
    position_weights = torch.tensor([w for _, w in chunk_of(WORDS, weights)])
    expected = comfy_weighting(hidden_g[-2], empty_g[-2], position_weights)
    assert relative_error(cond.context[..., 64:], expected) <= TOLERANCE


def test_textual_inversion_vector_replaces_the_token_embedding(clip_l):
    ours, reference = clip_l
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3))
    spare_id = 4000  # a token id the prompt does not use
    chunk = chunk_of(WORDS)
    chunk[3] = (EmbeddingVector("style", 0, vector), 1.0)
    words = list(WORDS)
    words[2] = spare_id  # position 3 of the chunk (after BOS)
    with torch.no_grad():
        context = SD1Conditioner(ours).encode([chunk]).context
        original = reference.embeddings.token_embedding.weight[spare_id].clone()
        reference.embeddings.token_embedding.weight[spare_id] = vector
        expected = reference(torch.tensor([ids_of(words, EOS)])).last_hidden_state
        reference.embeddings.token_embedding.weight[spare_id] = original
    assert relative_error(context, expected) <= TOLERANCE


def test_sdxl_adm_matches_diffusers_add_time_proj():
    pooled = torch.randn(2, 1280, generator=torch.Generator().manual_seed(4))
    add_time_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
    # diffusers' SDXL pipeline: add_time_ids = original_size + crops_coords_top_left + target_size, (h, w)
    time_ids = torch.tensor([[768.0, 1024.0, 32.0, 16.0, 896.0, 1152.0]] * 2)
    expected = torch.cat([pooled, add_time_proj(time_ids.flatten()).reshape(2, -1)], dim=-1)
    y = sdxl_adm(pooled, width=1024, height=768, crop_w=16, crop_h=32, target_width=1152, target_height=896)
    assert y.shape == (2, 2816)
    assert relative_error(y, expected) <= TOLERANCE


def test_sdxl_refiner_adm_matches_diffusers_aesthetic_score_construction():
    pooled = torch.randn(1, 1280, generator=torch.Generator().manual_seed(5))
    add_time_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
    # diffusers' SDXL img2img pipeline (refiner): original_size + crops_coords_top_left + (aesthetic_score,)
    time_ids = torch.tensor([[768.0, 1024.0, 32.0, 16.0, 2.5]])
    expected = torch.cat([pooled, add_time_proj(time_ids.flatten()).reshape(1, -1)], dim=-1)
    y = sdxl_refiner_adm(pooled, width=1024, height=768, crop_w=16, crop_h=32, aesthetic_score=2.5)
    assert y.shape == (1, 2560)
    assert relative_error(y, expected) <= TOLERANCE


def test_bad_inputs_raise_errors_naming_what_is_accepted(clip_l, clip_g):
    (ours_l, _), (ours_g, _) = clip_l, clip_g
    with pytest.raises(ValueError, match="needs a clip_l text encoder, got 'openclip_g'"):
        SD1Conditioner(ours_g)
    conditioner = SD1Conditioner(ours_l)
    with pytest.raises(ValueError, match="at least one chunk"):
        conditioner.encode([])
    with pytest.raises(ValueError, match="one length"):
        conditioner.encode([chunk_of(WORDS), chunk_of(WORDS)[:40]])
    with pytest.raises(ValueError, match="token id 49408 .* accepted: 0 to 49407"):
        conditioner.encode([[(BOS, 1.0), (49408, 1.0), (EOS, 1.0)]])
    bad_vector = chunk_of(WORDS)
    bad_vector[2] = (torch.zeros(1280), 1.0)
    with pytest.raises(ValueError, match=r"accepted: a token id, or an embedding vector of shape \(64,\)"):
        conditioner.encode([bad_vector])
    with pytest.raises(ValueError, match="accepted: clip_l, openclip_g"):
        SDXLConditioner(ours_l, ours_g).encode({"l": [chunk_of(WORDS)], "g": [chunk_of(WORDS)]})

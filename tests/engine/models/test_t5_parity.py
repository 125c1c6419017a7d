"""T5 v1.1 encoder parity with transformers' T5EncoderModel, key mapping and config detection.

Random weights at a reduced size (d_model 64, d_kv 16, 4 heads, d_ff 128, 3 blocks, gated-gelu) in float32;
tolerance: relative L2 error <= 1e-5 for the embedding, each block's output that transformers exposes and
the final hidden state, with and without an attention mask. Half precision is checked against float32 on
a model whose residual stream is driven past float16's range. Full-size models only on the meta device.
"""

from __future__ import annotations

import pytest
import torch
from transformers import T5Config as HFT5Config
from transformers import T5EncoderModel

from engine.models.clip import CLIPTextModel, clip_l_config
from engine.models.staged import run_stages
from engine.models.t5 import (
    T5Config,
    T5Encoder,
    relative_position_buckets,
    t5_config_from_shapes,
    t5_key_map,
    t5_prefix,
    t5_xxl_config,
)
from engine.models.weights import bind_weights

TOLERANCE = 1e-5
XXL_PARAMETERS = 4_762_310_656  # with the shared embedding (32128 x 4096)
COMFY_PREFIX = "text_encoders.t5xxl.transformer."
FLOAT16_MAX = 65504.0


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).norm() / reference.float().norm())


def small_config() -> T5Config:
    return T5Config(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=3)


def hf_config(config: T5Config) -> HFT5Config:
    return HFT5Config(vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv,
                      d_ff=config.d_ff, num_layers=config.num_layers, num_heads=config.num_heads,
                      relative_attention_num_buckets=config.relative_attention_num_buckets,
                      relative_attention_max_distance=config.relative_attention_max_distance,
                      feed_forward_proj=config.feed_forward_proj,
                      layer_norm_epsilon=config.layer_norm_epsilon, dropout_rate=0.0)


def randomize(state_dict: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Random tensors of the same shapes, scaled so that attention is sharp and the bias matters:
    norm scales around 1, embedding and position bias of unit scale, projections 0.2."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, value in state_dict.items():
        noise = torch.randn(value.shape, generator=generator)
        if key.endswith("layer_norm.weight"):
            out[key] = 1.0 + 0.1 * noise
        elif key.endswith(("shared.weight", "embed_tokens.weight", "relative_attention_bias.weight")):
            out[key] = noise
        else:
            out[key] = 0.2 * noise
    if "encoder.embed_tokens.weight" in out:
        out["encoder.embed_tokens.weight"] = out["shared.weight"]  # tied in transformers
    return out


def prompt_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows [2, 40] (long enough for logarithmic distance buckets) and a mask hiding the second's tail."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(2, 32100, (2, 40), generator=generator)
    tokens[0, 30] = 1  # </s> then pads, as the tokenizer frames a prompt
    tokens[0, 31:] = 0
    mask = torch.ones_like(tokens)
    mask[1, 25:] = 0
    return tokens, mask


@pytest.fixture(scope="module")
def pair() -> tuple[T5Encoder, T5EncoderModel]:
    config = small_config()
    reference = T5EncoderModel(hf_config(config)).eval()
    weights = randomize(reference.state_dict(), seed=0)
    reference.load_state_dict(weights)
    ours = T5Encoder(config)  # built on meta, then bound through the key map, as a loader would
    bind_weights(ours, {name: weights[key] for name, key in t5_key_map(weights).items()})
    return ours, reference


def stage_outputs(model: T5Encoder, tokens: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    state = model.initial_state(tokens, mask)
    outputs = []
    run_stages(model.stages(), state, after=lambda index, stage: outputs.append(state["hidden"].clone()))
    return outputs


@pytest.mark.parametrize("masked", [False, True])
def test_every_exposed_stage_output_matches_transformers(pair, masked):
    ours, reference = pair
    tokens, mask = prompt_tokens()
    mask = mask if masked else None
    with torch.no_grad():
        expected = reference(tokens, attention_mask=mask, output_hidden_states=True).hidden_states
        outputs = stage_outputs(ours, tokens, mask)
    # transformers exposes each block's input and the final (normed) output; the last block's raw output
    # is only seen through the final norm.
    layers = ours.config.num_layers
    assert len(outputs) == layers + 2 and len(expected) == layers + 1
    errors = [relative_error(outputs[i], expected[i]) for i in range(layers)]
    errors.append(relative_error(outputs[-1], expected[-1]))
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize("masked", [False, True])
def test_last_hidden_state_matches_transformers(pair, masked):
    ours, reference = pair
    tokens, mask = prompt_tokens()
    mask = mask if masked else None
    with torch.no_grad():
        expected = reference(tokens, attention_mask=mask).last_hidden_state
        hidden = ours(tokens, mask)
    assert hidden.shape == (2, 40, 64) and hidden.dtype == torch.float32
    assert relative_error(hidden, expected) <= TOLERANCE


def test_mask_changes_the_output_only_where_it_hides_keys(pair):
    ours, _ = pair
    tokens, mask = prompt_tokens()
    with torch.no_grad():
        masked, unmasked = ours(tokens, mask), ours(tokens)
    assert torch.equal(masked[0], unmasked[0])  # row 0 hides nothing
    assert relative_error(masked[1], unmasked[1]) > 1e-2


def test_forward_equals_running_the_stages_and_block_0_leaves_the_bias_for_the_others(pair):
    ours, _ = pair
    tokens, mask = prompt_tokens()
    biases = []
    state = ours.initial_state(tokens, mask)

    def record(index, stage):
        biases.append(state["position_bias"])

    with torch.no_grad():
        staged = run_stages(ours.stages(), state, after=record)["hidden"]
        assert torch.equal(ours(tokens, mask), staged)
    assert biases[0] is None and biases[-1] is None  # before block 0; dropped by the final norm
    assert biases[1] is biases[2] is biases[3]  # computed once by block 0, reused
    assert biases[1].shape == (2, 4, 40, 40)


def test_relative_position_buckets_match_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    length = 300  # past max_distance 128 both ways
    relative = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    expected = T5Attention._relative_position_bucket(relative, bidirectional=True, num_buckets=32,
                                                     max_distance=128)
    assert torch.equal(relative_position_buckets(length, length, 32, 128, torch.device("cpu")), expected)


def test_stage_names_and_each_parameter_owned_exactly_once():
    model = T5Encoder(small_config())
    stages = model.stages()
    assert [stage.name for stage in stages] == ["embed", "encoder.block.0", "encoder.block.1",
                                                "encoder.block.2", "final_norm"]
    owned = [id(p) for stage in stages for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())
    assert [s.run for s in model.stages()] == [s.run for s in stages]  # cached
    model.forget_stages()
    assert model.stages()[1].run is not stages[1].run


def xxl_reference_on_meta() -> T5EncoderModel:
    with torch.device("meta"):
        return T5EncoderModel(hf_config(t5_xxl_config()))


def test_full_size_xxl_matches_transformers_parameter_count_and_keys():
    ours = T5Encoder(t5_xxl_config())
    reference = xxl_reference_on_meta()
    assert sum(p.numel() for p in ours.parameters()) == XXL_PARAMETERS
    assert sum(p.numel() for p in reference.parameters()) == XXL_PARAMETERS
    file_keys = set(reference.state_dict())  # shared.weight and encoder.embed_tokens.weight
    key_map = t5_key_map(file_keys)
    assert set(key_map) == set(ours.state_dict())
    assert set(key_map.values()) == file_keys - {"encoder.embed_tokens.weight"}


def xxl_shapes(prefix: str = "") -> dict[str, tuple[int, ...]]:
    state = T5Encoder(t5_xxl_config()).state_dict()
    return {prefix + key: tuple(value.shape) for key, value in state.items()}


def test_config_from_shapes_reads_xxl_back_with_and_without_a_prefix():
    assert t5_config_from_shapes(xxl_shapes()) == t5_xxl_config()
    shapes = xxl_shapes(COMFY_PREFIX)
    shapes["model.diffusion_model.img_in.weight"] = (3072, 64)  # other parts of a full checkpoint
    assert t5_prefix(shapes) == COMFY_PREFIX
    assert t5_config_from_shapes(shapes) == t5_xxl_config()
    assert t5_config_from_shapes(shapes, prefix=COMFY_PREFIX) == t5_xxl_config()
    assert t5_config_from_shapes({k: tuple(v.shape) for k, v in small_pair_state().items()}) == small_config()


def small_pair_state() -> dict[str, torch.Tensor]:
    return T5Encoder(small_config()).state_dict()


@pytest.mark.parametrize("embedding_keys", [("shared.weight",), ("encoder.embed_tokens.weight",),
                                            ("shared.weight", "encoder.embed_tokens.weight")])
def test_key_map_takes_the_embedding_under_either_name(embedding_keys):
    shapes = xxl_shapes(COMFY_PREFIX)
    embedding = shapes.pop(COMFY_PREFIX + "shared.weight")
    shapes.update({COMFY_PREFIX + key: embedding for key in embedding_keys})
    key_map = t5_key_map(shapes)
    assert key_map["shared.weight"] == COMFY_PREFIX + embedding_keys[0]
    assert t5_config_from_shapes(shapes) == t5_xxl_config()


def test_a_clip_file_given_as_t5_is_refused_naming_the_key_looked_for():
    clip = {"text_encoders.clip_l.transformer." + key: tuple(value.shape)
            for key, value in CLIPTextModel(clip_l_config()).state_dict().items()}
    with pytest.raises(KeyError, match=r"not a T5 encoder: no key '<prefix>encoder\.block\.0\.layer\.0\."
                                       r"SelfAttention\.q\.weight' \(keys start: text_encoders\.clip_l"):
        t5_config_from_shapes(clip)


def test_missing_and_misshapen_keys_are_named():
    shapes = xxl_shapes()
    del shapes["encoder.block.7.layer.1.DenseReluDense.wo.weight"]
    with pytest.raises(KeyError, match=r"'encoder\.block\.7\.layer\.1\.DenseReluDense\.wo\.weight' "
                                       "is missing"):
        t5_config_from_shapes(shapes)
    shapes = xxl_shapes()
    del shapes["shared.weight"]
    with pytest.raises(KeyError, match=r"'shared\.weight' \(or 'encoder\.embed_tokens\.weight'\) is missing"):
        t5_key_map(shapes)
    shapes = xxl_shapes()
    shapes["encoder.block.3.layer.0.SelfAttention.o.weight"] = (4096, 2048)
    with pytest.raises(ValueError, match=r"'encoder\.block\.3\.layer\.0\.SelfAttention\.o\.weight' has shape "
                                         r"\(4096, 2048\), expected \(4096, 4096\)"):
        t5_config_from_shapes(shapes)
    shapes = xxl_shapes()
    shapes["encoder.block.0.layer.1.DenseReluDense.wi.weight"] = (10240, 4096)
    with pytest.raises(ValueError, match="T5 v1.0 .* not supported; accepted: gated-gelu"):
        t5_config_from_shapes(shapes)


def test_bad_inputs_raise_errors_naming_what_is_accepted():
    model = T5Encoder(small_config())
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length >= 1\]"):
        model.initial_state(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must have the tokens' shape"):
        model.initial_state(torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 4))
    with pytest.raises(ValueError, match="accepted: gated-gelu"):
        T5Encoder(T5Config(feed_forward_proj="relu"))


def overflowing_weights(seed: int) -> dict[str, torch.Tensor]:
    """Small-model weights whose block-0 feed-forward output (and so the residual stream) exceeds 65504."""
    weights = randomize(small_pair_state(), seed)
    weights["encoder.block.0.layer.1.DenseReluDense.wo.weight"] *= 20000.0
    return weights


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_weights_stay_close_to_float32_past_float16_range(dtype, tolerance):
    weights = overflowing_weights(seed=3)
    reference = T5Encoder(small_config(), device="cpu")
    bind_weights(reference, weights)
    half = T5Encoder(small_config(), dtype=dtype, device="cpu")
    bind_weights(half, {key: value.to(dtype) for key, value in weights.items()})
    tokens, mask = prompt_tokens()
    with torch.no_grad():
        residual = stage_outputs(reference, tokens, mask)[1]  # after block 0
        expected = reference(tokens, mask)
        hidden = half(tokens, mask)
    assert residual.abs().max() > 4 * FLOAT16_MAX  # a float16 residual stream would hold inf here
    assert hidden.dtype == torch.float32 and torch.isfinite(hidden).all()
    assert relative_error(hidden, expected) <= tolerance

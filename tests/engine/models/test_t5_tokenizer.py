"""T5 tokenizer: ids against transformers' T5TokenizerFast (what ComfyUI calls) on the same tokenizer.json,
ComfyUI's FLUX framing (no start token, </s> = 1, <pad> = 0 up to 256, never truncated), prompt weights,
and the weighted encoding against the empty prompt."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import T5TokenizerFast

from engine.models.t5 import T5Config, T5Encoder
from engine.models.t5_tokenizer import (
    END_ID,
    PAD_ID,
    TOKENIZER_PATH,
    T5Tokenizer,
    empty_tokens,
    encode_weighted,
)
from engine.models.weights import bind_weights

PROMPTS = [
    "a photo of a cat",
    "A bustling street market at dusk, lanterns glowing; 4k, highly detailed!",
    "Hello   World! 123 café, naïve résumé",
    "line one\nline two\ttabbed  ",
    "東京の夜景 ✨ and an emoji 🐱",
]


@pytest.fixture(scope="module")
def tokenizer() -> T5Tokenizer:
    return T5Tokenizer()


@pytest.fixture(scope="module")
def reference() -> T5TokenizerFast:
    return T5TokenizerFast(tokenizer_file=str(TOKENIZER_PATH))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ids_match_transformers_t5_tokenizer_fast(tokenizer, reference, prompt):
    expected = reference(prompt)["input_ids"]  # ends with </s>
    assert expected[-1] == END_ID
    assert tokenizer.encode(prompt) == expected[:-1]
    assert tokenizer.tokenize(prompt) == expected + [PAD_ID] * (256 - len(expected))


def test_prompt_is_ended_and_padded_to_256_without_a_start_token(tokenizer, reference):
    tokens = tokenizer.tokenize_weighted("a photo of a cat")
    ids = reference("a photo of a cat")["input_ids"]
    assert len(tokens) == 256
    assert tokens[: len(ids)] == [(i, 1.0) for i in ids]  # first token is the prompt's, no BOS
    assert tokens[len(ids) - 1] == (END_ID, 1.0)
    assert tokens[len(ids):] == [(PAD_ID, 1.0)] * (256 - len(ids))
    assert tokenizer.tokenize("") == [END_ID] + [PAD_ID] * 255
    assert len(tokenizer.tokenize("a cat", min_length=77)) == 77  # SD3's T5 minimum


def test_long_prompt_is_never_truncated(tokenizer, reference):
    prompt = ", ".join(f"detail number {i}" for i in range(100))
    ids = reference(prompt)["input_ids"]
    assert len(ids) > 300
    tokens = tokenizer.tokenize(prompt)
    assert tokens == ids  # all of it, </s> last, no padding past 256


def test_weights_follow_the_emphasis_segments(tokenizer, reference):
    tokens = tokenizer.tokenize_weighted("a photo of (a cat:1.3) on a (mat)")
    # Each segment is tokenized on its own, as ComfyUI does.
    segments = [("a photo of ", 1.0), ("a cat", 1.3), (" on a ", 1.0), ("mat", 1.1)]
    expected = [(i, weight) for text, weight in segments for i in reference(text)["input_ids"][:-1]]
    assert tokens[: len(expected)] == expected
    assert [w for _, w in tokens[len(expected):]] == [1.0] * (256 - len(expected))
    assert tokens[len(expected)] == (END_ID, 1.0)
    assert [tokenizer.decode([i]) for i, w in tokens if w == 1.3] == ["", "a", "cat"]


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="T5 tokenizer file not found: .*nowhere.json"):
        T5Tokenizer(tmp_path / "nowhere.json")


class RecordingEncoder:
    """A stand-in encoder: hidden[b, t] = table[token] * (t + 1), and the batches it was given."""

    def __init__(self):
        self.table = torch.randn(32128, 8, generator=torch.Generator().manual_seed(0))
        self.calls: list[torch.Tensor] = []

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls.append(tokens)
        return self.table[tokens] * torch.arange(1, tokens.shape[1] + 1)[None, :, None]


def test_unweighted_prompt_is_encoded_alone(tokenizer):
    encoder = RecordingEncoder()
    tokens = tokenizer.tokenize_weighted("a photo of a cat")
    hidden = encode_weighted(encoder, tokens)
    assert len(encoder.calls) == 1 and encoder.calls[0].shape == (1, 256)
    assert torch.equal(hidden, encoder(torch.tensor([[t for t, _ in tokens]])))


def test_weighted_tokens_move_away_from_the_empty_prompt(tokenizer):
    encoder = RecordingEncoder()
    tokens = tokenizer.tokenize_weighted("a photo of (a cat:1.3)")
    hidden = encode_weighted(encoder, tokens)
    (batch,) = encoder.calls
    assert batch.tolist() == [[t for t, _ in tokens], empty_tokens(256)]
    assert empty_tokens(4) == [END_ID, PAD_ID, PAD_ID, PAD_ID]
    z, z_empty = encoder(batch)[:1], encoder(batch)[1:]
    weights = torch.tensor([w for _, w in tokens])
    weighted = weights != 1.0
    assert weighted.sum() == 3
    expected = (z - z_empty) * weights[None, :, None] + z_empty
    assert torch.allclose(hidden[:, weighted], expected[:, weighted])
    assert torch.equal(hidden[:, ~weighted], z[:, ~weighted])


def test_weighted_encoding_runs_through_a_t5_encoder(tokenizer):
    config = T5Config(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2)
    model = T5Encoder(config, device="cpu")
    generator = torch.Generator().manual_seed(1)
    bind_weights(model, {k: torch.randn(v.shape, generator=generator) * 0.2 + (k.endswith("norm.weight"))
                         for k, v in model.state_dict().items()})
    tokens = tokenizer.tokenize_weighted("(a cat:1.2) in the snow", min_length=16)
    with torch.no_grad():
        hidden = encode_weighted(model, tokens)
        plain = model(torch.tensor([[t for t, _ in tokens]]))
    assert hidden.shape == (1, 16, 32)
    assert torch.equal(hidden[:, 3:], plain[:, 3:])  # "▁", "a", "▁cat" carry 1.2
    assert not torch.allclose(hidden[:, :3], plain[:, :3])


def test_square_brackets_are_text_and_embedding_references_are_dropped(tokenizer, reference, caplog):
    with caplog.at_level(logging.WARNING, logger="sluice.tokenizer"):
        tokens = tokenizer.tokenize_weighted("[a cat] embedding:style, on (a mat:1.2)")
    assert "'style' not found" in caplog.text
    segments = [("[a cat]", 1.0), (", on ", 1.0), ("a mat", 1.2)]
    expected = [(i, weight) for text, weight in segments for i in reference(text)["input_ids"][:-1]]
    assert tokens[: len(expected) + 1] == expected + [(END_ID, 1.0)]

"""T5's SentencePiece unigram tokenizer (resources/t5_tokenizer/tokenizer.json, read by the `tokenizers`
library) and prompt weighting for T5-XXL the way ComfyUI's FLUX text encoder does it.

A prompt is one sequence, never cut into chunks nor truncated: its emphasis segments (`(a cat:1.3)`,
engine/models/prompt_weights.py, ComfyUI's parser) are tokenized one by one, no start token, then `</s>`
(id 1), then `<pad>` (id 0) up to `min_length` (256, ComfyUI's FLUX T5 tokenizer; SD3 uses 77). An
`embedding:NAME` reference is dropped with a warning, the text after its name kept (ComfyUI does the same
for an embedding it does not find; Sluice loads no T5 embeddings).

`encode_weighted` applies the weights as ComfyUI's `ClipTokenWeightEncoder.encode_token_weights`: when
any weight differs from 1, the empty prompt (`</s>` then pads, the same length) is encoded in the same
batch, and each weighted position j becomes `(z[j] - z_empty[j]) * w + z_empty[j]`. T5 has no pooled
output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.models.prompt_weights import (
    EMBEDDING_PREFIX,
    parse_prompt_weights,
    split_embedding_pieces,
    take_embedding_reference,
)

logger = logging.getLogger("sluice.tokenizer")

TOKENIZER_PATH = Path(__file__).resolve().parents[2] / "resources" / "t5_tokenizer" / "tokenizer.json"
PAD_ID = 0  # <pad>
END_ID = 1  # </s>
MIN_LENGTH = 256  # ComfyUI's FLUX T5 tokenizer pads to at least this many tokens

WeightedToken = tuple[int, float]
EncoderCall = Callable[[torch.Tensor], torch.Tensor]  # tokens [B, T] long -> hidden [B, T, d]


@cache
def _load(path: Path) -> Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"T5 tokenizer file not found: {path}; expected resources/t5_tokenizer/"
                                "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    specials = {"<pad>": PAD_ID, "</s>": END_ID}
    found = {token: tokenizer.token_to_id(token) for token in specials}
    if found != specials:
        raise ValueError(f"{path} is not T5's tokenizer: special token ids {found}, expected {specials}")
    return tokenizer


class T5Tokenizer:
    """T5 v1.1 tokenizer with ComfyUI's FLUX framing: prompt tokens, `</s>`, `<pad>` to `min_length`."""

    def __init__(self, path: str | Path = TOKENIZER_PATH):
        self.tokenizer = _load(Path(path))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without `</s>` (SentencePiece normalisation: trailing space dropped)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def tokenize_weighted(self, text: str, min_length: int = MIN_LENGTH) -> list[WeightedToken]:
        """(token, weight) pairs of the whole prompt, (`</s>`, 1.0), then (`<pad>`, 1.0) up to min_length."""
        if min_length < 1:
            raise ValueError(f"min_length must be >= 1, got {min_length}")
        tokens = []
        for segment, weight in parse_prompt_weights(text):
            for piece in split_embedding_pieces(segment):
                if piece.startswith(EMBEDDING_PREFIX):
                    _, name, piece = take_embedding_reference(piece, lambda name: None)
                    logger.warning("embedding %r not found (T5 embeddings are not loaded); dropped from the "
                                   "prompt", name)
                tokens.extend((token, weight) for token in self.encode(piece))
        tokens.append((END_ID, 1.0))
        return tokens + [(PAD_ID, 1.0)] * (min_length - len(tokens))

    def tokenize(self, text: str, min_length: int = MIN_LENGTH) -> list[int]:
        """The ids of `tokenize_weighted`: prompt tokens, `</s>`, pads up to min_length."""
        return [token for token, _ in self.tokenize_weighted(text, min_length)]


def empty_tokens(length: int) -> list[int]:
    """The empty prompt at `length` tokens, as ComfyUI makes it for T5: `</s>` then pads."""
    return [END_ID] + [PAD_ID] * (length - 1)


def encode_weighted(encoder_call: EncoderCall, tokens_with_weights: list[WeightedToken],
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Encode one weighted sequence -> [1, T, d], weights applied against the empty prompt (ComfyUI's rule).

    `encoder_call` maps tokens [B, T] long (on `device`) to hidden states [B, T, d]; it is called once, with
    B = 2 (the prompt, then the empty prompt) when a weight differs from 1, else with B = 1.
    """
    if not tokens_with_weights:
        raise ValueError("tokens_with_weights is empty; expected at least the end token")
    ids = [token for token, _ in tokens_with_weights]
    weights = torch.tensor([weight for _, weight in tokens_with_weights], dtype=torch.float32, device=device)
    weighted = bool((weights != 1.0).any())
    rows = [ids, empty_tokens(len(ids))] if weighted else [ids]
    hidden = encoder_call(torch.tensor(rows, dtype=torch.long, device=device))  # (1 or 2, T, d)
    z = hidden[:1]
    if not weighted:
        return z
    z_empty = hidden[1:2]
    scale = weights.to(z.dtype)[None, :, None]  # (1, T, 1)
    return torch.where(scale != 1.0, (z - z_empty) * scale + z_empty, z)  # weight-1 positions stay exact

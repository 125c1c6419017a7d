"""CLIP's byte-level BPE tokenizer (Radford et al. 2021) with OpenAI's vocabulary, and prompt chunking.

The merges come from resources/tokenizer/ (see its README.md); the 49408-token vocabulary is built from
them exactly as OpenAI's `simple_tokenizer.py` does. Text is cleaned like CLIP without ftfy (NFC,
HTML unescape, whitespace collapsed, lowercase) and split into words by CLIP's pattern

    <|startoftext|>|<|endoftext|>|'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+

Python's `re` has no `\\p{L}`, and the `regex` package is not a dependency, so `split_words` scans the
text with the same alternatives using `unicodedata` categories (L* = letter, N* = number).

`tokenize_weighted` turns a prompt with emphasis and `embedding:name` references into 77-token chunks
(BOS, 75 tokens, EOS, padding) exactly as ComfyUI's SDTokenizer.tokenize_with_weights does.
"""

from __future__ import annotations

import gzip
import html
import logging
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import torch

from engine.models.prompt_weights import (
    EMBEDDING_PREFIX,
    parse_prompt_weights,
    split_embedding_pieces,
    take_embedding_reference,
)

logger = logging.getLogger("sluice.tokenizer")

MERGES_PATH = Path(__file__).resolve().parents[2] / "resources" / "tokenizer" / "bpe_simple_vocab_16e6.txt.gz"
MERGE_COUNT = 49152 - 256 - 2  # merges CLIP uses: vocabulary 49408 = 2 * 256 bytes + merges + 2 specials
BOS_TOKEN, EOS_TOKEN = "<|startoftext|>", "<|endoftext|>"
CHUNK_TOKENS = 75  # prompt tokens per chunk; with BOS and EOS a chunk is CLIP's 77-token context
KEEP_WHOLE_BELOW = 8  # a token group shorter than this moves whole to the next chunk (ComfyUI's rule)
EMBEDDING_EXTENSIONS = (".safetensors", ".pt", ".bin")  # stripped from `embedding:name.ext` before lookup
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")
PAD_CHOICES = ("eos", "zero")

EmbeddingLookup = Callable[[str], "torch.Tensor | None"]


@dataclass(frozen=True, eq=False)
class EmbeddingVector:
    """One vector of a textual-inversion embedding standing in a token position of a chunk."""

    name: str  # the embedding's name as looked up
    index: int  # which of the embedding's vectors this is
    vector: torch.Tensor  # (width,)


Token = int | EmbeddingVector
WeightedToken = tuple[Token, float]


def bytes_to_unicode() -> dict[int, str]:
    """CLIP/GPT-2's reversible map of the 256 byte values to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    byte_values, code_points = printable[:], printable[:]
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            code_points.append(256 + len(code_points) - len(printable))
    return dict(zip(byte_values, map(chr, code_points), strict=True))


@cache
def load_merges(path: Path = MERGES_PATH) -> tuple[tuple[str, str], ...]:
    """The first MERGE_COUNT merge rules of a gzipped CLIP merges file (line 0 is a version header)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"CLIP merges file not found: {path}; expected bpe_simple_vocab_16e6.txt.gz")
    lines = gzip.open(path, "rt", encoding="utf-8").read().split("\n")[1:MERGE_COUNT + 1]
    symbols = "\n".join(lines).split()  # one split in C: 10x faster than a split per line
    if len(lines) != MERGE_COUNT or len(symbols) != 2 * MERGE_COUNT or "" in lines:
        raise ValueError(f"{path} is not a CLIP merges file: expected {MERGE_COUNT} lines of two symbols")
    pairs = iter(symbols)
    return tuple(zip(pairs, pairs, strict=True))


def build_vocab(merges: tuple[tuple[str, str], ...]) -> list[str]:
    """Token strings by id: bytes, bytes + '</w>', merged symbols, then BOS and EOS (49408 for CLIP)."""
    byte_chars = list(bytes_to_unicode().values())
    merged = ["".join(merge) for merge in merges]
    return [*byte_chars, *(c + "</w>" for c in byte_chars), *merged, BOS_TOKEN, EOS_TOKEN]


@cache
def _tables(path: Path) -> tuple[list[str], dict[str, int], dict[tuple[str, str], int]]:
    """The vocabulary, token ids and merge ranks of a merges file (read only: CLIPTokenizer never edits
    them, so SDXL's two tokenizers share one set)."""
    merges = load_merges(path)
    vocab = build_vocab(merges)
    return vocab, {token: index for index, token in enumerate(vocab)}, {m: r for r, m in enumerate(merges)}


def _is_letter(char: str) -> bool:
    return unicodedata.category(char).startswith("L")


def _is_number(char: str) -> bool:
    return unicodedata.category(char).startswith("N")


def split_words(text: str) -> list[str]:
    """CLIP's pre-tokenisation: the matches of its word pattern, alternatives tried in order."""
    words, i = [], 0
    while i < len(text):
        char = text[i]
        special = next((s for s in (BOS_TOKEN, EOS_TOKEN) if text.startswith(s, i)), None)
        contraction = next((c for c in CONTRACTIONS if text.startswith(c, i)), None)
        end = i + 1
        if special or contraction:
            end = i + len(special or contraction)
        elif _is_letter(char):
            while end < len(text) and _is_letter(text[end]):
                end += 1
        elif _is_number(char):
            pass
        elif char.isspace():
            i += 1
            continue
        else:
            while end < len(text) and not (text[end].isspace() or _is_letter(text[end])
                                           or _is_number(text[end])):
                end += 1
        words.append(text[i:end])
        i = end
    return words


def clean_text(text: str) -> str:
    """CLIP's basic_clean + whitespace_clean without ftfy: NFC, HTML unescaped twice, one space, lowercase."""
    text = html.unescape(html.unescape(unicodedata.normalize("NFC", text)))
    return re.sub(r"\s+", " ", text).strip().lower()


class CLIPTokenizer:
    """CLIP BPE tokenizer; `pad_with="eos"` pads like CLIP-L (SD1), `"zero"` like OpenCLIP (SD2, SDXL's G)."""

    def __init__(self, pad_with: str = "eos", merges_path: Path = MERGES_PATH):
        if pad_with not in PAD_CHOICES:
            raise ValueError(f"unknown pad_with {pad_with!r}; accepted: {', '.join(PAD_CHOICES)}")
        # token string by id, id by token string, rank by merge: shared by every tokenizer of the file
        self.vocab, self.token_ids, self.merge_ranks = _tables(Path(merges_path))
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        self.bos_id = self.token_ids[BOS_TOKEN]  # 49406
        self.eos_id = self.token_ids[EOS_TOKEN]  # 49407
        self.pad_id = self.eos_id if pad_with == "eos" else 0
        self.bpe = lru_cache(maxsize=65536)(self._bpe)

    def _bpe(self, word: str) -> tuple[str, ...]:
        """Byte-pair encoding of one pre-tokenised word: apply the lowest-ranked merge until none applies."""
        if word in (BOS_TOKEN, EOS_TOKEN):
            return (word,)
        symbols = [*word[:-1], word[-1] + "</w>"]
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:], strict=False))
            best = min(pairs, key=lambda pair: self.merge_ranks.get(pair, len(self.merge_ranks)))
            if best not in self.merge_ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return tuple(symbols)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS and EOS."""
        ids = []
        for word in split_words(clean_text(text)):
            byte_word = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.token_ids[symbol] for symbol in self.bpe(byte_word))
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids: '</w>' becomes a space; invalid UTF-8 is replaced."""
        bad = [i for i in ids if not 0 <= i < len(self.vocab)]
        if bad:
            raise ValueError(f"token id(s) {bad[:10]} out of range; accepted: 0..{len(self.vocab) - 1}")
        chars = "".join(self.vocab[i] for i in ids)
        text = bytes(self.byte_decoder[c] for c in chars).decode("utf-8", errors="replace")
        return text.replace("</w>", " ").strip()

    def tokenize_weighted(self, text: str, embedding_lookup: EmbeddingLookup | None = None
                          ) -> list[list[WeightedToken]]:
        """Chunks of 77 (token, weight) pairs: BOS, up to 75 prompt tokens, EOS, pads (ComfyUI's layout).

        The token groups are the emphasis segments, each cut further at `embedding:` references (a
        reference's vectors and the text after its name are groups of their own). Groups fill the chunk in
        order; a group that does not fit starts the next chunk whole if it has fewer than KEEP_WHOLE_BELOW
        tokens, else it is cut to fill the chunk exactly (so a plain long prompt is cut at 75 tokens,
        inside a word if need be). With `embedding_lookup` None, `embedding:` is plain text (ComfyUI with
        no embeddings folder); with a lookup, a reference it does not find is dropped with a warning.
        """
        chunks: list[list[WeightedToken]] = []
        chunk: list[WeightedToken] = []
        for group in self._token_groups(text, embedding_lookup):
            keep_whole = len(group) < KEEP_WHOLE_BELOW
            while group:
                room = CHUNK_TOKENS - len(chunk)
                if len(group) <= room:
                    chunk.extend(group)
                    group = []
                    continue
                if not keep_whole:
                    chunk.extend(group[:room])
                    group = group[room:]
                chunks.append(chunk)
                chunk = []
        chunks.append(chunk)
        return [self._frame(chunk) for chunk in chunks]

    def _frame(self, tokens: list[WeightedToken]) -> list[WeightedToken]:
        padding = [(self.pad_id, 1.0)] * (CHUNK_TOKENS - len(tokens))
        return [(self.bos_id, 1.0), *tokens, (self.eos_id, 1.0), *padding]

    def _token_groups(self, text: str, embedding_lookup: EmbeddingLookup | None
                      ) -> list[list[WeightedToken]]:
        """The prompt's token groups as lists of (token, weight), embedding references replaced by vectors."""
        groups = []
        for segment, weight in parse_prompt_weights(text):
            for piece in split_embedding_pieces(segment):
                if piece.startswith(EMBEDDING_PREFIX) and embedding_lookup is not None:
                    vectors, name, piece = take_embedding_reference(
                        piece, lambda name: self._embedding_vectors(name, embedding_lookup))
                    if vectors is None:
                        logger.warning("embedding %r not found; dropped from the prompt", name)
                    else:
                        groups.append([(vector, weight) for vector in vectors])
                tokens = [(token, weight) for token in self.encode(piece)]
                if tokens:
                    groups.append(tokens)
        return groups

    def _embedding_vectors(self, reference: str, embedding_lookup: EmbeddingLookup
                           ) -> list[EmbeddingVector] | None:
        """The vectors of embedding `reference` (`name` or `name.ext`); None if not found."""
        name = reference
        for extension in EMBEDDING_EXTENSIONS:
            if name.endswith(extension) and len(name) > len(extension):
                name = name[: -len(extension)]
        tensor = embedding_lookup(name) if name else None
        if tensor is None:
            return None
        if tensor.ndim == 1:
            tensor = tensor[None]  # (1, width)
        if tensor.ndim != 2:
            raise ValueError(f"embedding {name!r} has shape {tuple(tensor.shape)}; accepted: (width,) or "
                             "(n_vectors, width)")
        return [EmbeddingVector(name, index, row) for index, row in enumerate(tensor)]

"""CLIP tokenizer vs transformers' CLIPTokenizer built from the same vocabulary; chunking, padding."""

from __future__ import annotations

import json
import logging
import random

import pytest
import regex
import torch
import transformers

from engine.models.tokenizer import (
    CHUNK_TOKENS,
    CLIPTokenizer,
    EmbeddingVector,
    load_merges,
    split_words,
)

CLIP_PATTERN = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    regex.IGNORECASE,
)

PROMPTS = [
    "a photo of a cat",
    "A Photo Of A CAT, masterpiece, best quality, 8k, highly detailed!!!",
    "Hello, World!? it's 2024... I'd've thought they're cool; we'll see (maybe) [not]",
    "naïve café résumé Ångström Straße",
    "日本語のテキスト and 中文 and Ελληνικά and русский текст",
    "emoji 😀👍🏽 🇫🇷 ❤️ ✨✨",
    "   multiple   spaces\n\tand\ttabs   ",
    "supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis",
    "numbers 3.14159 1,000,000 0x1F 42nd ½ ² ٣",
    "punctuation: @#$%^&*()_+-=<>?/\\|~`\"' --- ...",
    "x<|endoftext|>y <|startoftext|>",
    "don't DON'T rock'n'roll 'quoted' o'clock",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> CLIPTokenizer:
    return CLIPTokenizer()


@pytest.fixture(scope="module")
def reference(tokenizer: CLIPTokenizer, tmp_path_factory: pytest.TempPathFactory
              ) -> transformers.CLIPTokenizer:
    folder = tmp_path_factory.mktemp("clip_vocab")
    vocab_file, merges_file = folder / "vocab.json", folder / "merges.txt"
    vocab_file.write_text(json.dumps({token: index for index, token in enumerate(tokenizer.vocab)}))
    merges_file.write_text("#version: 0.2\n" + "\n".join(" ".join(merge) for merge in load_merges()) + "\n")
    return transformers.CLIPTokenizer(vocab=str(vocab_file), merges=str(merges_file))


def test_vocabulary_is_clips_49408_tokens_with_special_ids(tokenizer: CLIPTokenizer):
    assert len(tokenizer.vocab) == 49408
    assert (tokenizer.bos_id, tokenizer.eos_id) == (49406, 49407)
    assert tokenizer.vocab[49406:] == ["<|startoftext|>", "<|endoftext|>"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_token_ids_equal_transformers_from_same_vocabulary(tokenizer, reference, prompt: str):
    expected = reference(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.encode(prompt) == expected


def test_well_known_ids_of_openai_clip(tokenizer):
    # ids published with OpenAI CLIP for "a photo of a cat" (model card examples)
    assert tokenizer.encode("a photo of a cat") == [320, 1125, 539, 320, 2368]


def test_word_split_equals_regex_pattern_on_random_unicode():
    rng = random.Random(0)
    alphabet = "aZé ß日ー😀1٣½²'s're!?.,-_ \u0301\u0915\u093f<|>endoftxt"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))).lower()
        assert split_words(text) == CLIP_PATTERN.findall(text), repr(text)


def test_text_cleaning_unescapes_html_and_collapses_whitespace(tokenizer):
    assert tokenizer.encode("fish &amp; chips") == tokenizer.encode("fish & chips")
    assert tokenizer.encode("  a \n\n b\t") == tokenizer.encode("a b")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_decode_matches_transformers_decode(tokenizer, reference, prompt: str):
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids) == reference.decode(ids)


def test_decode_round_trips_plain_lowercase_words(tokenizer):
    text = "a beautiful landscape painting of mountains at sunset"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_decode_rejects_out_of_range_ids(tokenizer):
    with pytest.raises(ValueError, match="49408"):
        tokenizer.decode([1, 49408])


def test_pad_ids_eos_for_clip_l_and_zero_for_open_clip():
    assert CLIPTokenizer(pad_with="eos").pad_id == 49407
    assert CLIPTokenizer(pad_with="zero").pad_id == 0
    with pytest.raises(ValueError, match="accepted: eos, zero"):
        CLIPTokenizer(pad_with="none")


def test_empty_prompt_gives_one_chunk_of_bos_eos_and_pads():
    for pad_with, pad in (("eos", 49407), ("zero", 0)):
        chunks = CLIPTokenizer(pad_with=pad_with).tokenize_weighted("")
        assert chunks == [[(49406, 1.0), (49407, 1.0)] + [(pad, 1.0)] * 75]


def _prompt_tokens(chunk):
    """The tokens between BOS and EOS of a framed chunk."""
    eos_at = next(i for i, (token, _) in enumerate(chunk) if i > 0 and token == 49407)
    return [token for token, _ in chunk[1:eos_at]]


CAT, CASTLE, DASH, BIG, RED, DOG = 2368, 3540, 268, 1205, 736, 1929  # CLIP ids of 'cat</w>', ... '-</w>'


def test_a_long_plain_prompt_is_cut_at_exactly_75_tokens_inside_a_word(tokenizer):
    # ComfyUI: one unweighted segment is one token group; a group of 8+ tokens is cut to fill the chunk.
    assert tokenizer.encode("castle-castle") == [CASTLE, DASH, CASTLE]
    chunks = tokenizer.tokenize_weighted("cat " * 74 + "castle-castle")
    assert [len(chunk) for chunk in chunks] == [CHUNK_TOKENS + 2] * 2
    assert chunks[0] == [(49406, 1.0)] + [(CAT, 1.0)] * 74 + [(CASTLE, 1.0), (49407, 1.0)]
    assert chunks[1] == [(49406, 1.0), (DASH, 1.0), (CASTLE, 1.0)] + [(49407, 1.0)] * 74


def test_a_short_group_that_does_not_fit_moves_whole_to_the_next_chunk(tokenizer):
    chunks = tokenizer.tokenize_weighted("cat " * 74 + "(big red dog:1.2)")
    assert chunks[0] == [(49406, 1.0)] + [(CAT, 1.0)] * 74 + [(49407, 1.0)] * 2
    assert chunks[1] == [(49406, 1.0), (BIG, 1.2), (RED, 1.2), (DOG, 1.2)] + [(49407, 1.0)] * 73


def test_a_group_of_8_tokens_is_cut_and_one_longer_than_a_chunk_fills_chunks(tokenizer):
    eight = "(cat cat cat cat cat cat cat cat:1.5)"
    chunks = tokenizer.tokenize_weighted("cat " * 70 + eight)
    assert _prompt_tokens(chunks[0]) == [CAT] * 75 and [w for _, w in chunks[0][71:76]] == [1.5] * 5
    assert chunks[1][:5] == [(49406, 1.0), (CAT, 1.5), (CAT, 1.5), (CAT, 1.5), (49407, 1.0)]
    huge = tokenizer.tokenize_weighted("-".join(["abc"] * 50))  # 99 tokens
    assert [len(_prompt_tokens(chunk)) for chunk in huge] == [75, 24]
    word = "-".join(["abc"] * 60)  # 119 tokens, no spaces
    chunks = tokenizer.tokenize_weighted("cat " + word)
    assert _prompt_tokens(chunks[0]) + _prompt_tokens(chunks[1]) == [CAT] + tokenizer.encode(word)
    assert len(_prompt_tokens(chunks[0])) == CHUNK_TOKENS


def test_weights_travel_with_their_tokens_and_square_brackets_are_text(tokenizer):
    (chunk,) = tokenizer.tokenize_weighted("a (red:1.5) [dog]")
    assert chunk[:9] == [(49406, 1.0), (320, 1.0), (RED, 1.5), (314, 1.0), (DOG, 1.0), (316, 1.0),
                         (49407, 1.0), (49407, 1.0), (49407, 1.0)]
    (chunk,) = tokenizer.tokenize_weighted("(a:1.2) ((b))")
    assert chunk[:4] == [(49406, 1.0), (320, 1.2), (321, pytest.approx(1.21)), (49407, 1.0)]
    (chunk,) = tokenizer.tokenize_weighted(r"\(a\) \[x")
    assert _prompt_tokens(chunk) == [263, 320, 264, 59, 314, 343]  # '(' 'a' ')' '\\' '[' 'x'


def test_embedding_reference_becomes_its_vectors_with_weight(tokenizer):
    vectors = torch.randn(3, 768)
    looked_up = []

    def lookup(name: str) -> torch.Tensor | None:
        looked_up.append(name)
        return vectors if name == "style" else None

    (chunk,) = tokenizer.tokenize_weighted("a cat, (embedding:style.pt:1.2), embedding:style", lookup)
    body = _prompt_tokens(chunk)
    cat = tokenizer.encode("a cat,")
    assert body[:len(cat)] == cat
    first = chunk[1 + len(cat):1 + len(cat) + 3]
    assert all(isinstance(token, EmbeddingVector) for token, _ in first)
    assert [token.index for token, _ in first] == [0, 1, 2]
    assert all(torch.equal(token.vector, vectors[i]) for i, (token, _) in enumerate(first))
    assert [w for _, w in first] == [1.2, 1.2, 1.2]
    assert looked_up == ["style", "style"]
    assert len(body) == len(cat) + 3 + 1 + 3  # the comma between the two references is text


def test_unknown_embedding_warns_and_is_dropped(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="sluice.tokenizer"):
        prompt = "a embedding:missing cat, embedding:gone, dog"
        (chunk,) = tokenizer.tokenize_weighted(prompt, lambda name: None)
    assert "'missing' not found" in caplog.text and "'gone' not found" in caplog.text
    assert _prompt_tokens(chunk) == [320, CAT, 267, 267, DOG]  # 'a' 'cat' ',' then the leftover ',' 'dog'


def test_without_an_embedding_lookup_the_reference_is_text(tokenizer):
    (chunk,) = tokenizer.tokenize_weighted("embedding:missing cat")
    assert _prompt_tokens(chunk) == [19703, 796, 281, 3423, CAT]

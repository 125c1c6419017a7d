"""tools/shapes_dataset.py's captions: the wordings people type, colour synonyms CLIP's tokenizer knows, and
held-out wordings that training captions never use (the judge's "unseen wordings")."""

from __future__ import annotations

import random
import re

from engine.models.tokenizer import CLIPTokenizer
from tools.shapes_dataset import (
    COLOR_SYNONYMS,
    COLORS,
    HELD_OUT_TEMPLATES,
    PREFIXES,
    SIZE_WORDS,
    TRAINING_TEMPLATES,
    caption,
    names_size,
    random_scene,
)

COLOR_WORDS = "|".join([*COLORS, *(w for words in COLOR_SYNONYMS.values() for w in words)])


def template_pattern(template: str) -> re.Pattern:
    """A regex matching every caption that `template` can make."""
    text = re.escape(template)
    for field, pattern in (("body", ".+"), ("a_bg", "an?"), ("bg", f"(?:{COLOR_WORDS})")):
        text = text.replace(re.escape("{" + field + "}"), pattern)
    return re.compile(f"^{text}$")


def training_captions(count: int) -> list[str]:
    """Captions as tools/train_embedded_model.py makes them: caption(scene, rng), in the training wordings."""
    rng = random.Random(0)
    return [caption(random_scene(rng), rng) for _ in range(count)]


def test_training_captions_never_use_a_held_out_wording():
    patterns = [template_pattern(t) for t in HELD_OUT_TEMPLATES]
    captions = training_captions(3000)
    assert not [c for c in captions if any(p.match(c) for p in patterns)]
    rng = random.Random(0)
    held_out = [caption(random_scene(rng, max_shapes=1), rng, held_out_wording=True) for _ in range(200)]
    assert all(any(p.match(c) for p in patterns) for c in held_out)


def test_training_captions_use_every_wording_both_orders_prefixes_and_synonyms():
    captions = training_captions(3000)
    patterns = [template_pattern(t) for t in TRAINING_TEMPLATES]
    for pattern in patterns:
        assert any(pattern.match(c) for c in captions), pattern.pattern
    assert any(c.startswith("draw ") for c in captions)
    assert any(c.startswith("a picture of ") for c in captions)
    assert any(re.match(f"^(?:{COLOR_WORDS}) background", c) for c in captions)  # background named first
    words = set(" ".join(captions).replace(",", " ").replace(".", " ").split())
    assert {w for synonyms in COLOR_SYNONYMS.values() for w in synonyms} <= words
    assert {w for sizes in SIZE_WORDS.values() for w in sizes} <= words


def test_a_prefix_never_precedes_a_sentence_that_starts_with_the_or_on():
    captions = training_captions(3000)
    assert not [c for c in captions for prefix in PREFIXES if c.startswith((prefix + "the ", prefix + "on "))]


def test_colour_synonyms_and_size_words_are_single_clip_tokens():
    tokenizer = CLIPTokenizer(pad_with="eos")
    words = [*COLORS, *(w for s in COLOR_SYNONYMS.values() for w in s),
             *(w for s in SIZE_WORDS.values() for w in s)]
    assert {word: len(tokenizer.encode(word)) for word in words} == dict.fromkeys(words, 1)
    assert len({tokenizer.encode(word)[0] for word in words}) == len(words)


def test_names_size_reads_every_size_word():
    assert names_size("a tiny red circle on blue") and names_size("big red circle, blue background")
    assert not names_size("a red circle in the center on a blue background")

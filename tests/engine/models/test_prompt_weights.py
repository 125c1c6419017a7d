"""Emphasis parsing against ComfyUI's behaviour (comfy/sd1_clip.py token_weights), written down by hand."""

from __future__ import annotations

import pytest

from engine.models.prompt_weights import (
    parse_prompt_weights,
    split_embedding_pieces,
    take_embedding_reference,
)


def _check(text: str, expected: list[tuple[str, float]]):
    parsed = parse_prompt_weights(text)
    assert [segment for segment, _ in parsed] == [segment for segment, _ in expected]
    assert [weight for _, weight in parsed] == pytest.approx([weight for _, weight in expected])


def test_plain_text_is_one_segment_of_weight_one():
    _check("a photo of a cat", [("a photo of a cat", 1.0)])


def test_empty_text_has_no_segments():
    assert parse_prompt_weights("") == []
    assert parse_prompt_weights("()") == []


def test_explicit_weight():
    _check("a (red:1.2) car", [("a ", 1.0), ("red", 1.2), (" car", 1.0)])


def test_explicit_weight_is_read_as_a_python_float():
    _check("(a: 0.5 )(b:-1)(c:.25)(d:1e1)", [("a", 0.5), ("b", -1.0), ("c", 0.25), ("d", 10.0)])


def test_weight_and_double_parentheses():
    _check("(a:1.2) ((b))", [("a", 1.2), (" ", 1.0), ("b", 1.1 ** 2)])


def test_square_brackets_are_plain_text():
    _check("[word]", [("[word]", 1.0)])
    _check("(a) [b]", [("a", 1.1), (" [b]", 1.0)])
    _check("[a:1.2]", [("[a:1.2]", 1.0)])


def test_explicit_weight_replaces_the_enclosing_weight():
    _check("((a:1.5))", [("a", 1.5)])
    _check("((a:1.5) b)", [("a", 1.5), (" b", 1.1)])
    _check("(a (b (c)))", [("a ", 1.1), ("b ", 1.1 ** 2), ("c", 1.1 ** 3)])


def test_segments_of_equal_weight_are_not_merged():
    _check("(a)(b) c", [("a", 1.1), ("b", 1.1), (" c", 1.0)])


def test_escaped_parentheses_are_literal_and_keep_the_enclosing_weight():
    _check(r"\(a\) b", [("(a) b", 1.0)])
    _check(r"(\(a\):1.3)", [("(a)", 1.3)])
    _check(r"\[b\] back\\slash", [(r"\[b\] back\\slash", 1.0)])  # no other escapes: backslashes stay


def test_unbalanced_parentheses_follow_comfyuis_depth_count():
    _check("(a", [("(a", 1.0)])
    _check("a)", [("a)", 1.0)])
    _check("a) (b)", [("a) (b)", 1.0)])  # the stray ')' leaves the depth at -1: the rest is text
    _check("((a)", [("(a", 1.1)])  # the outer group never closes but the text ends with ')': weighted
    _check("(a (b)", [("a ", 1.1), ("(b", 1.1)])  # still open at the end but ends with ')': weighted
    _check("(a]", [("(a]", 1.0)])


def test_colon_without_a_number_is_text():
    _check("(style: oil)", [("style: oil", 1.1)])
    _check("(:1.5)", [(":1.5", 1.1)])  # a colon at the start is not a weight
    _check("embedding:name", [("embedding:name", 1.0)])


def test_weighted_embedding_reference_keeps_its_colon():
    _check("(embedding:foo.pt:1.2), x", [("embedding:foo.pt", 1.2), (", x", 1.0)])


def test_embedding_pieces_split_at_a_space_or_newline_before_the_prefix():
    assert split_embedding_pieces("a cat embedding:x dog") == ["a cat", "embedding:x dog"]
    assert split_embedding_pieces("embedding:x\nembedding:y") == ["embedding:x", "embedding:y"]
    assert split_embedding_pieces("a,embedding:x") == ["a,embedding:x"]  # no separator: text
    assert split_embedding_pieces(" embedding:x") == ["embedding:x"]


def test_embedding_reference_name_leftover_and_comma_retry():
    known = {"x": "X"}
    assert take_embedding_reference("embedding:x dog  cat", known.get) == ("X", "x", "dog cat")
    assert take_embedding_reference("embedding:x,", known.get) == ("X", "x", ", ")
    assert take_embedding_reference("embedding:y, dog", known.get) == (None, "y", ", dog")
    assert take_embedding_reference("embedding:y dog", known.get) == (None, "y", "dog")

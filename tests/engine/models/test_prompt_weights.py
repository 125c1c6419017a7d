"""Emphasis parsing: A1111/ComfyUI weights, nesting, escapes, unbalanced brackets."""

from __future__ import annotations

import pytest

from engine.models.prompt_weights import parse_prompt_weights


def _check(text: str, expected: list[tuple[str, float]]):
    parsed = parse_prompt_weights(text)
    assert [segment for segment, _ in parsed] == [segment for segment, _ in expected]
    assert [weight for _, weight in parsed] == pytest.approx([weight for _, weight in expected])


def test_plain_text_is_one_segment_of_weight_one():
    _check("a photo of a cat", [("a photo of a cat", 1.0)])


def test_empty_text_has_no_segments():
    assert parse_prompt_weights("") == []


def test_explicit_weight():
    _check("a (red:1.2) car", [("a ", 1.0), ("red", 1.2), (" car", 1.0)])


def test_explicit_weight_allows_spaces_signs_and_leading_dot():
    _check("(a: 0.5 )(b:-1)(c:.25)", [("a", 0.5), ("b", -1.0), ("c", 0.25)])


def test_parentheses_multiply_by_1_1_and_square_brackets_divide():
    _check("(a) [b]", [("a", 1.1), (" ", 1.0), ("b", 1 / 1.1)])


def test_nesting_multiplies():
    _check("((a))", [("a", 1.1 ** 2)])
    _check("[[[a]]]", [("a", 1.1 ** -3)])
    _check("((a:1.5) b)", [("a", 1.1 * 1.5), (" b", 1.1)])
    _check("(a [b (c:2)])", [("a ", 1.1), ("b ", 1.1 / 1.1), ("c", 1.1 / 1.1 * 2)])


def test_adjacent_segments_of_equal_weight_merge():
    _check("(a)(b) c", [("ab", 1.1), (" c", 1.0)])


def test_escaped_brackets_are_literal_and_keep_the_enclosing_weight():
    _check(r"\(a\) \[b\]", [("(a) [b]", 1.0)])
    _check(r"(\(a\):1.3)", [("(a)", 1.3)])
    _check(r"back\\slash", [("back\\slash", 1.0)])


def test_unbalanced_brackets_are_literal_text():
    _check("(a", [("(a", 1.0)])
    _check("a)", [("a)", 1.0)])
    _check("((a)", [("(", 1.0), ("a", 1.1)])
    _check("[a:1.2)", [("[a:1.2)", 1.0)])
    _check("(a]", [("(a]", 1.0)])


def test_colon_without_a_number_is_text():
    _check("(style: oil)", [("style: oil", 1.1)])
    _check("embedding:name", [("embedding:name", 1.0)])


def test_weighted_embedding_reference_keeps_its_colon():
    _check("(embedding:foo.pt:1.2), x", [("embedding:foo.pt", 1.2), (", x", 1.0)])

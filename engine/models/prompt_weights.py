"""Prompt emphasis and embedding references exactly as ComfyUI reads them (comfy/sd1_clip.py).

- `(text)` multiplies the enclosing weight by 1.1; `((text))` is 1.21.
- `(text:1.2)` sets the weight to 1.2, whatever encloses it (`((a:1.5))` is 1.5, not 1.65). The weight is
  what follows the last colon, read as a Python float; a colon at the start or a non-number is text.
- `[text]` is plain text: the brackets stay, no weighting.
- `\\(` and `\\)` are literal parentheses; no other backslash sequence is special.
- Groups are cut at top level: a `(` at depth 0 opens one, the `)` that brings the depth back to 0 closes
  it. Unbalanced parentheses follow the same count: a stray `)` makes the depth negative (what follows is
  text until the count returns), and a group still open at the end is weighted only if the text ends
  with `)` (`(a (b)` is `a ` and `(b` at 1.1), else it is text.
- Segments are never merged: each is tokenized on its own.

`split_embedding_pieces` and `take_embedding_reference` split a segment at `embedding:NAME` references
the way ComfyUI's SDTokenizer does (shared by the CLIP and T5 tokenizers).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

ROUND_MULTIPLIER = 1.1
EMBEDDING_PREFIX = "embedding:"
_ESCAPES = (("\\)", "\0\1"), ("\\(", "\0\2"))  # escaped parenthesis -> placeholder while parsing
_EMBEDDING_SPLIT = re.compile(r"[ \n]embedding:")  # a reference starts the text or follows a space/newline

Found = TypeVar("Found")


def _top_level_groups(text: str) -> list[str]:
    """Cut `text` at depth-0 parentheses: plain runs and `(...)` groups, in order, none empty."""
    groups, current, depth = [], "", 0
    for char in text:
        if char == "(":
            if depth == 0 and current:
                groups.append(current)
                current = ""
            current += char
            depth += 1
        elif char == ")":
            depth -= 1
            current += char
            if depth == 0:
                groups.append(current)
                current = ""
        else:
            current += char
    if current:
        groups.append(current)
    return groups


def _weighted_segments(text: str, weight: float) -> list[tuple[str, float]]:
    segments = []
    for group in _top_level_groups(text):
        if not (len(group) >= 2 and group[0] == "(" and group[-1] == ")"):
            segments.append((group, weight))
            continue
        inner, inner_weight = group[1:-1], weight * ROUND_MULTIPLIER
        colon = inner.rfind(":")
        if colon > 0:
            try:
                inner_weight = float(inner[colon + 1:])
                inner = inner[:colon]
            except ValueError:
                pass  # not a number: the colon is text
        segments.extend(_weighted_segments(inner, inner_weight))
    return segments


def _escape(text: str) -> str:
    for escaped, placeholder in _ESCAPES:
        text = text.replace(escaped, placeholder)
    return text


def _unescape(text: str) -> str:
    for escaped, placeholder in _ESCAPES:
        text = text.replace(placeholder, escaped[1])
    return text


def parse_prompt_weights(text: str) -> list[tuple[str, float]]:
    """Split `text` into (segment, weight) runs in order, escapes resolved; empty text gives []."""
    return [(_unescape(segment), weight) for segment, weight in _weighted_segments(_escape(text), 1.0)]


def split_embedding_pieces(segment: str) -> list[str]:
    """Cut a segment before each `embedding:` that starts it or follows a space or newline (that separator
    is dropped); the pieces after the first start with `embedding:`. Empty pieces are left out."""
    first, *rest = _EMBEDDING_SPLIT.split(segment)
    return [piece for piece in (first, *(EMBEDDING_PREFIX + r for r in rest)) if piece]


def take_embedding_reference(piece: str, find: Callable[[str], Found | None]
                             ) -> tuple[Found | None, str, str]:
    """(what `find` gave, the name looked up, leftover text) for a piece starting with `embedding:`.

    The name is the first whitespace-separated word after the prefix; the leftover is the rest, joined by
    single spaces. A name not found is tried again without its surrounding commas, and the commas then
    lead the leftover (`embedding:x, cat` -> `x`, leftover `, cat`), found or not.
    """
    words = piece[len(EMBEDDING_PREFIX):].strip("\n").split()
    if not words:
        return None, "", ""
    name, leftover = words[0], " ".join(words[1:])
    found = find(name)
    stripped = name.strip(",")
    if found is None and len(stripped) < len(name):
        return find(stripped), stripped, f"{name[len(stripped):]} {leftover}"
    return found, name, leftover

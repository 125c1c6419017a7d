"""Prompt emphasis (A1111, ComfyUI): `(text:1.2)`, `(text)` = x1.1, `[text]` = /1.1; nesting multiplies.

`\\(`, `\\)`, `\\[`, `\\]` and `\\\\` are literal characters. A bracket without a partner is literal text,
so no prompt fails to parse. An explicit weight multiplies the enclosing weights (A1111's rule; ComfyUI
instead lets `((a:1.5))` be 1.5).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

ROUND_MULTIPLIER = 1.1
SQUARE_MULTIPLIER = 1 / 1.1

_LEXER = re.compile(
    r"""
      \\(?P<escaped>[()\[\]\\])                                  # escaped bracket or backslash: literal
    | :\s*(?P<weight>[+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*\)          # ':1.2)' closes a weighted group
    | (?P<bracket>[()\[\]])
    | [^\\()\[\]:]+                                              # plain text
    | [\\:]                                                      # a lone backslash or colon is literal
    """,
    re.VERBOSE,
)


@dataclass
class _Item:
    text: str  # the characters as written
    kind: str  # "text", "open" or "close"
    bracket: str = ""  # "(" or "[" for brackets (a closer names the opener it closes)
    weight: float | None = None  # the explicit weight of a ':1.2)' closer
    partner: int | None = None  # index of the matching bracket, None while unmatched


def _lex(text: str) -> list[_Item]:
    items = []
    for match in _LEXER.finditer(text):
        if match["escaped"] is not None:
            items.append(_Item(match["escaped"], "text"))
        elif match["weight"] is not None:
            items.append(_Item(match[0], "close", "(", float(match["weight"])))
        elif match["bracket"] in ("(", "["):
            items.append(_Item(match[0], "open", match[0]))
        elif match["bracket"] in (")", "]"):
            items.append(_Item(match[0], "close", "(" if match[0] == ")" else "["))
        else:
            items.append(_Item(match[0], "text"))
    return items


def _pair_brackets(items: list[_Item]) -> None:
    """Link each closer to the innermost open bracket of its kind; whatever stays unlinked is literal."""
    open_indexes: list[int] = []
    for index, item in enumerate(items):
        if item.kind == "open":
            open_indexes.append(index)
        elif item.kind == "close" and open_indexes and items[open_indexes[-1]].bracket == item.bracket:
            opener = open_indexes.pop()
            items[opener].partner, item.partner = index, opener


def _factor(closer: _Item) -> float:
    if closer.weight is not None:
        return closer.weight
    return ROUND_MULTIPLIER if closer.bracket == "(" else SQUARE_MULTIPLIER


def parse_prompt_weights(text: str) -> list[tuple[str, float]]:
    """Split `text` into (segment, weight) runs, merging neighbours of equal weight; empty text gives []."""
    items = _lex(text)
    _pair_brackets(items)
    segments: list[list] = []  # [text, weight] runs
    factors: list[float] = []  # one per open group, outermost first
    for item in items:
        if item.kind == "open" and item.partner is not None:
            factors.append(_factor(items[item.partner]))
            continue
        if item.kind == "close" and item.partner is not None:
            factors.pop()
            continue
        weight = math.prod(factors, start=1.0)
        if segments and segments[-1][1] == weight:
            segments[-1][0] += item.text
        else:
            segments.append([item.text, weight])
    return [(segment, weight) for segment, weight in segments]

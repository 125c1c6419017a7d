"""The one JSON reader for every file Sluice takes in: workflows, settings, the GUI's recovery file, PNG text
chunks. Each limit turns hostile or broken input into a JsonInputError that names the file and what is
accepted, instead of a RecursionError, OverflowError or a silent NaN deep inside the program.

Limits: MAX_BYTES of UTF-8 text, containers nested at most MAX_DEPTH deep, integers of at most
MAX_INT_DIGITS digits, finite numbers only (NaN, Infinity and floats that overflow to infinity are refused),
strings that are valid Unicode (no lone surrogates from "\\ud800" escapes, which could not be saved again).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

MAX_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 256  # arrays and objects inside each other; Sluice's own files use fewer than 10
MAX_INT_DIGITS = 40  # enough for any 128-bit seed; Python itself refuses over 4,300 digits with a ValueError
ACCEPTED = (f"UTF-8 JSON of at most {MAX_BYTES // (1024 * 1024)} MiB, nested at most {MAX_DEPTH} deep, "
            f"with finite numbers and integers of at most {MAX_INT_DIGITS} digits")


class JsonInputError(ValueError):
    """A file (or text) that is not JSON Sluice accepts; the message names it and what is accepted."""


class JsonSyntaxError(JsonInputError):
    """Text that is not JSON at all (as opposed to JSON over a limit); callers that take plain text too, such
    as `sluice run --set`, fall back to the text on this error only."""


class _Refused(Exception):
    """Raised by the parse hooks; load_json turns it into a JsonInputError."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]}{'...' if len(text) > 40 else ''} (too large for a float)")
    return value


def _parse_constant(name: str) -> Any:
    raise _Refused(f"the non-finite number {name}")


def _check_depth_and_strings(data: Any) -> str | None:
    """What is wrong with the parsed value (too deep, a string that is not valid Unicode), or None.
    Walks with an explicit stack: no recursion, whatever the input."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            items: Any = ()
            strings: Any = (value,)
        elif isinstance(value, dict):
            items, strings = value.values(), value.keys()
        elif isinstance(value, list):
            items, strings = value, ()
        else:
            continue
        if depth > MAX_DEPTH and not isinstance(value, str):
            return f"containers nested deeper than {MAX_DEPTH} levels"
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return f"a string with an unpaired surrogate escape ({text[:40]!r})"
        stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list, str)))
    return None


def load_json(content: str | bytes, what: str) -> Any:
    """Parse `content` (text, or bytes that must be UTF-8; a leading BOM is skipped) as JSON within the limits
    above. `what` names the source in errors, e.g. "workflow /path/a.json". Raises JsonInputError."""
    if len(content) > MAX_BYTES:
        raise JsonInputError(f"{what}: {len(content)} bytes is too large; accepted: {ACCEPTED}")
    if isinstance(content, (bytes, bytearray)):
        try:
            content = bytes(content).decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise JsonInputError(f"{what}: not UTF-8 text (byte 0x{content[error.start]:02x} at offset "
                                 f"{error.start}); accepted: {ACCEPTED}") from None
    elif content.startswith("\ufeff"):
        content = content[1:]
    try:
        data = json.loads(content, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_parse_constant)
    except json.JSONDecodeError as error:
        raise JsonSyntaxError(f"{what}: invalid JSON at line {error.lineno}, column {error.colno}: "
                             f"{error.msg}") from None
    except _Refused as error:
        raise JsonInputError(f"{what}: holds {error}; accepted: {ACCEPTED}") from None
    except RecursionError:
        raise JsonInputError(f"{what}: holds containers nested deeper than {MAX_DEPTH} levels; "
                             f"accepted: {ACCEPTED}") from None
    problem = _check_depth_and_strings(data)
    if problem is not None:
        raise JsonInputError(f"{what}: holds {problem}; accepted: {ACCEPTED}")
    return data


def read_json_file(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON in the file at `path`, read through load_json; a file over MAX_BYTES is refused before it is
    read. `what` names the kind of file ("settings file"); errors name it and the path. Raises JsonInputError
    (also for a file that cannot be read: missing, a folder, no permission)."""
    name = f"{what} {os.fspath(path)}"
    try:
        with open(path, "rb") as handle:
            content = handle.read(MAX_BYTES + 1)
    except OSError as error:
        raise JsonInputError(f"cannot read {name}: {error.strerror or error}") from None
    return load_json(content, name)


"""Images that come back from workers, written into the local output folder: never overwriting, under the
name SaveImage gave them (its prefix, a fresh counter), with the swept overrides added as a PNG text chunk
("sluice-overrides", JSON) beside the workflow chunks the worker's SaveImage wrote."""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path
from typing import Any

from engine.new_files import create_file

OVERRIDES_CHUNK = "sluice-overrides"
_COUNTER = re.compile(r"^(?P<prefix>.+)_\d{5,}_(?P<extension>\.[A-Za-z0-9]+)$")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def with_text_chunk(png: bytes, key: str, text: str) -> bytes:
    """`png` with a tEXt chunk (`key`, Latin-1 `text`) before its IEND chunk; the pixels are untouched."""
    if not png.startswith(_PNG_SIGNATURE) or png[-8:-4] != b"IEND":
        raise ValueError("not a PNG file ending in an IEND chunk")
    body = b"tEXt" + key.encode("latin-1") + b"\0" + text.encode("latin-1")
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    return png[:-12] + chunk + png[-12:]


def write_image(settings: Any, name: str, data: bytes, overrides: dict[str, str]) -> Path:
    """Write one returned image as a new file in `settings.output_dir`; returns its path.

    `name` is the worker's (`folder/prefix_00001_.png`): the prefix is kept and the counter is the next free
    one here. The file is created exclusively, so a name taken meanwhile (another run) moves on to the next.
    """
    match = _COUNTER.match(name)
    prefix, extension = (match.group("prefix"), match.group("extension")) if match else (name, ".png")
    if extension == ".png" and overrides:
        data = with_text_chunk(data, OVERRIDES_CHUNK, json.dumps(overrides))
    while True:
        path = settings.output_path(prefix, extension)
        try:
            return create_file(path, data)
        except FileExistsError:
            continue

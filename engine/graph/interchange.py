"""Open any workflow file Sluice understands: Sluice JSON, ComfyUI UI or API JSON, or a PNG that embeds one.

PNG text chunks: ComfyUI writes its UI workflow in "workflow" and its API prompt in "prompt"; Sluice writes
those two and its own document in "sluice-workflow" (earlier versions wrote only their own document, in
"workflow"). They are read in the order of PNG_CHUNKS: Sluice's document when there is one (it keeps
everything), then "workflow" (positions and groups), then "prompt"; a chunk that cannot be read gives a
warning and the next one is tried.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from engine.graph.comfy import Lookup, from_comfy_api, from_comfy_ui, is_comfy_api, is_comfy_ui
from engine.graph.document import FORMAT, Workflow
from engine.graph.errors import WorkflowError
from engine.jsonfile import JsonInputError, load_json

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_CHUNKS = ("sluice-workflow", "workflow", "prompt")  # text chunks that hold a workflow, in reading order


def load_any(source: str | os.PathLike[str] | bytes, lookup: Lookup) -> tuple[Workflow, list[str]]:
    """The workflow in `source` (a path, JSON text, or file bytes) in any supported format, and warnings.

    A str that starts with "{" is JSON text; any other str is a path."""
    if isinstance(source, str) and source.lstrip().startswith("{"):
        return from_json_text(source, lookup)
    if isinstance(source, bytes):
        name, content = "<bytes>", source
    else:
        name = str(source)
        try:
            content = Path(source).read_bytes()
        except OSError as error:
            raise WorkflowError(f"cannot read workflow {name!r}: {error.strerror or error}") from None
    if content.startswith(PNG_SIGNATURE):
        return from_png(content, lookup, name)
    return from_json_text(content, lookup, name)


def from_json_text(text: str | bytes, lookup: Lookup, source: str = "<string>") -> tuple[Workflow, list[str]]:
    """The workflow in JSON `text` (bytes must be UTF-8), read through engine.jsonfile's limits."""
    try:
        data = load_json(text, source)
    except JsonInputError as error:
        raise WorkflowError(str(error)) from None
    try:
        return from_data(data, lookup)
    except WorkflowError as error:
        raise WorkflowError(f"{source}: {error}") from None


def from_data(data: Any, lookup: Lookup) -> tuple[Workflow, list[str]]:
    """Detect the format of parsed JSON and read it."""
    if isinstance(data, dict) and "format" in data:
        return Workflow.from_dict(data), []
    if is_comfy_ui(data):
        return from_comfy_ui(data, lookup)
    if is_comfy_api(data):
        return from_comfy_api(data, lookup)
    if isinstance(data, dict) and is_comfy_api(data.get("prompt")):  # the body of a POST to ComfyUI's /prompt
        return from_comfy_api(data["prompt"], lookup)
    found = f"an object with keys {', '.join(map(repr, list(data)[:8]))}" if isinstance(data, dict) \
        else f"a JSON {type(data).__name__}"
    raise WorkflowError(f"not a workflow Sluice can read (found {found}); accepted: a Sluice workflow "
                        f"(\"format\": {FORMAT!r}), a ComfyUI workflow (\"nodes\" and \"links\"), or a "
                        f"ComfyUI API prompt (nodes with \"class_type\")")


def from_png(content: bytes, lookup: Lookup, source: str = "<png>") -> tuple[Workflow, list[str]]:
    """The workflow embedded in a PNG's "sluice-workflow", "workflow" (ComfyUI UI, or Sluice in older files)
    or "prompt" (ComfyUI API) chunk."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(content)) as image:
            chunks = dict(getattr(image, "text", {}))
    except (OSError, UnidentifiedImageError, SyntaxError) as error:
        raise WorkflowError(f"{source}: cannot read the PNG: {error}") from None
    warnings: list[str] = []
    present = [key for key in PNG_CHUNKS if key in chunks]
    for index, key in enumerate(present):
        try:
            workflow, found = from_json_text(chunks[key], lookup, f"{source} (text chunk {key!r})")
        except WorkflowError as error:
            if index == len(present) - 1:
                raise
            warnings.append(f"{error}; read the {present[index + 1]!r} chunk instead")
            continue
        return workflow, warnings + found
    shown = ", ".join(repr(key) for key in chunks) or "none"
    raise WorkflowError(f"{source}: the PNG holds no workflow; expected a "
                        f"{', '.join(repr(key) for key in PNG_CHUNKS)} text chunk, found: {shown}")

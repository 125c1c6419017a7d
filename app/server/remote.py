"""The client side of ComfyUI's API, shared by the two clients of a running `sluice serve` (or ComfyUI):
`sluice run --server` (client.py) and the desktop app's queue (app/server_worker.py).

The server's base URL, the auth header, the websocket's URL and messages, ComfyUI's binary preview frames,
the problems of a refused prompt, and where a downloaded image is kept. Never imports Qt.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

from PIL import Image

from app.server.files import PathRefused, check_file_name, free_name, subfolder_path
from engine.jsonfile import JsonInputError, load_json
from engine.new_files import create_file

PREVIEW_IMAGE = 1  # ComfyUI's BinaryEventTypes.PREVIEW_IMAGE (app/server/engine_thread.py sends it)


def server_url(text: str) -> str:
    """'host:port' or 'http(s)://host:port[/prefix]' -> the base URL without a trailing slash."""
    text = text.strip().rstrip("/")
    return text if text.startswith(("http://", "https://")) else f"http://{text}"


def auth_headers(token: str | None) -> dict[str, str]:
    """The header every request to a server with an auth token carries."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def websocket_url(base: str, client_id: str) -> str:
    """The websocket (`/ws?clientId=ID`) of the server at `base`, where the prompts of `client_id` report."""
    return base.replace("http", "ws", 1) + f"/ws?clientId={client_id}"


def parse_message(text: str) -> tuple[str, dict[str, Any]] | None:
    """A websocket text message as (type, data); None when it is not one of ComfyUI's protocol."""
    try:
        parsed = load_json(text, "a websocket message from the server")
    except JsonInputError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("type"), str) or \
            not isinstance(parsed.get("data") or {}, dict):
        return None
    return parsed["type"], parsed.get("data") or {}


def preview_image(frame: bytes) -> Image.Image | None:
    """The image of a binary preview frame (event 1, the format word, then the JPEG or PNG); None for other
    binary messages or an undecodable image."""
    if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != PREVIEW_IMAGE:
        return None
    try:
        image = Image.open(io.BytesIO(frame[8:]))
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    return image


def prompt_problems(body: Any) -> tuple[str, list[tuple[str, str | None, str]]]:
    """What a 400 answer to POST /prompt says: the summary, and (node id, class type, problem) per node."""
    error = body.get("error", {}) if isinstance(body, dict) else {}
    node_errors = (body.get("node_errors") or {}) if isinstance(body, dict) else {}
    summary = str(error.get("message", body)) if isinstance(error, dict) else str(body)
    if isinstance(error, dict) and error.get("details") and not node_errors:
        summary += f" ({error['details']})"
    problems = []
    for node_id, entry in node_errors.items():
        for problem in entry.get("errors", []):
            problems.append((str(node_id), entry.get("class_type"),
                             f"{problem.get('message')}: {problem.get('details')}"))
    return summary, problems


def keep_image(root: Path, subfolder: str, filename: str, data: bytes) -> Path:
    """Write a downloaded image into the local folder `root` under the server's subfolder and name (names
    from the server are checked like a request's); an existing file with the same bytes is kept as it is,
    a different one is never replaced ('name (1).png')."""
    try:
        folder = subfolder_path(root, subfolder)
    except PathRefused:
        folder = root
    try:
        name = check_file_name(filename)
    except PathRefused:
        name = "image.png"
    path = folder / name
    if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        candidate = folder / free_name(folder, name)
        try:
            return create_file(candidate, data)
        except FileExistsError:
            continue

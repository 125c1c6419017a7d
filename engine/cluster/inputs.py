"""The input-folder files a job reads, carried with it to its worker.

A node type names the widgets whose value is a file in the input folder (`NodeType.input_files`: LoadImage's
image, LoadLatent's latent). A worker's input folder is its own (on another host it cannot see the driver's,
and `sluice serve` keeps uploads in its own), so the driver reads those files here and the worker writes them
into its folder before the job runs. Absolute paths stay as they are: they name a file on the worker's host,
as in `sluice run`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any


def relative_input_name(name: str) -> PurePosixPath | None:
    """`name` as a path inside an input folder, or None when it is absolute, empty or climbs out of it."""
    if not isinstance(name, str) or not name.strip() or name.startswith(("/", "\\", "~")):
        return None
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or Path(name).is_absolute():
        return None
    return path


def job_inputs(workflow: Any, lookup: Callable[[str], Any], folder: Path) -> dict[str, bytes]:
    """{name: bytes} of each input-folder file that the workflow's active nodes name and that exists in
    `folder`; a missing file, or a link leading out of the folder, is left out, and the worker's run reports
    it as a local run would."""
    files: dict[str, bytes] = {}
    root = folder.resolve()
    for node in workflow.nodes.values():
        if node.mode != "normal":
            continue
        for widget in getattr(lookup(node.type), "input_files", ()):  # an unknown type: None, no files
            name = node.widgets.get(widget)
            relative = relative_input_name(name) if isinstance(name, str) else None
            if relative is None or name in files:
                continue
            path = (root / relative).resolve()
            if path.is_relative_to(root) and path.is_file():  # a link out of the folder: the worker says so
                files[name] = path.read_bytes()
    return files


def write_inputs(folder: Path, files: Mapping[str, bytes]) -> None:
    """Write each file under `folder` (a name that would leave it is refused with ValueError); a file that
    already holds the same bytes is left alone, so that its modification time, part of the loader's cache
    key, stays and a repeated job finds its results cached."""
    for name, data in files.items():
        relative = relative_input_name(name)
        if relative is None:
            raise ValueError(f"input file {name!r} is not a name inside the input folder")
        path = folder / relative
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_bytes(data)
        partial.replace(path)

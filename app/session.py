"""What the app keeps between runs: its data folder and QSettings file, recent files, the autosaved
recovery file and the clean-exit mark, and reading a workflow from a JSON file or a PNG that embeds one."""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QSettings, QStandardPaths

from engine.graph.document import FORMAT, Workflow
from engine.graph.errors import WorkflowError
from engine.jsonfile import JsonInputError, read_json_file

RECENT_LIMIT = 10
PNG_WORKFLOW_KEYS = ("sluice-workflow", "workflow", "prompt")  # text chunks that may hold a workflow


def app_data_dir() -> Path:
    """`SLUICE_APP_DATA`, else Qt's AppDataLocation; created when missing."""
    folder = os.environ.get("SLUICE_APP_DATA") or QStandardPaths.writableLocation(
        QStandardPaths.StandardLocation.AppDataLocation)
    path = Path(folder or Path.home() / ".local" / "share" / "sluice")
    path.mkdir(parents=True, exist_ok=True)
    return path


def app_settings() -> QSettings:
    """The app's QSettings, an INI file in the app data folder (so tests can isolate it)."""
    return QSettings(str(app_data_dir() / "sluice.ini"), QSettings.Format.IniFormat)


def recent_files(settings: QSettings) -> list[str]:
    value = settings.value("files/recent", [])
    if isinstance(value, str):
        value = [value]
    return [str(v) for v in (value or [])]


def add_recent_file(settings: QSettings, path: str) -> list[str]:
    path = str(Path(path).resolve())
    files = [path] + [p for p in recent_files(settings) if p != path]
    settings.setValue("files/recent", files[:RECENT_LIMIT])
    return files[:RECENT_LIMIT]


class RecoveryStore:
    """The autosave file: the open document and the file it belongs to, written atomically.

    A clean exit records its time in QSettings and deletes the file; a recovery file newer than the last
    clean exit means the app ended without one (a crash), so the next start offers to restore it.
    """

    def __init__(self, folder: Path, settings: QSettings) -> None:
        self.path = folder / "recovery.json"
        self.settings = settings

    def write(self, workflow: Workflow, file_path: str | None) -> None:
        data = {"file": file_path, "saved_at": time.time(), "workflow": workflow.to_dict()}
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(data), encoding="utf-8")
        os.replace(temporary, self.path)

    def should_offer(self) -> bool:
        if not self.path.is_file():
            return False
        clean_exit = float(self.settings.value("session/clean_exit", 0.0) or 0.0)
        return self.path.stat().st_mtime > clean_exit

    def read(self) -> tuple[Workflow, str | None]:
        """The saved document and its file path; WorkflowError when the file is unreadable."""
        try:
            data = read_json_file(self.path, "the recovery file")
        except JsonInputError as error:
            raise WorkflowError(str(error)) from None
        if not isinstance(data, dict) or "workflow" not in data:
            raise WorkflowError(f"the recovery file {self.path} holds no workflow")
        file_path = data.get("file")
        if file_path is not None and not isinstance(file_path, str):
            raise WorkflowError(f"the recovery file {self.path}: \"file\" must be a path or null, "
                                f"got {file_path!r}")
        try:
            return Workflow.from_dict(data["workflow"]), file_path
        except WorkflowError as error:
            raise WorkflowError(f"the recovery file {self.path}: {error}") from None

    def set_aside(self) -> Path:
        """Rename an unreadable recovery file to recovery.json.bad (replacing an older one), so that it is
        neither offered again nor lost; returns the new path."""
        bad = self.path.with_name(self.path.name + ".bad")
        os.replace(self.path, bad)
        return bad

    def mark_clean_exit(self) -> None:
        if self.path.exists():
            self.path.unlink()
        self.settings.setValue("session/clean_exit", time.time())
        self.settings.sync()


def _png_workflow_text(path: Path) -> str:
    from PIL import Image

    try:
        with Image.open(path) as image:
            info = dict(getattr(image, "text", {}) or image.info)
    except OSError as error:
        raise WorkflowError(f"cannot read image {str(path)!r}: {error}") from None
    for key in PNG_WORKFLOW_KEYS:
        if isinstance(info.get(key), str):
            return info[key]
    raise WorkflowError(f"image {str(path)!r} has no embedded workflow (looked for text chunks "
                        f"{', '.join(PNG_WORKFLOW_KEYS)})")


def is_native_workflow_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a Sluice workflow JSON (which Save may overwrite), not an import or an image."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        return False
    try:
        data = read_json_file(path, "workflow")
    except JsonInputError:
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def load_workflow_file(path: str | os.PathLike[str],
                       lookup: Callable[[str], Any]) -> tuple[Workflow, list[str]]:
    """A workflow and import warnings from a Sluice JSON file, a ComfyUI file (through
    engine.graph.interchange when it is there) or a PNG with an embedded workflow. Raises WorkflowError."""
    path = Path(path)
    try:
        interchange = importlib.import_module("engine.graph.interchange")
    except ModuleNotFoundError:
        interchange = None
    if interchange is not None and hasattr(interchange, "load_any"):
        workflow, warnings = interchange.load_any(path, lookup)
        return workflow, list(warnings)
    if path.suffix.lower() == ".png":
        return Workflow.loads(_png_workflow_text(path), source=str(path)), []
    return Workflow.load(path), []

"""Image nodes under hostile conditions: a preview folder planted by another local user, output prefixes
with control characters."""

import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

import nodes.image as image_nodes
from engine import telemetry
from engine.graph.document import Workflow
from engine.graph.spec import RunContext
from engine.settings import Settings

IMAGES = torch.rand(1, 8, 8, 3)  # (B, H, W, RGB)


def _preview(settings: Settings) -> list[Path]:
    events = telemetry.EventRecorder(telemetry.bus)
    try:
        image_nodes.PreviewImage().run(RunContext("1", settings=settings, workflow=Workflow()), IMAGES)
    finally:
        telemetry.bus._subscribers.remove(events)
    return [Path(e["path"]) for e in events.of_kind("image_preview")]


def _assert_private(folder: Path) -> None:
    info = os.lstat(folder)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & 0o077 == 0


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A temporary folder standing for /tmp, which every local user can write."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return shared


@pytest.mark.parametrize("planted", ["symlink", "world-writable folder"])
def test_preview_image_never_writes_through_a_folder_another_user_planted(tmp_path, shared_tmp, planted):
    victim = tmp_path / "victim"
    victim.mkdir()
    (shared_tmp / "sluice").mkdir()  # the fixed shared path of earlier versions, redirected
    (shared_tmp / "sluice" / "previews").symlink_to(victim)
    per_user = shared_tmp / f"sluice-{os.getuid()}"
    if planted == "symlink":
        per_user.symlink_to(victim)
    else:
        per_user.mkdir()
        per_user.chmod(0o777)
    settings = Settings(models_root=tmp_path / "models", output_dir=tmp_path / "output", plugins_dir=None)
    [path] = _preview(settings)
    assert list(victim.iterdir()) == []
    assert path.is_file() and not path.is_symlink()
    _assert_private(path.parent)
    assert path.parent.resolve() == path.parent  # no link on the way


def test_preview_image_uses_one_private_folder_per_user(tmp_path, shared_tmp):
    settings = Settings(models_root=tmp_path / "models", output_dir=tmp_path / "output", plugins_dir=None)
    [first] = _preview(settings)
    [second] = _preview(settings)
    assert first.parent == second.parent == shared_tmp / f"sluice-{os.getuid()}" / "previews"
    assert first != second
    _assert_private(first.parent)
    _assert_private(first.parent.parent)

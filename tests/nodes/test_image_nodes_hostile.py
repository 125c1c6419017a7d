"""Image nodes under hostile conditions: a preview folder planted by another local user, output prefixes
with control characters."""

import math
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

import nodes.image as image_nodes
from app.cli import print_saved_files
from engine import telemetry
from engine.graph.document import Workflow
from engine.graph.spec import RunContext, float_input
from engine.graph.validate import validate
from engine.settings import Settings, SettingsError
from nodes.registry import default_registry

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


def _errors_of(workflow: Workflow, node_id: str, input_name: str, tmp_path: Path) -> list[str]:
    settings = Settings(models_root=tmp_path / "models", output_dir=tmp_path / "output", plugins_dir=None)
    registry = default_registry(settings)
    return [e.message for e in validate(workflow, registry.get)
            if e.node_id == node_id and e.input_name == input_name]


@pytest.mark.parametrize("prefix", ["x\n/etc/passwd", "a\rb", "a\tb", "esc\x1b[2Jape", "del\x7f", "nul\0",
                                    "next-line\x85", "line\u2028sep"])
def test_save_image_refuses_a_prefix_with_control_characters_at_validation(tmp_path, prefix):
    workflow = Workflow()
    empty = workflow.add_node("LoadImage", {"image": "fox.png"})
    save = workflow.add_node("SaveImage", {"filename_prefix": prefix})
    workflow.connect(empty.id, 0, save.id, "images", "IMAGE")
    [message] = _errors_of(workflow, save.id, "filename_prefix", tmp_path)
    assert "control character" in message and repr(prefix) in message
    settings = Settings(models_root=tmp_path / "models", output_dir=tmp_path / "output", plugins_dir=None)
    with pytest.raises(SettingsError, match="control character"):
        settings.output_path(prefix, "png")  # a run that skipped validation refuses it too


@pytest.mark.parametrize("cfg", [math.nan, math.inf, -math.inf])
def test_non_finite_float_widgets_are_refused_at_validation(tmp_path, cfg):
    workflow = Workflow()
    sampler = workflow.add_node("KSampler", {"cfg": cfg})
    [message] = _errors_of(workflow, sampler.id, "cfg", tmp_path)
    assert f"{cfg!r} is not a finite number" in message
    assert float_input("strength", 1.0).check_value(cfg) == f"strength: {cfg!r} is not a finite number"


def test_the_printed_list_of_saved_files_shows_control_characters_escaped(capsys):
    print_saved_files(["out/a_00001_.png", "out/x\n/etc/passwd_00001_.png"])
    assert capsys.readouterr().out.splitlines() == ["out/a_00001_.png", "'out/x\\n/etc/passwd_00001_.png'"]

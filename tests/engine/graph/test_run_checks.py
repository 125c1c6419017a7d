"""Validation refuses what the run would refuse only after sampling: bad output prefixes on every saving
node, an output folder that cannot be written, memory settings naming a device this machine lacks, and
non-finite numbers anywhere in widget values or settings. Each message names the value and what is
accepted; `sluice validate` and `sluice run --out PATH` fail before any node runs."""

import math
import os

import pytest

from app.cli import default_workflow_path, main
from engine.graph.document import Workflow
from engine.graph.run_checks import first_non_finite
from engine.graph.validate import validate
from engine.settings import MAX_PREFIX_FOLDERS, MAX_PREFIX_NAME_BYTES, Settings, SettingsError
from nodes.registry import default_registry

DEEP = "/".join(["d"] * 2000) + "/img"


@pytest.fixture
def settings(tmp_path):
    return Settings(models_root=tmp_path / "models", output_dir=tmp_path / "output", plugins_dir=None)


@pytest.fixture
def lookup(settings):
    return default_registry(settings).get


@pytest.fixture(autouse=True)
def no_user_settings(tmp_path, monkeypatch):
    for name in ("SLUICE_MODELS", "SLUICE_OUTPUT", "SLUICE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "no-settings.json"))


def default_workflow() -> Workflow:
    return Workflow.load(default_workflow_path())


def saver(node_type: str, prefix: str) -> Workflow:
    """A workflow of one saving node fed by a loader, so only its own inputs can be wrong."""
    workflow = Workflow()
    if node_type == "SaveImage":
        source, kind, name = workflow.add_node("LoadImage", {"image": "fox.png"}).id, "IMAGE", "images"
    elif node_type == "SaveLatent":
        source, kind, name = workflow.add_node("EmptyLatentImage", {}).id, "LATENT", "samples"
    else:
        source, kind, name = workflow.add_node("VAELoader", {}).id, "VAE", "vae"
    save = workflow.add_node(node_type, {"filename_prefix": prefix})
    workflow.connect(source, 0, save.id, name, kind)
    return workflow


@pytest.mark.parametrize("node_type", ["SaveImage", "SaveLatent", "VAESave"])
@pytest.mark.parametrize(("prefix", "says"), [
    ("../escape", "contains '..'"), ("a/../../b", "contains '..'"), ("/etc/passwd", "absolute path"),
    ("C:\\Windows\\x", "absolute path"), ("", "is empty"), ("   ", "is empty"), ("folder/", "no file name"),
    ("a\nb", "control character"), ("nul\0", "control character"), ("x" * 300, "at most 200 bytes"),
    ("é" * 101, "at most 200 bytes"), (DEEP, f"at most {MAX_PREFIX_FOLDERS}"), ("bad\ud800", "Unicode"),
])
def test_a_bad_output_prefix_is_refused_at_validation_on_every_saving_node(lookup, settings, node_type,
                                                                           prefix, says):
    workflow = saver(node_type, prefix)
    errors = [e for e in validate(workflow, lookup) if e.input_name == "filename_prefix"]
    assert len(errors) == 1 and errors[0].kind == "bad_value", errors
    message = errors[0].message
    assert says in message and "output prefix" in message
    assert repr(prefix[:80]) in message  # the value, cut short when long
    assert len(message) < 400
    with pytest.raises(SettingsError, match="output prefix"):
        settings.output_path(prefix, "png")  # a run that skipped validation refuses it too, no RecursionError
    assert not (settings.output_dir / "d").exists()


def test_prefixes_at_the_limits_pass(lookup, settings):
    prefix = "/".join(["f"] * MAX_PREFIX_FOLDERS) + "/" + "n" * MAX_PREFIX_NAME_BYTES
    assert validate(saver("SaveImage", prefix), lookup, settings.output_dir) == []
    path = settings.output_path(prefix, "safetensors")
    assert len(path.name.encode()) <= 255 and path.parent.is_dir()


@pytest.mark.parametrize("case", ["file", "dev-null", "parent is a file", "unwritable"])
def test_an_output_folder_that_cannot_be_written_is_refused_at_validation(tmp_path, lookup, monkeypatch,
                                                                          case):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    folder = {"file": blocker, "dev-null": "/dev/null", "parent is a file": blocker / "out",
              "unwritable": tmp_path / "locked"}[case]
    if case == "unwritable":  # the tests run as root, whom permissions do not stop: stand in for them
        folder.mkdir()
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(folder) and real_access(p, mode))
    errors = validate(saver("SaveImage", "img"), lookup, output_dir=type(tmp_path)(folder))
    [error] = errors
    assert error.kind == "bad_setting" and error.input_name == "filename_prefix"
    assert f"output folder {folder}" in error.message
    assert "accepted: a folder this user can write" in error.message
    assert {"file": "is not a folder", "dev-null": "is not a folder", "unwritable": "not writable",
            "parent is a file": f"cannot be made: {blocker} is not a folder"}[case] in error.message


def test_an_output_folder_is_not_checked_without_a_saving_node(tmp_path, lookup):
    workflow = saver("SaveImage", "img")
    workflow.nodes[max(workflow.nodes)].mode = "bypassed"
    preview = workflow.add_node("PreviewImage", {})
    workflow.connect(min(workflow.nodes), 0, preview.id, "images", "IMAGE")
    assert validate(workflow, lookup, output_dir=tmp_path / "missing" / "made later") == []
    assert validate(workflow, lookup, output_dir="/dev/null") == []


@pytest.mark.parametrize("command", ["validate", "run"])
def test_sluice_run_and_validate_refuse_an_out_path_that_is_a_file_before_the_job_starts(tmp_path, capsys,
                                                                                         command):
    code = main([command, str(default_workflow_path()), "--out", "/dev/null"])
    captured = capsys.readouterr()
    assert code == 1
    assert "output folder /dev/null" in captured.out + captured.err
    assert "is not a folder" in captured.out + captured.err
    assert "KSampler" not in captured.err  # no node ran


@pytest.mark.parametrize(("memory", "device"), [
    ({"backend": "cuda7"}, "cuda7"), ({"backend": "tpu"}, "tpu"), ({"backend": "vae=cuda7"}, "cuda7"),
    ({"params_backend": "tpu"}, "tpu"), ({"max_vram": "cuda7=4"}, "cuda7"),
])
def test_memory_settings_naming_a_missing_device_are_refused_at_validation(lookup, memory, device):
    workflow = default_workflow()
    workflow.settings["memory"] = memory
    [error] = validate(workflow, lookup)
    assert error.kind == "bad_setting"
    assert f"unknown device {device!r}" in error.message and "available devices: cpu" in error.message


def test_sluice_validate_names_the_missing_device(tmp_path, capsys):
    workflow = default_workflow()
    workflow.settings["memory"] = {"backend": "cuda7"}
    workflow.save(tmp_path / "wf.json")
    assert main(["validate", str(tmp_path / "wf.json"), "--out", str(tmp_path / "out")]) == 1
    assert "unknown device 'cuda7'" in capsys.readouterr().out


def test_valid_memory_settings_pass(lookup):
    workflow = default_workflow()
    workflow.settings["memory"] = {"backend": "cpu", "max_vram": "6", "vae_tiling": "on"}
    assert validate(workflow, lookup) == []


@pytest.mark.parametrize("where", ["list", "undeclared", "settings", "nested settings"])
@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_anywhere_are_refused_at_validation(lookup, where, number):
    workflow = default_workflow()
    sampler = workflow.nodes["6"]
    if where == "list":
        sampler.widgets["ui_state"] = [1, {"x": number}]  # a widget the type does not declare
    elif where == "undeclared":
        sampler.widgets["extra"] = number
    elif where == "settings":
        workflow.settings["preview"] = number
    else:
        workflow.settings["memory"] = {"max_vram": "6"}
        workflow.settings["extra"] = {"a": [0.5, number]}
    errors = validate(workflow, lookup)
    finite = [e for e in errors if "non-finite" in e.message]
    assert len(finite) == 1, errors
    assert repr(number) in finite[0].message and "accepted: finite numbers" in finite[0].message
    if where.endswith("settings"):
        assert finite[0].kind == "bad_setting"
    else:
        assert finite[0].node_id == "6" and finite[0].kind == "bad_value"


def test_a_declared_float_is_reported_once(lookup):
    workflow = default_workflow()
    workflow.nodes["6"].widgets["cfg"] = math.nan
    [error] = validate(workflow, lookup)
    assert error.input_name == "cfg" and "not a finite number" in error.message


def test_first_non_finite_walks_deep_values_without_recursion():
    deep: list = [math.inf]
    for _ in range(100_000):
        deep = [deep]
    where, value = first_non_finite(deep)
    assert value == math.inf and where == "[0]" * 100_001
    assert first_non_finite({"a": [1, 2.5, "nan"], "b": True}) is None
    assert first_non_finite({"a": [1, {"b": -math.inf}]}) == (".a[1].b", -math.inf)

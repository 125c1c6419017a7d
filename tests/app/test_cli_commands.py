import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from app.cli import ProgressPrinter, main
from engine.graph.document import Workflow
from engine.graph.job_guard import STEPS_WARNING
from engine.telemetry import EventBus

TEST_NODES = """
import os
import signal
import time

from engine.graph.spec import FLOAT, INT, NodeType, Output, float_input, int_input, link_input, string_input
from engine.telemetry import bus


class CliNumber(NodeType):
    category = "test/cli"
    inputs = (int_input("value", 1, min=0, max=1000),)
    outputs = (Output("INT", INT),)

    def run(self, ctx, value):
        return (value,)


class CliCount(NodeType):
    category = "test/cli"
    description = "Counts to `steps`, reporting progress, and outputs value * scale."
    inputs = (link_input("value", INT), int_input("steps", 20, min=1, max=1000), float_input("scale", 1.0))
    outputs = (Output("FLOAT", FLOAT),)

    def run(self, ctx, value, steps, scale):
        for step in range(1, steps + 1):
            ctx.check_interrupt()
            ctx.report_progress(step, steps)
        return (value * scale,)


class CliWriteText(NodeType):
    category = "test/cli"
    output_node = True
    inputs = (link_input("number", FLOAT), string_input("prefix", "result"))

    def run(self, ctx, number, prefix):
        path = ctx.settings.output_path(prefix, "txt")
        path.write_text(repr(number), encoding="utf-8")
        bus.publish("image_saved", node_id=ctx.node_id, path=str(path))
        return ()


class CliFail(NodeType):
    category = "test/cli"
    output_node = True
    inputs = (link_input("number", FLOAT),)

    def run(self, ctx, number):
        raise ValueError(f"cannot use {number}")


class CliInterruptSelf(NodeType):
    category = "test/cli"
    output_node = True
    inputs = (link_input("number", FLOAT),)

    def run(self, ctx, number):
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl+C does
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ctx.check_interrupt()
            time.sleep(0.005)
        raise RuntimeError("the interrupt never arrived")


NODE_TYPES = (CliNumber, CliCount, CliWriteText, CliFail, CliInterruptSelf)
"""


@pytest.fixture(autouse=True)
def no_user_settings(tmp_path, monkeypatch):
    """The user's settings file and SLUICE_* variables must not leak into these tests: an empty settings file
    of the test's own."""
    for name in ("SLUICE_MODELS", "SLUICE_OUTPUT", "SLUICE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "empty-settings.json").write_text("{}", encoding="utf-8")
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "empty-settings.json"))


@pytest.fixture
def plugins(tmp_path: Path) -> Path:
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "cli_nodes.py").write_text(textwrap.dedent(TEST_NODES), encoding="utf-8")
    return folder


def make_workflow(tmp_path: Path, sink: str = "CliWriteText", name: str = "wf.json") -> Path:
    """Number(7) -> Count(steps 20, scale 1.5) -> sink."""
    workflow = Workflow()
    number = workflow.add_node("CliNumber", widgets={"value": 7})
    count = workflow.add_node("CliCount", widgets={"steps": 20, "scale": 1.5})
    output = workflow.add_node(sink, widgets={"prefix": "result"} if sink == "CliWriteText" else {})
    workflow.connect(number.id, 0, count.id, "value", "INT")
    workflow.connect(count.id, 0, output.id, "number", "FLOAT")
    path = tmp_path / name
    workflow.save(path)
    return path


def cli(tmp_path: Path, plugins: Path, *args: str) -> int:
    (tmp_path / "models").mkdir(exist_ok=True)
    return main(["--plugins", str(plugins), "--models", str(tmp_path / "models"),
                 "--output", str(tmp_path / "out"), *args])


def test_run_executes_prints_progress_and_saved_files(tmp_path, plugins, capsys):
    path = make_workflow(tmp_path)
    before = path.read_text(encoding="utf-8")
    assert cli(tmp_path, plugins, "run", str(path), "--out", str(tmp_path / "run_out")) == 0
    out, err = capsys.readouterr()
    saved = Path(out.strip())
    assert saved == (tmp_path / "run_out").resolve() / "result_00001_.txt"  # run's --out wins
    assert float(saved.read_text()) == 7 * 1.5
    assert "[1] CliNumber" in err and "[3] CliWriteText" in err and "done in" in err
    step_lines = [line for line in err.splitlines() if " step " in line]
    assert 1 <= len(step_lines) <= 11 and step_lines[-1].endswith("step 20/20")
    assert path.read_text(encoding="utf-8") == before  # the CLI never rewrites the user's file


def test_set_overrides_widget_values_with_json_or_text(tmp_path, plugins, capsys):
    path = make_workflow(tmp_path)
    code = cli(tmp_path, plugins, "run", str(path), "--quiet",
               "--set", "1.value=10", "--set", "2.scale=2", "--set", "3.prefix=sub/42")
    assert code == 0
    out, err = capsys.readouterr()
    saved = Path(out.strip())
    assert saved.parent.name == "sub" and saved.name == "42_00001_.txt"  # "42" kept as text for a STRING
    assert float(saved.read_text()) == 20.0
    assert err == ""


@pytest.mark.parametrize("override, expected", [
    ("9.value=1", "no node '9' in the workflow; node ids: 1, 2, 3"),
    ("1.vale=1", "node 1 (CliNumber) has no widget input 'vale'; widget inputs: value"),
    ("2.steeps=1", "node 2 (CliCount) has no widget input 'steeps'; widget inputs: value, steps, scale"),
    ("2.value=1", "node 2 (CliCount) input 'value' is fed by a link from node 1"),
    ("1value=1", "expected NODE_ID.INPUT=VALUE"),
])
def test_bad_set_is_a_usage_error_naming_the_node_and_inputs(tmp_path, plugins, capsys, override, expected):
    path = make_workflow(tmp_path)
    assert cli(tmp_path, plugins, "run", str(path), "--set", override) == 2
    assert expected in capsys.readouterr().err


def test_set_value_out_of_range_fails_validation(tmp_path, plugins, capsys):
    path = make_workflow(tmp_path)
    assert cli(tmp_path, plugins, "run", str(path), "--set", "1.value=5000") == 1
    assert "5000" in capsys.readouterr().err


def test_run_warns_before_a_job_of_too_many_steps_and_still_runs_it(tmp_path, plugins, capsys):
    path = make_workflow(tmp_path)
    assert cli(tmp_path, plugins, "run", str(path)) == 0
    assert "may take long" not in capsys.readouterr().err  # 20 steps: no warning
    assert cli(tmp_path, plugins, "run", str(path), "--set", "2.steps=200") == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    warning = next(i for i, line in enumerate(lines) if "may take long" in line)
    assert lines[warning].startswith("sluice: warning: this job may take long: 200 steps (node 2, CliCount)")
    assert f"over {STEPS_WARNING} steps" in lines[warning]
    assert warning < next(i for i, line in enumerate(lines) if "[1] CliNumber" in line)  # before it runs
    assert "step 200/200" in err and Path(out.strip()).exists()  # a warning, not a refusal


def test_failed_node_exits_1_with_the_structured_error(tmp_path, plugins, capsys):
    path = make_workflow(tmp_path, sink="CliFail")
    assert cli(tmp_path, plugins, "run", str(path), "--quiet") == 1
    err = capsys.readouterr().err
    assert "node 3 (CliFail) failed: ValueError: cannot use 10.5" in err


def test_ctrl_c_interrupts_the_job_and_exits_130(tmp_path, plugins, capsys):
    path = make_workflow(tmp_path, sink="CliInterruptSelf")
    assert cli(tmp_path, plugins, "run", str(path), "--quiet") == 130
    assert "interrupted" in capsys.readouterr().err


def test_validate_exit_codes(tmp_path, plugins, capsys):
    good = make_workflow(tmp_path)
    assert cli(tmp_path, plugins, "validate", str(good)) == 0
    assert capsys.readouterr().out.strip() == "ok"
    workflow = Workflow.load(good)
    workflow.add_node("NoSuchNode")
    workflow.nodes["2"].widgets["steps"] = 0
    workflow.save(tmp_path / "bad.json")
    assert cli(tmp_path, plugins, "validate", str(tmp_path / "bad.json")) == 1
    out = capsys.readouterr().out
    assert "NoSuchNode" in out and "steps" in out


def test_malformed_or_missing_workflow_exits_2(tmp_path, plugins, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "sluice-workflow", "version": 2, "nodes": [', encoding="utf-8")
    assert cli(tmp_path, plugins, "run", str(broken)) == 2
    assert "broken.json" in capsys.readouterr().err
    assert cli(tmp_path, plugins, "validate", str(tmp_path / "absent.json")) == 2
    assert "absent.json" in capsys.readouterr().err


def test_nodes_json_lists_builtin_and_plugin_types_and_failures(tmp_path, plugins, capsys):
    (plugins / "zz_broken.py").write_text("raise ImportError('no luck')\n", encoding="utf-8")
    assert cli(tmp_path, plugins, "nodes", "--json") == 0
    out, err = capsys.readouterr()
    catalog = json.loads(out)
    by_name = {node["name"]: node for node in catalog["nodes"]}
    assert by_name["CliCount"]["inputs"][1] == {**by_name["CliCount"]["inputs"][1], "name": "steps", "min": 1,
                                                "max": 1000, "default": 20}
    assert "PrimitiveInt" in by_name
    assert [Path(f["path"]).name for f in catalog["plugin_failures"]] == ["zz_broken.py"]
    assert "zz_broken.py" in err and "no luck" in err


def test_progress_printer_draws_one_bar_on_a_terminal():
    class Terminal:
        def __init__(self):
            self.text = ""

        def write(self, text):
            self.text += text

        def flush(self):
            pass

        def isatty(self):
            return True

    stream = Terminal()
    workflow = Workflow()
    workflow.add_node("CliCount")
    bus = EventBus()
    printer = ProgressPrinter(workflow, stream=stream)
    bus.subscribe(printer)
    for step in range(1, 51):
        bus.publish("progress", node_id="1", value=step, max=50)
    bus.publish("node_finished", node_id="1", seconds=0.5)
    lines = stream.text.split("\n")
    assert lines[0].count("\r") == 50 and lines[0].endswith("[" + "#" * 30 + "] 50/50")
    assert lines[1] == "[1] CliCount done in 0.50 s"


def test_console_script_lists_nodes_in_a_subprocess():
    script = Path(sys.executable).parent / "sluice"
    result = subprocess.run([str(script), "nodes"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "utils/primitive" in result.stdout and "PrimitiveInt (Integer)" in result.stdout
    assert "PySide6" not in subprocess.run(
        [sys.executable, "-c", "import sys, app.cli; app.cli.main(['nodes']); print(sorted(sys.modules))"],
        capture_output=True, text=True, timeout=60).stdout


def test_headless_runs_the_default_workflow(tmp_path, plugins, capsys, monkeypatch):
    path = make_workflow(tmp_path, name="default.json")
    monkeypatch.setattr("app.cli.default_workflow_path", lambda: path)
    assert cli(tmp_path, plugins, "--headless", "--quiet", "--set", "1.value=2") == 0
    saved = Path(capsys.readouterr().out.strip())
    assert float(saved.read_text()) == 3.0


def test_no_command_opens_the_gui_with_the_settings_or_explains_it_is_missing(tmp_path, plugins, capsys,
                                                                              monkeypatch):
    opened = []
    fake_gui = types.ModuleType("app.main_window")
    fake_gui.run_gui = lambda settings: opened.append(settings) or 0
    monkeypatch.setitem(sys.modules, "app.main_window", fake_gui)
    assert cli(tmp_path, plugins) == 0
    assert opened[0].plugins_dir == plugins.absolute()
    monkeypatch.setitem(sys.modules, "app.main_window", None)  # makes the import fail as if absent
    assert cli(tmp_path, plugins) == 2
    assert "desktop app is not built yet" in capsys.readouterr().err


def test_usage_errors_return_2_and_help_returns_0(capsys):
    assert main(["run"]) == 2
    assert main(["--help"]) == 0
    assert "run" in capsys.readouterr().out


def test_inspect_reports_the_embedded_checkpoint_and_rejects_a_non_model_file(tmp_path, capsys):
    import json as json_module

    from engine.settings import embedded_models_dir

    checkpoint = embedded_models_dir() / "checkpoints" / "sluice-shapes.safetensors"
    assert main(["inspect", str(checkpoint), "--json"]) == 0
    info = json_module.loads(capsys.readouterr().out)
    assert info["family"] == "sd_custom"
    assert set(info["components"]) == {"diffusion", "vae"}
    assert info["unet"]["model_channels"] == 64 and info["unet"]["num_head_channels"] == 32
    assert main(["inspect", str(checkpoint)]) == 0
    assert "sd_custom" in capsys.readouterr().out
    junk = tmp_path / "notes.safetensors"
    junk.write_bytes(b"not a model at all")
    assert main(["inspect", str(junk)]) == 1
    assert f"cannot inspect {junk}" in capsys.readouterr().err


def test_a_models_flag_naming_a_file_is_refused_and_a_missing_folder_warned(tmp_path, capsys):
    path = make_workflow(tmp_path)
    (tmp_path / "a_file").write_text("x")
    assert main(["--models", str(tmp_path / "a_file"), "validate", str(path)]) == 2
    assert "is not a folder" in capsys.readouterr().err
    main(["--models", str(tmp_path / "nowhere"), "validate", str(path)])
    err = capsys.readouterr().err
    assert f"models folder {tmp_path / 'nowhere'} does not exist" in err


def test_a_settings_variable_naming_a_missing_file_is_warned_and_the_defaults_apply(tmp_path, plugins,
                                                                                    monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "typo" / "settings.json"))
    assert cli(tmp_path, plugins, "validate", str(make_workflow(tmp_path))) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "ok"
    missing = tmp_path / "typo" / "settings.json"
    assert f"SLUICE_SETTINGS: settings file {missing} does not exist" in captured.err


@pytest.mark.parametrize("kind", ["folder", "FIFO"])
def test_a_settings_file_that_is_a_folder_or_fifo_is_refused(tmp_path, monkeypatch, capsys, kind):
    if kind == "folder":
        (tmp_path / "settings.json").mkdir()
    else:
        os.mkfifo(tmp_path / "settings.json")  # reading it would block until a writer came
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "settings.json"))
    assert main(["validate", str(make_workflow(tmp_path))]) != 0
    assert "is not a regular file" in capsys.readouterr().err

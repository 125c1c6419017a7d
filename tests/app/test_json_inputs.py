"""Every JSON Sluice takes in goes through engine.jsonfile's limits: `sluice run --set` values, memory trace
files and the websocket messages `sluice run --server` reads, besides workflows, settings, the recovery
file, PNG chunks and server bodies (tests/engine/test_jsonfile.py)."""

import pytest

from app.cli import CommandError, main, override_value
from app.memory_model import TraceError, load_trace
from engine.graph.spec import FLOAT, INT, STRING
from engine.jsonfile import JsonInputError, JsonSyntaxError, load_json

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(("kind", "text", "message"), [
    (FLOAT, "NaN", "non-finite number NaN"), (FLOAT, "Infinity", "non-finite number Infinity"),
    (FLOAT, "1e999", "too large for a float"), (INT, "9" * 5000, "an integer of 5000 digits"),
    (INT, DEEP, "nested deeper than 256 levels"),
])
def test_a_set_value_over_the_json_limits_is_a_clear_command_error(kind, text, message):
    with pytest.raises(CommandError, match=message) as caught:
        override_value(kind, text)
    assert str(caught.value).startswith("--set: the value: holds")


def test_set_values_that_are_not_json_stay_text_and_text_widgets_keep_anything():
    assert override_value(FLOAT, "2.5") == 2.5 and override_value(INT, "7") == 7
    assert override_value(STRING, "a cat") == "a cat" and override_value(FLOAT, "[1,") == "[1,"
    assert override_value(STRING, "NaN") == "NaN" and override_value(STRING, DEEP) == DEEP
    with pytest.raises(JsonSyntaxError):
        load_json("[1,", "text")
    assert issubclass(JsonSyntaxError, JsonInputError)


def test_sluice_run_with_a_nan_set_value_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "none.json"))
    from app.cli import default_workflow_path

    code = main(["run", str(default_workflow_path()), "--out", str(tmp_path / "out"), "--set", "6.cfg=NaN"])
    assert code == 2
    assert "--set: the value: holds the non-finite number NaN" in capsys.readouterr().err


@pytest.mark.parametrize(("line", "says"), [
    ('{"kind": "a", "time": 1, "fields": ' + DEEP + "}", "expected a JSON object"),
    ('{"kind": "a", "time": ' + "9" * 5000 + ', "fields": {}}', "expected a JSON object"),
])
def test_a_hostile_memory_trace_line_is_a_trace_error(tmp_path, line, says):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"kind": "a", "time": 1.0, "fields": {}}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(TraceError, match=f"line 2: {says}"):  # was a RecursionError / ValueError traceback
        load_trace(path)

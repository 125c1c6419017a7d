"""The one JSON reader (engine/jsonfile.py) and every reader of a file Sluice takes in that goes through it:
hostile JSON gives a clear error naming the file, never a RecursionError, OverflowError or a silent NaN."""

import io
import json

import pytest
from PIL import Image, PngImagePlugin

from engine import jsonfile
from engine.graph.document import FORMAT, Workflow
from engine.graph.errors import WorkflowError
from engine.graph.interchange import from_png, load_any
from engine.jsonfile import JsonInputError, load_json, read_json_file
from engine.settings import SettingsError, cache_dir

DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE = {  # name -> (JSON text, what the error says)
    "deep nesting": (DEEP, "nested deeper than 256"),
    "nesting just past the limit": ("[" * 257 + "]" * 257, "nested deeper than 256"),
    "deep objects": ('{"a":' * 300 + "1" + "}" * 300, "nested deeper than 256"),
    "a 5000-digit integer": ('{"a": ' + "9" * 5000 + "}", "integer of 5000 digits"),
    "a 5000-digit negative integer": ('{"a": -' + "9" * 5000 + "}", "integer of 5000 digits"),
    "NaN": ('{"a": NaN}', "non-finite number NaN"),
    "Infinity": ('{"a": [-Infinity]}', "non-finite number -Infinity"),
    "a float that overflows": ('{"a": 1e400}', "too large for a float"),
    "an unpaired surrogate": ('{"a": "\\ud800"}', "unpaired surrogate"),
    "an unpaired surrogate in a key": ('{"\\udc00": 1}', "unpaired surrogate"),
    "bad JSON": ('{"a": ', "invalid JSON at line 1"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_load_json_refuses_hostile_input_with_a_clear_error_naming_the_source(name):
    text, expected = HOSTILE[name]
    with pytest.raises(JsonInputError, match=expected) as caught:
        load_json(text, "workflow flow.json")
    assert str(caught.value).startswith("workflow flow.json: ")


def test_load_json_accepts_what_sluice_writes():
    data = {"seed": 0xFFFFFFFFFFFFFFFF, "cfg": 7.5, "text": "caf\u00e9 \U0001F600",
            "nested": [[[{"a": None}]]]}
    text = json.dumps(data, ensure_ascii=False)
    assert load_json(text, "x") == data
    assert load_json(text.encode("utf-8"), "x") == data
    assert load_json(b"\xef\xbb\xbf" + text.encode("utf-8"), "x") == data  # a BOM is skipped
    assert load_json("[" * 256 + "]" * 256, "x") is not None  # exactly the limit


def test_load_json_refuses_bytes_that_are_not_utf8_and_oversized_text(monkeypatch):
    expected = r"recovery file r\.json: not UTF-8 text \(byte 0xff at offset 7\)"
    with pytest.raises(JsonInputError, match=expected):
        load_json(b'{"a": "\xff"}', "recovery file r.json")
    monkeypatch.setattr(jsonfile, "MAX_BYTES", 10)
    with pytest.raises(JsonInputError, match="too large"):
        load_json('{"a": "12345678"}', "x")


def test_read_json_file_names_the_file(tmp_path):
    path = tmp_path / "settings.json"
    with pytest.raises(JsonInputError, match=r"cannot read settings file .*settings\.json"):
        read_json_file(path, "settings file")
    path.write_bytes(b"[" * 1000)
    with pytest.raises(JsonInputError, match=r"settings file .*settings\.json: holds containers nested"):
        read_json_file(path, "settings file")


def _workflow_text(pos="[0, 0]", widget="1"):
    node = {"id": "1", "type": "T", "pos": "POS", "widgets": {"value": "WIDGET"}}
    text = json.dumps({"format": FORMAT, "version": 2, "nodes": [node], "links": []})
    return text.replace('"POS"', pos).replace('"WIDGET"', widget)


@pytest.mark.parametrize("text, expected", [
    (DEEP, "nested deeper"),
    (_workflow_text(widget="9" * 5000), "integer of 5000 digits"),
    (_workflow_text(widget="NaN"), "non-finite number NaN"),
    (_workflow_text(pos="[1" + "0" * 35 + ", 0]"), r"field 'pos' must be a list of 2 numbers within"),
    (_workflow_text(pos="[1e300, 0]"), r"field 'pos' must be a list of 2 numbers within"),
])
def test_workflow_readers_refuse_hostile_json_with_a_workflow_error(tmp_path, text, expected):
    with pytest.raises(WorkflowError, match=expected):
        Workflow.loads(text, source="flow.json")
    path = tmp_path / "flow.json"
    path.write_text(text)
    with pytest.raises(WorkflowError, match=r"flow\.json: .*" + expected):
        Workflow.load(path)
    with pytest.raises(WorkflowError, match=r"flow\.json: .*" + expected):
        load_any(path, lambda name: None)
    with pytest.raises(WorkflowError, match=expected):
        load_any(text.encode("utf-8"), lambda name: None)


def test_comfy_ui_import_refuses_huge_positions_and_ids():
    def comfy(node_id, pos):
        return json.dumps({"last_node_id": 1, "last_link_id": 0, "links": [], "version": 0.4,
                           "nodes": [{"id": node_id, "type": "T", "pos": pos, "size": [10, 10],
                                      "widgets_values": [], "inputs": [], "outputs": []}]})

    with pytest.raises(WorkflowError, match="pos.* within"):
        load_any(comfy(1, [10**30, 0]), lambda name: None)
    with pytest.raises(WorkflowError, match="integer of 5000 digits"):
        load_any(comfy(1, [0, 0]).replace('"id": 1', '"id": ' + "7" * 5000), lambda name: None)


def test_png_text_chunks_go_through_the_same_reader():
    info = PngImagePlugin.PngInfo()
    info.add_text("workflow", "[" * 5000)
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, "PNG", pnginfo=info)
    with pytest.raises(WorkflowError, match=r"image\.png \(text chunk 'workflow'\): holds containers nested"):
        from_png(buffer.getvalue(), lambda name: None, "image.png")


@pytest.mark.parametrize("content, expected", [
    (b"[" * 100_000, "nested deeper"),
    (b'{"cache_dir": "\xff"}', "not UTF-8"),
    (b'{"cache_dir": ' + b"1" * 5000 + b"}", "integer of 5000 digits"),
])
def test_settings_file_refuses_hostile_json_naming_the_file(tmp_path, content, expected):
    path = tmp_path / "settings.json"
    path.write_bytes(content)
    with pytest.raises(SettingsError, match=r"settings file .*settings\.json: .*" + expected):
        cache_dir({}, settings_file=path)

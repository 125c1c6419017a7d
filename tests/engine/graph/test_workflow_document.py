import json
import os

import pytest

from engine.graph.document import FORMAT, VERSION, Group, Link, NodeDoc, Workflow, migrate
from engine.graph.errors import WorkflowError


def complex_workflow() -> Workflow:
    wf = Workflow()
    loader = wf.add_node("Loader", {"name": "ünïcödé 模型 🎨.safetensors"}, pos=(-12.25, 3e-7))
    widgets = {"seed": 2**64 - 1, "steps": 30, "sampler": "heun", "denoise_all": False,
               "cfg": 0.1 + 0.2, "tiny": 5e-324, "nested": {"list": [1, 2.5, None, "x"]}}
    sampler = wf.add_node("Sampler", widgets,
                          pos=(400.0, -123456789.125), title="Sämpler \"quoted\"\n", size=(320.5, 180.0),
                          collapsed=True, color="#ff00aa")
    sampler.seed_controls["seed"] = "randomize"
    muted = wf.add_node("Sink", mode="muted")
    wf.add_node("Show", mode="bypassed")
    wf.connect(loader.id, 0, sampler.id, "model", "MODEL")
    wf.connect(sampler.id, 0, muted.id, "value", "LATENT")
    wf.groups.append(Group("1", "Grüppe ✨", (0.0, -10.5, 800.125, 600.0), color=None))
    wf.groups.append(Group("2", "", (1.0, 2.0, 3.0, 4.0), color="#123456"))
    wf.settings["memory"] = {"backend": "diffusion=cuda0,te=cpu", "params_backend": "vae=disk",
                             "max_vram": "6.5"}
    wf.settings["preview"] = "taesd"
    wf.meta = {"author": "Zoë", "created": 1.5e9, "tags": ["a", "b"], "empty": {}}
    return wf


def test_complex_document_round_trips_through_a_file_losslessly(tmp_path):
    wf = complex_workflow()
    path = tmp_path / "flow.json"
    wf.save(path)
    loaded = Workflow.load(path)
    assert loaded == wf
    assert loaded.nodes["2"].widgets["cfg"] == 0.1 + 0.2
    assert loaded.nodes["2"].widgets["tiny"] == 5e-324
    assert loaded.dumps() == wf.dumps()
    assert os.listdir(tmp_path) == ["flow.json"]  # the temporary file was renamed, none left behind


def test_dumps_is_stable_indented_json_with_format_and_version():
    text = complex_workflow().dumps()
    data = json.loads(text)
    assert (data["format"], data["version"]) == (FORMAT, VERSION)
    assert text.startswith('{\n  "format"')
    assert text == complex_workflow().dumps()
    assert "ünïcödé" in text  # written as UTF-8, not escaped


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "flow.json"
    path.write_text("old contents", encoding="utf-8")
    complex_workflow().save(path)
    assert Workflow.load(path) == complex_workflow()


def test_version_1_document_is_migrated():
    v1 = {
        "format": FORMAT, "version": 1,
        "nodes": [
            {"id": 3, "type": "Loader", "pos": [10, 20], "widgets_values": {"name": "m.safetensors"}},
            {"id": 7, "type": "Sampler", "pos": [300.5, 20], "widgets_values": {"steps": 4}, "title": "S"},
        ],
        "links": [[3, 0, 7, "model"]],
        "meta": {"note": "old"},
    }
    expected = Workflow(
        nodes={"3": NodeDoc("3", "Loader", pos=(10.0, 20.0), widgets={"name": "m.safetensors"}),
               "7": NodeDoc("7", "Sampler", title="S", pos=(300.5, 20.0), widgets={"steps": 4})},
        links=[Link("1", "3", 0, "7", "model", "*")],
        meta={"note": "old"},
    )
    assert Workflow.loads(json.dumps(v1)) == expected
    assert migrate(v1)["version"] == VERSION
    assert v1["version"] == 1  # migrate does not change its argument


def test_malformed_json_names_line_and_column():
    text = '{\n  "format": "sluice-workflow",\n  "version": 2,,\n}'
    with pytest.raises(WorkflowError, match=r"flow\.json: invalid JSON at line 3, column 16"):
        Workflow.loads(text, source="flow.json")


@pytest.mark.parametrize("data, message", [
    ({"version": 2, "nodes": []}, "not a Sluice workflow: \"format\" is None"),
    ({"format": "comfy", "version": 2}, "not a Sluice workflow: \"format\" is 'comfy'"),
    ({"format": FORMAT, "version": 3}, r"unsupported workflow version 3; supported: 1, 2"),
    ({"format": FORMAT, "version": "2"}, r"unsupported workflow version '2'; supported: 1, 2"),
    ({"format": FORMAT}, r"unsupported workflow version None"),
    ([1, 2], "must be a JSON object, got list"),
])
def test_wrong_format_or_version_is_a_workflow_error(data, message):
    with pytest.raises(WorkflowError, match=message):
        Workflow.loads(json.dumps(data))


def doc(**fields):
    data = {"format": FORMAT, "version": VERSION, "nodes": [{"id": "1", "type": "Const"},
                                                           {"id": "2", "type": "Sink"}]}
    data.update(fields)
    return json.dumps(data)


def test_duplicate_node_id_is_named():
    with pytest.raises(WorkflowError, match=r"duplicate node id '1'"):
        Workflow.loads(doc(nodes=[{"id": "1", "type": "Const"}, {"id": "1", "type": "Sink"}]))


def test_dangling_link_names_the_link_and_the_missing_node():
    links = [{"id": "9", "source": "1", "output": 0, "target": "42", "input": "value", "type": "INT"}]
    with pytest.raises(WorkflowError, match=r"link '9' points at missing node '42'"):
        Workflow.loads(doc(links=links))


@pytest.mark.parametrize("fields, message", [
    ({"nodes": {"1": {"type": "Const"}}}, r"field 'nodes' must be list"),
    ({"nodes": [{"id": 1, "type": "Const"}]}, r"nodes\[0\]: field 'id' must be str, got 1"),
    ({"nodes": [{"id": "1"}]}, r"node '1': missing field 'type'"),
    ({"nodes": [{"id": "1", "type": "Const", "pos": "abc"}]}, r"node '1': field 'pos' must be list"),
    ({"nodes": [{"id": "1", "type": "Const", "pos": [1, True]}]}, r"'pos' must be a list of 2 numbers"),
    ({"nodes": [{"id": "1", "type": "Const", "widgets": [1]}]}, r"field 'widgets' must be dict"),
    ({"nodes": [{"id": "1", "type": "Const", "mode": "frozen"}]}, r"unknown mode 'frozen'; accepted: normal"),
    ({"nodes": [{"id": "1", "type": "Const", "collapsed": 1}]}, r"field 'collapsed' must be bool"),
    ({"nodes": ["Const"]}, r"nodes\[0\] must be an object"),
    ({"links": [{"id": "1", "source": "1", "output": "0", "target": "2", "input": "value", "type": "INT"}]},
     r"link '1': field 'output' must be int, got '0'"),
    ({"links": [{"id": "1", "source": "1", "output": -1, "target": "2", "input": "value", "type": "INT"}]},
     r"link '1': output index must be 0 or more"),
    ({"links": [{"id": "1", "source": "1", "output": 0, "target": "2", "type": "INT"}]},
     r"link '1': missing field 'input'"),
    ({"groups": [{"id": "1", "title": "g", "rect": [0, 0, 1]}]},
     r"group '1': field 'rect' must be a list of 4"),
    ({"settings": {"memory": {"max_vram": 6}}}, r"settings.memory must be an object of placement strings"),
    ({"meta": "x"}, r"field 'meta' must be dict"),
])
def test_wrong_field_types_are_workflow_errors(fields, message):
    with pytest.raises(WorkflowError, match=message):
        Workflow.loads(doc(**fields))


def test_unreadable_file_is_a_workflow_error(tmp_path):
    with pytest.raises(WorkflowError, match=r"cannot read workflow '.*missing\.json'"):
        Workflow.load(tmp_path / "missing.json")


def test_connect_replaces_the_link_into_that_input_and_remove_node_drops_its_links():
    wf = Workflow()
    a, b, sink = wf.add_node("Const"), wf.add_node("Const"), wf.add_node("Sink")
    assert (a.id, b.id, sink.id) == ("1", "2", "3")
    wf.connect(a.id, 0, sink.id, "value", "INT")
    second = wf.connect(b.id, 0, sink.id, "value", "INT")
    assert wf.links_into(sink.id) == {"value": second}
    assert len(wf.links) == 1 and second.id == "1"  # the replaced link's id was free again
    wf.remove_node(b.id)
    assert wf.links == [] and set(wf.nodes) == {"1", "3"}
    assert wf.add_node("Const").id == "4"
    with pytest.raises(WorkflowError, match=r"no node with id '99'"):
        wf.connect("99", 0, sink.id, "value", "INT")
    with pytest.raises(WorkflowError, match=r"no node with id '2'"):
        wf.remove_node("2")


def test_copy_is_deep_and_equality_is_by_value():
    wf = complex_workflow()
    clone = wf.copy()
    assert clone == wf and clone is not wf
    clone.nodes["2"].widgets["nested"]["list"].append(7)
    assert clone != wf
    assert wf.nodes["2"].widgets["nested"]["list"] == [1, 2.5, None, "x"]

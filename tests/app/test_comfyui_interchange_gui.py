"""ComfyUI interchange both ways (issue 20, point 4): File > Export and `sluice export` in ComfyUI's UI and
API formats, Save As that never writes name.png.json, PNGs that carry ComfyUI's chunks and Sluice's own
document (older Sluice PNGs still open), quiet imports, and Note nodes kept as canvas notes."""

import json

import torch
from PySide6.QtWidgets import QFileDialog

from app.cli import main
from engine.graph.comfy import is_comfy_api, is_comfy_ui
from engine.graph.document import Workflow
from engine.graph.interchange import load_any
from engine.images import png_text, save_png, workflow_chunks
from engine.settings import resources_dir
from nodes.registry import default_registry


def small_graph(window) -> tuple[str, str]:
    scene = window.scene
    number = scene.add_node("GuiNumber", (0, 0))
    sink = scene.add_node("GuiSink", (320, 0))
    scene.connect_ports(scene.node_items[number].outputs[0], scene.node_items[sink].inputs["value"])
    return number, sink


def comfy_ui_with_notes() -> dict:
    """A ComfyUI UI-format file: two test nodes, a Note and a MarkdownNote."""
    return {"last_node_id": 4, "last_link_id": 1, "version": 0.4, "groups": [], "config": {}, "extra": {},
            "nodes": [
                {"id": 1, "type": "GuiNumber", "pos": [0, 0], "size": [240, 100], "flags": {}, "order": 0,
                 "mode": 0, "inputs": [], "outputs": [{"name": "INT", "type": "INT", "links": [1]}],
                 "properties": {}, "widgets_values": [5, 11, "fixed"]},
                {"id": 2, "type": "GuiSink", "pos": [400, 0], "size": [240, 60], "flags": {}, "order": 1,
                 "mode": 0, "inputs": [{"name": "value", "type": "*", "link": 1}], "outputs": [],
                 "properties": {}, "widgets_values": []},
                {"id": 3, "type": "Note", "pos": [0, 300], "size": [300, 120], "flags": {}, "order": 2,
                 "mode": 0, "inputs": [], "outputs": [], "properties": {},
                 "widgets_values": ["Set the number, then Queue."]},
                {"id": 4, "type": "MarkdownNote", "pos": [400, 300], "size": [300, 120], "flags": {},
                 "order": 3, "mode": 0, "inputs": [], "outputs": [], "properties": {},
                 "widgets_values": ["# Heading\nsome *markdown*"]}],
            "links": [[1, 1, 0, 2, 0, "INT"]]}


def test_file_export_writes_comfyui_ui_and_api_files(make_window, tmp_path, monkeypatch):
    window = make_window()
    number, sink = small_graph(window)
    labels = {action.text() for action in window.menuBar().actions()[0].menu().actions()
              if action.menu() is not None for action in action.menu().actions()}
    assert {"ComfyUI &workflow (UI format)...", "ComfyUI &API prompt..."} <= labels
    monkeypatch.setattr(QFileDialog, "getSaveFileName",
                        lambda *args, **kwargs: (str(tmp_path / "for_comfy"), "ComfyUI workflows (*.json)"))
    window.export_ui_action.trigger()
    ui = json.loads((tmp_path / "for_comfy.json").read_text())
    assert is_comfy_ui(ui) and ui["version"] == 0.4
    assert [node["type"] for node in ui["nodes"]] == ["GuiNumber", "GuiSink"]
    assert ui["links"] == [[1, int(number), 0, int(sink), 0, "INT"]]
    assert window.export_comfy(str(tmp_path / "api.json"), "comfy-api")
    api = json.loads((tmp_path / "api.json").read_text())
    assert is_comfy_api(api) and api[sink]["inputs"]["value"] == [number, 0]
    assert api[number]["inputs"]["value"] == 3


def test_sluice_export_command_writes_either_format(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "no-settings.json"))
    default = str(resources_dir() / "workflows" / "default.json")
    assert main(["export", default, "--format", "comfy-api"]) == 0
    api = json.loads(capsys.readouterr().out)
    assert is_comfy_api(api) and {node["class_type"] for node in api.values()} >= {"KSampler", "SaveImage"}
    assert main(["export", default, "--format", "comfy-ui", "-o", str(tmp_path / "ui.json")]) == 0
    ui = json.loads((tmp_path / "ui.json").read_text())
    registry = default_registry()
    again, warnings = load_any(tmp_path / "ui.json", registry.get)
    original = Workflow.load(default)
    assert warnings == []  # Sluice's own placement widgets ride along and read back quietly
    assert {(link.source, link.output, link.target, link.input) for link in again.links} == \
        {(link.source, link.output, link.target, link.input) for link in original.links}
    assert is_comfy_ui(ui)
    assert main(["export", default, "--format", "comfy-json"]) == 2  # argparse names the accepted formats
    assert "comfy-ui" in capsys.readouterr().err


def test_save_as_with_the_png_filter_writes_json_not_png_json(make_window, tmp_path, monkeypatch):
    window = make_window()
    small_graph(window)
    typed = (str(tmp_path / "picture.png"), "Images with a workflow (*.png)")
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *args, **kwargs: typed)
    assert window.save_as()
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_file()) == ["picture.json"]
    assert window.file_path == str((tmp_path / "picture.json").resolve())


def test_output_pngs_open_from_sluices_own_chunk_and_older_pngs_still_open(make_window, registry, tmp_path):
    window = make_window()
    small_graph(window)
    window.scene.create_group("Frame")
    workflow = window.scene.workflow.copy()
    image = torch.rand(8, 8, 3)
    path = save_png(image, tmp_path / "new.png", workflow_chunks(workflow, registry.get))
    chunks = png_text(path)
    assert set(chunks) == {"sluice-workflow", "workflow", "prompt"}
    assert is_comfy_ui(json.loads(chunks["workflow"])) and is_comfy_api(json.loads(chunks["prompt"]))
    window.new_document()
    assert window.open_file(str(path))
    assert window.scene.workflow.to_dict() == workflow.to_dict()  # groups and all, from Sluice's chunk
    assert window.file_path is None  # Save never overwrites the image
    old = save_png(image, tmp_path / "old.png", {"workflow": workflow.dumps()})  # what Sluice wrote before
    assert window.open_file(str(old))
    assert window.scene.workflow.to_dict() == workflow.to_dict()


def test_comfyui_notes_become_canvas_notes_that_are_saved_and_exported_back(make_window, tmp_path):
    window = make_window()
    (tmp_path / "notes.json").write_text(json.dumps(comfy_ui_with_notes()), encoding="utf-8")
    assert window.open_file(str(tmp_path / "notes.json"))
    assert "import warnings" not in window.status_label.text()
    scene = window.scene
    assert {note_id: item.note["text"] for note_id, item in scene.note_items.items()} == {
        "3": "Set the number, then Queue.", "4": "# Heading\nsome *markdown*"}
    assert scene.note_items["4"].title() == "Markdown note"
    assert set(scene.node_items) == {"1", "2"}  # notes are not nodes: they never run

    scene.set_note_text("3", "Changed.")
    added = scene.add_note((800, 0), "A new note")
    scene.note_items["4"].setSelected(True)
    scene.delete_selection()
    assert set(scene.note_items) == {"3", added} and scene.note_items["3"].note["text"] == "Changed."
    scene.undo_stack.undo()
    scene.undo_stack.undo()
    assert set(scene.note_items) == {"3", "4"}
    scene.undo_stack.redo()
    scene.undo_stack.redo()
    scene.note_items["3"].setPos(50, 350)
    scene.commit_moves()
    assert [note["pos"] for note in scene.notes() if note["id"] == "3"] == [[50.0, 350.0]]

    assert window.save_to(str(tmp_path / "saved.json"))
    saved = Workflow.load(tmp_path / "saved.json")
    assert [(note["id"], note["text"]) for note in saved.meta["notes"]] == [("3", "Changed."),
                                                                           (added, "A new note")]
    assert window.export_comfy(str(tmp_path / "back.json"), "comfy-ui")
    back = json.loads((tmp_path / "back.json").read_text())
    notes = [(node["type"], node["widgets_values"]) for node in back["nodes"] if node["type"] == "Note"]
    assert notes == [("Note", ["Changed."]), ("Note", ["A new note"])]
    window.new_document()
    assert window.open_file(str(tmp_path / "saved.json"))
    assert set(window.scene.note_items) == {"3", added}

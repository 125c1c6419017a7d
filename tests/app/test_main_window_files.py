"""Files in the main window: save/open round trip, title and unsaved-changes prompt, recent files, drops
of JSON and PNG workflows, autosave with crash recovery, layout restore, the default screenshot."""

import json

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from app.session import recent_files
from engine.graph.document import Workflow


def build_graph(window) -> None:
    scene = window.scene
    number = scene.add_node("GuiNumber", (0, 0))
    scale = scene.add_node("GuiScale", (320, 0))
    sink = scene.add_node("GuiSink", (640, 0))
    scene.connect_ports(scene.node_items[number].outputs[0], scene.node_items[scale].inputs["number"])
    scene.connect_ports(scene.node_items[scale].outputs[0], scene.node_items[sink].inputs["value"])
    scene.set_widget(number, "value", 42)
    scene.node_items[number].setSelected(True)
    scene.create_group("Inputs")
    scene.clearSelection()


def drop_file(view, path) -> None:
    data = QMimeData()
    data.setUrls([QUrl.fromLocalFile(str(path))])
    event = QDropEvent(QPointF(50, 50), Qt.DropAction.CopyAction, data, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    view.dropEvent(event)  # what the viewport calls when a drag from another application is released
    assert event.isAccepted()


def test_save_and_open_round_trip_with_title_marks_and_recent_files(make_window, tmp_path):
    window = make_window()
    assert window.windowTitle() == "Untitled — Sluice"
    build_graph(window)
    assert window.windowTitle() == "Untitled* — Sluice"
    path = tmp_path / "graph.json"
    assert window.save_to(str(path))
    assert window.windowTitle() == "graph.json — Sluice"
    saved = window.scene.workflow.to_dict()
    assert Workflow.load(path).to_dict() == saved
    assert recent_files(window.app_settings)[0] == str(path.resolve())

    window.new_document()
    assert window.scene.workflow.nodes == {} and window.windowTitle() == "Untitled — Sluice"
    assert window.open_file(str(path))
    assert window.scene.workflow.to_dict() == saved
    assert set(window.scene.node_items) == set(saved_ids(saved)) and len(window.scene.wire_items) == 2
    assert window.windowTitle() == "graph.json — Sluice"


def saved_ids(data):
    return [node["id"] for node in data["nodes"]]


def test_unsaved_changes_prompt_can_cancel_or_discard(make_window):
    window = make_window()
    build_graph(window)
    window.prompt_unsaved = lambda: "cancel"
    window.new_document()
    assert len(window.scene.workflow.nodes) == 3
    window.prompt_unsaved = lambda: "discard"
    window.new_document()
    assert window.scene.workflow.nodes == {}


def test_dropping_a_json_file_or_a_png_with_an_embedded_workflow_opens_it(make_window, tmp_path):
    source = make_window()
    build_graph(source)
    expected = source.scene.workflow.to_dict()
    json_path = tmp_path / "dropped.json"
    source.scene.workflow.save(json_path)
    png_path = tmp_path / "image.png"
    info = PngInfo()
    info.add_text("workflow", json.dumps(expected))
    Image.new("RGB", (8, 8), "white").save(png_path, pnginfo=info)

    window = make_window()
    drop_file(window.view, json_path)
    assert window.scene.workflow.to_dict() == expected
    assert window.file_path == str(json_path.resolve())
    window.new_document()
    drop_file(window.view, png_path)
    assert window.scene.workflow.to_dict() == expected
    assert window.file_path is None  # saving must not overwrite the image
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    drop_file(window.view, bad)
    assert "invalid JSON" in window.status_label.text()
    assert window.scene.workflow.to_dict() == expected


def test_crash_recovery_restores_the_autosaved_document_and_clean_exit_does_not(make_window, monkeypatch):
    crashed = make_window()
    build_graph(crashed)
    crashed.autosave_now()  # the debounced autosave, written now
    expected = crashed.scene.workflow.to_dict()
    # No clean exit happened (the window is still open, as after a crash): a new window offers the file.
    restored = make_window(auto_restore=True)
    assert restored.scene.workflow.to_dict() == expected
    assert restored.windowTitle() == "Untitled* — Sluice"
    assert restored.recovery.should_offer()

    declined = make_window(auto_restore=False)
    assert declined.scene.workflow.nodes == {}

    for window in (crashed, restored, declined):
        window.close()
    assert not crashed.recovery.should_offer()
    monkeypatch.setenv("SLUICE_AUTO_RESTORE", "1")
    after_clean_exit = make_window()
    assert after_clean_exit.scene.workflow.nodes == {}


def test_window_geometry_and_docks_are_restored(make_window):
    first = make_window()
    first.resize(760, 620)
    first.findChild(type(first.palette.parent()), "dock_queue").hide()
    first.close()
    second = make_window()
    assert (second.width(), second.height()) == (760, 620)
    assert not second.findChild(type(second.palette.parent()), "dock_queue").isVisible()


def test_default_screenshot_and_shortcuts_dialog(make_window, screenshot, qtbot):
    window = make_window()
    build_graph(window)
    scene = window.scene
    gradient = scene.add_node("GuiGradient", (0, 260))
    preview = scene.add_node("GuiPreview", (320, 260))
    scene.connect_ports(scene.node_items[gradient].outputs[0], scene.node_items[preview].inputs["image"])
    scene.node_items[gradient].setSelected(True)
    window.fit_action.trigger()
    qtbot.wait(20)
    path = screenshot(window, "main_window_default.png")
    assert path.stat().st_size > 10_000
    assert window.inspector.node_id == gradient
    assert window.shortcuts_action.shortcut().toString() == "F1"


def test_the_default_workflow_opens_as_an_unsaved_untitled_document(make_window, app_data):
    default = Workflow()
    default.add_node("GuiNumber", {"value": 9})
    folder = app_data / "no_resources" / "workflows"  # the fixture's resources folder
    folder.mkdir(parents=True)
    default.save(folder / "default.json")
    window = make_window()
    assert window.scene.workflow.to_dict() == default.to_dict()
    assert window.file_path is None and window.windowTitle() == "Untitled — Sluice"


@pytest.mark.parametrize("name, content, expected", [
    ("a non-UTF-8 byte", b'{"file": null, "workflow": {"format": "sluice-workflow", "meta": "\xff"}}',
     "not UTF-8"),
    ("deep nesting", b'{"workflow": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper"),
    ("a huge integer position", b'{"file": null, "workflow": {"format": "sluice-workflow", "version": 2, '
     b'"nodes": [{"id": "1", "type": "GuiNumber", "pos": [1' + b"0" * 400 + b', 0]}], "links": []}}',
     "integer of 401 digits"),
    ("a position past the canvas", b'{"file": null, "workflow": {"format": "sluice-workflow", "version": 2, '
     b'"nodes": [{"id": "1", "type": "GuiNumber", "pos": [1e300, 0]}], "links": []}}', "field 'pos'"),
])
def test_a_bad_recovery_file_is_reported_and_set_aside_and_the_window_starts(make_window, app_data, caplog,
                                                                            name, content, expected):
    app_data.mkdir(parents=True, exist_ok=True)
    recovery = app_data / "recovery.json"
    recovery.write_bytes(content)
    window = make_window(auto_restore=True)
    assert window.scene.workflow.nodes == {}  # the default workflow (none in these tests), not a crash
    message = window.status_label.text()
    assert "recovery file" in message and expected in message and "recovery.json.bad" in message
    assert expected in caplog.text
    assert not recovery.exists() and (app_data / "recovery.json.bad").read_bytes() == content
    assert not window.recovery.should_offer()


def test_a_bad_recovery_file_restored_by_answering_yes_is_set_aside_and_the_window_starts(
        make_window, app_data, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app import main_window

    asked = []
    monkeypatch.delenv("SLUICE_AUTO_RESTORE", raising=False)
    monkeypatch.setattr(main_window.QMessageBox, "question",
                        lambda *args: asked.append(args[1]) or QMessageBox.StandardButton.Yes)
    app_data.mkdir(parents=True, exist_ok=True)
    content = b'{"file": null, "workflow": {"format": "sluice-workflow", "meta": "\xff"}}'
    (app_data / "recovery.json").write_bytes(content)
    window = make_window(auto_restore=None)  # asks, as a start without SLUICE_AUTO_RESTORE does
    assert asked == ["Restore unsaved work?"]
    assert window.scene.workflow.nodes == {}
    assert "not UTF-8" in window.status_label.text() and "recovery.json.bad" in window.status_label.text()
    assert (app_data / "recovery.json.bad").read_bytes() == content

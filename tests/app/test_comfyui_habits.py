"""ComfyUI users' habits (issue 20, point 5): left-drag pans and Ctrl+drag selects, ports that fit light up
while a wire is dragged, new seeds randomize (so a second Queue runs a new seed), sampler lists name each
sampler once, combos open with one click, the settings dialog, a dialog for a failed node, and a question
before closing during a run."""

import json

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QListWidget, QMessageBox

from app.settings_dialog import LEFT_DRAG_KEY, SettingsDialog
from engine.settings import load_settings
from engine.telemetry import bus
from nodes.sampling import KSampler

TIMEOUT_MS = 15000
CONTROL = Qt.KeyboardModifier.ControlModifier
NO_MODIFIER = Qt.KeyboardModifier.NoModifier


def left_drag(view, start: QPoint, end: QPoint, modifiers=NO_MODIFIER) -> None:
    viewport = view.viewport()
    QTest.mousePress(viewport, Qt.MouseButton.LeftButton, modifiers, start)
    for step in range(1, 6):
        QTest.mouseMove(viewport, start + (end - start) * step / 5)
    QTest.mouseRelease(viewport, Qt.MouseButton.LeftButton, modifiers, end)


def empty_spot(view) -> QPoint:
    """A viewport point with no item under it (below and right of the nodes)."""
    spot = view.mapFromScene(QPointF(900, 700))
    assert view.itemAt(spot) is None
    return spot


def test_left_drag_on_empty_canvas_pans_and_ctrl_drag_draws_a_selection_box(make_window):
    window = make_window()
    scene, view = window.scene, window.view
    first = scene.add_node("GuiNumber", (0, 0))
    second = scene.add_node("GuiSink", (320, 0))
    view.resetTransform()
    view.centerOn(400, 300)
    start = empty_spot(view)
    under = view.mapToScene(start)
    left_drag(view, start, start + QPoint(60, 40))
    after = view.mapToScene(start + QPoint(60, 40))
    assert abs(after.x() - under.x()) < 2 and abs(after.y() - under.y()) < 2  # the canvas followed the mouse
    assert scene.selectedItems() == [] and scene.workflow.nodes[first].pos == (0, 0)

    corner = view.mapFromScene(QPointF(-40, -40))
    left_drag(view, corner, view.mapFromScene(QPointF(700, 300)), CONTROL)
    assert set(scene.selected_node_ids()) == {first, second}
    dragged_over = view.mapToScene(corner)
    assert abs(dragged_over.x() + 40) < 2 and abs(dragged_over.y() + 40) < 2  # Ctrl+drag did not pan

    node_item = scene.node_items[first]  # a drag that starts on a node still moves the node
    title = view.mapFromScene(node_item.mapToScene(QPointF(120, 10)))
    scene.clearSelection()
    left_drag(view, title, title + QPoint(50, 0))
    assert scene.workflow.nodes[first].pos[0] > 20


def test_the_setting_swaps_panning_and_selecting(make_window):
    window = make_window()
    window.app_settings.setValue(LEFT_DRAG_KEY, "select")
    window._apply_preferences()
    scene, view = window.scene, window.view
    number = scene.add_node("GuiNumber", (0, 0))
    view.resetTransform()
    view.centerOn(400, 300)
    corner = view.mapFromScene(QPointF(-40, -40))
    left_drag(view, corner, view.mapFromScene(QPointF(400, 300)))
    assert scene.selected_node_ids() == [number]
    start = empty_spot(view)
    under = view.mapToScene(start)
    left_drag(view, start, start + QPoint(60, 40), CONTROL)
    after = view.mapToScene(start + QPoint(60, 40))
    assert abs(after.x() - under.x()) < 2 and abs(after.y() - under.y()) < 2


def test_ports_that_fit_light_up_while_a_wire_is_dragged(make_window):
    window = make_window()
    scene, view = window.scene, window.view
    number = scene.add_node("GuiNumber", (0, 0))
    scale = scene.add_node("GuiScale", (320, 0))
    preview = scene.add_node("GuiPreview", (320, 200))
    sink = scene.add_node("GuiSink", (640, 0))
    view.fit_to_content()
    output = scene.node_items[number].outputs[0]
    viewport = view.viewport()
    start = view.mapFromScene(output.center())
    QTest.mousePress(viewport, Qt.MouseButton.LeftButton, NO_MODIFIER, start)
    QTest.mouseMove(viewport, start + QPoint(40, 30))
    assert scene.node_items[scale].inputs["number"].highlight == "fits"  # INT into INT
    assert scene.node_items[sink].inputs["value"].highlight == "fits"  # anything into "*"
    assert scene.node_items[preview].inputs["image"].highlight == "dim"  # IMAGE does not take an INT
    assert scene.node_items[scale].outputs[0].highlight == "dim"  # an output never takes a wire from one
    assert scene.node_items[number].inputs["value"].highlight == "dim"  # nor does the node itself
    assert output.highlight is None
    QTest.mouseRelease(viewport, Qt.MouseButton.LeftButton, NO_MODIFIER,
                       view.mapFromScene(scene.node_items[scale].inputs["number"].center()))
    assert [(link.source, link.target) for link in scene.workflow.links] == [(number, scale)]
    ports = [port for item in scene.node_items.values() for port in [*item.inputs.values(), *item.outputs]]
    assert all(port.highlight is None for port in ports)


def test_a_new_seed_randomizes_so_a_second_queue_runs_a_new_seed(make_window, qtbot):
    window = make_window()
    scene = window.scene
    number = scene.add_node("GuiNumber", (0, 0))
    sink = scene.add_node("GuiSink", (320, 0))
    scene.connect_ports(scene.node_items[number].outputs[0], scene.node_items[sink].inputs["value"])
    assert scene.workflow.nodes[number].seed_controls == {"seed": "randomize"}  # as ComfyUI's new nodes
    ran = []
    unsubscribe = bus.subscribe(lambda event: ran.append(event["node_id"])
                                if event.kind == "node_started" else None)
    try:
        seeds = [scene.workflow.nodes[number].widgets["seed"]]
        first = window.queue()
        seeds.append(scene.workflow.nodes[number].widgets["seed"])  # advanced as soon as the job was queued
        qtbot.waitUntil(lambda: window.runs.statuses.get(first) == "finished", timeout=TIMEOUT_MS)
        second = window.queue()
        qtbot.waitUntil(lambda: window.runs.statuses.get(second) == "finished", timeout=TIMEOUT_MS)
    finally:
        unsubscribe()
    assert seeds[0] != seeds[1]
    assert ran.count(number) == 2  # the second job ran the node again with the new seed: not "0.0 s"
    scene.undo_stack.undo()  # "Advance seeds" of the second Queue
    assert scene.workflow.nodes[number].widgets["seed"] == seeds[1]


def test_sampler_lists_show_comfyuis_names_once_and_files_keep_sd_cpp_aliases(make_window, registry):
    registry.register(KSampler, "nodes.sampling")
    window = make_window()
    scene = window.scene
    sampler = scene.add_node("KSampler", (0, 0))
    choices = KSampler.input_named("sampler_name").current_choices()
    assert "dpmpp_2m" in choices and "dpm++2m" not in choices and len(choices) == len(set(choices))
    scene.set_widget(sampler, "sampler_name", "dpm++2m")  # as an older Sluice file holds it
    assert KSampler.input_named("sampler_name").check_value("dpm++2m") is None  # still accepted
    scene.node_items[sampler].setSelected(True)
    assert window.inspector.editors["sampler_name"].currentText() == "dpm++2m"  # shown as the file says


def test_a_combo_on_a_node_opens_its_choices_with_one_click(make_window):
    window = make_window()
    scene, view = window.scene, window.view
    gradient = scene.add_node("GuiGradient", (0, 0))
    view.resetTransform()
    view.centerOn(120, 60)
    item = scene.node_items[gradient]
    row = item.mapRectToScene(item.widget_rects["tint"])
    QTest.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, NO_MODIFIER, view.mapFromScene(row.center()))
    editor = view.active_editor
    assert editor is not None and isinstance(editor.editor, QListWidget) and editor.editor.isVisible()
    assert editor.text() == "red"
    blue = editor.editor.findItems("blue", Qt.MatchFlag.MatchExactly)[0]
    QTest.mouseClick(editor.editor.viewport(), Qt.MouseButton.LeftButton, NO_MODIFIER,
                     editor.editor.visualItemRect(blue).center())
    assert scene.workflow.nodes[gradient].widgets["tint"] == "blue"  # the second click chose
    assert not editor.isVisible()


def test_settings_dialog_keeps_folders_and_default_memory_settings_that_jobs_use(
        make_window, tmp_path, monkeypatch, settings):
    settings_file = tmp_path / "config" / "settings.json"
    monkeypatch.setenv("SLUICE_SETTINGS", str(settings_file))
    window = make_window()
    dialog = window.show_settings()
    assert isinstance(dialog, SettingsDialog)
    dialog.models_edit.setText(str(tmp_path / "my_models"))
    dialog.output_edit.setText(str(tmp_path / "my_output"))
    dialog.memory_editors["max_vram"].setText("lots")
    dialog.accept()
    assert dialog.isVisible() and "lots" in dialog.problem.text()  # a bad budget is named, nothing saved
    assert not settings_file.exists()
    dialog.memory_editors["max_vram"].setText("6")
    params = dialog.memory_editors["params_backend"]
    params.setCurrentIndex(params.findData("cpu"))
    dialog.left_drag.setCurrentIndex(dialog.left_drag.findData("select"))
    dialog.accept()
    assert not dialog.isVisible()
    saved = json.loads(settings_file.read_text())
    assert saved["models_root"] == str(tmp_path / "my_models")
    assert saved["memory"] == {"params_backend": "cpu", "max_vram": "6"}
    assert settings.models_root == tmp_path / "my_models"  # the running app uses them at once
    assert window.view.left_drag_selects
    assert load_settings(env={"SLUICE_SETTINGS": str(settings_file)}).memory_defaults() == saved["memory"]

    submitted = []
    monkeypatch.setattr(window.runs.worker, "submit",
                        lambda workflow, label: submitted.append(workflow) or "job")
    sink = window.scene.add_node("GuiSink", (0, 0))
    number = window.scene.add_node("GuiNumber", (0, 200))
    window.scene.connect_ports(window.scene.node_items[number].outputs[0],
                               window.scene.node_items[sink].inputs["value"])
    window.scene.workflow.settings["memory"] = {"max_vram": "2"}  # the workflow's own setting comes first
    window.queue()
    assert submitted[0].settings["memory"] == {"params_backend": "cpu", "max_vram": "2"}
    assert window.scene.workflow.settings["memory"] == {"max_vram": "2"}  # the document is unchanged


def test_a_failed_node_opens_a_dialog_with_its_traceback_behind_details(make_window, qtbot):
    window = make_window()
    scene = window.scene
    number = scene.add_node("GuiNumber", (0, 0))
    fail = scene.add_node("GuiFail", (320, 0))
    scene.connect_ports(scene.node_items[number].outputs[0], scene.node_items[fail].inputs["value"])
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "failed", timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: getattr(window, "failure_box", None) is not None, timeout=TIMEOUT_MS)
    box = window.failure_box
    assert isinstance(box, QMessageBox) and box.isVisible() and not box.isModal()
    assert "Test Fail failed" in box.text() and "failed on purpose" in box.text()
    assert "Traceback" in box.detailedText() and "RuntimeError" in box.detailedText()
    box.close()


def test_closing_during_a_run_asks_first(make_window, qtbot):
    window = make_window()
    sleeper = window.scene.add_node("GuiSleep", (0, 0))
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.scene.node_items[sleeper].running, timeout=TIMEOUT_MS)
    questions = []
    window.confirm_close_during_run = lambda: questions.append("asked") or False
    window.close()
    assert questions == ["asked"] and window.isVisible() and window.runs.busy()
    window.confirm_close_during_run = lambda: questions.append("asked") or True
    window.close()
    assert questions == ["asked", "asked"] and not window.isVisible()
    assert window.runs.statuses.get(job_id) in (None, "interrupted")  # the worker was stopped
    assert not window.runs.worker.isRunning()

"""Editing the graph on the canvas by simulated user actions; every edit undoes back to the start."""

import json

import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

from app.search import fuzzy_score, rank_node_types
from engine.graph.document import Workflow


def viewport_point(view, scene_point: QPointF) -> QPoint:
    return view.mapFromScene(scene_point)


def drag(view, start: QPointF, end: QPointF) -> None:
    """Press at `start`, move in steps, release at `end` (scene coordinates) on the view's viewport."""
    viewport = view.viewport()
    a, b = viewport_point(view, start), viewport_point(view, end)
    QTest.mousePress(viewport, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, a)
    for step in range(1, 6):
        point = a + (b - a) * step / 5
        QTest.mouseMove(viewport, point)
    QTest.mouseRelease(viewport, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, b)


def add_by_search(window, qtbot, query: str) -> str:
    """Tab on the canvas, type the query, Enter; returns the id of the node that appeared."""
    before = set(window.scene.workflow.nodes)
    window.view.setFocus()
    QTest.keyClick(window.view, Qt.Key.Key_Tab)
    search = window.search
    qtbot.waitUntil(search.isVisible, timeout=5000)
    QTest.keyClicks(search.query, query)
    QTest.keyClick(search.query, Qt.Key.Key_Return)
    added = set(window.scene.workflow.nodes) - before
    assert len(added) == 1
    return added.pop()


def place(window, node_id: str, x: float, y: float) -> None:
    window.scene.set_node_field(node_id, "pos", (x, y))  # test setup only: outside the undo stack
    window.scene.workflow.nodes[node_id].pos = (x, y)


def test_graph_built_by_search_wire_drag_and_editor_undoes_to_empty_and_redoes(make_window, qtbot):
    window = make_window()
    scene, view = window.scene, window.view
    empty = Workflow().to_dict()
    gradient = add_by_search(window, qtbot, "gradient")
    preview = add_by_search(window, qtbot, "prvw img")  # fuzzy: letters in order
    assert scene.workflow.nodes[gradient].type == "GuiGradient"
    assert scene.workflow.nodes[preview].type == "GuiPreview"

    # Move the preview node by dragging its title bar.
    title_point = scene.node_items[preview].mapToScene(QPointF(120, 12))
    drag(view, title_point, title_point + QPointF(300, 40))
    view.centerOn(scene.node_items[gradient])
    moved_to = scene.workflow.nodes[preview].pos
    assert moved_to != scene.workflow.nodes[gradient].pos

    # Drag a wire from the image output to the preview's input.
    view.fitInView(scene.itemsBoundingRect())
    out_port = scene.node_items[gradient].outputs[0]
    in_port = scene.node_items[preview].inputs["image"]
    drag(view, out_port.scenePos(), in_port.scenePos())
    assert [(k.source, k.output, k.target, k.input, k.type) for k in scene.workflow.links] == [
        (gradient, 0, preview, "image", "IMAGE")]

    # Click the "size" widget's middle: the editor opens; type a value and press Enter.
    item = scene.node_items[gradient]
    row = item.mapRectToScene(item.widget_rects["size"])
    view_point = viewport_point(view, row.center())
    QTest.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, view_point)
    editor = view.active_editor
    assert editor is not None and editor.isVisible()
    editor.set_text("64")
    QTest.keyClick(editor.editor, Qt.Key.Key_Return)
    assert scene.workflow.nodes[gradient].widgets["size"] == 64
    # The right arrow steps by the input's step (8).
    arrow = viewport_point(view, QPointF(row.right() - 4, row.center().y()))
    QTest.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, arrow)
    assert scene.workflow.nodes[gradient].widgets["size"] == 72

    built = scene.workflow.to_dict()
    stack = scene.undo_stack
    assert window.windowTitle().startswith("Untitled*")
    while stack.canUndo():
        stack.undo()
    assert scene.workflow.to_dict() == empty
    assert not scene.node_items and not scene.wire_items
    while stack.canRedo():
        stack.redo()
    assert scene.workflow.to_dict() == built
    assert set(scene.wire_items) == {link.id for link in scene.workflow.links}


def test_incompatible_wire_is_refused_with_a_hint_naming_both_types(make_window):
    window = make_window()
    scene, view = window.scene, window.view
    number = scene.add_node("GuiNumber", (0, 0))
    preview = scene.add_node("GuiPreview", (350, 0))
    view.fitInView(scene.itemsBoundingRect())
    int_output = scene.node_items[number].outputs[0]
    drag(view, int_output.scenePos(), scene.node_items[preview].inputs["image"].scenePos())
    assert scene.workflow.links == []
    message = window.status_label.text()
    assert "INT" in message and "IMAGE" in message


def test_wire_dropped_on_empty_canvas_offers_fitting_nodes_and_connects(make_window, qtbot, screenshot):
    window = make_window()
    scene, view = window.scene, window.view
    gradient = scene.add_node("GuiGradient", (0, 0))
    view.centerOn(scene.node_items[gradient])
    start = scene.node_items[gradient].outputs[0].scenePos()
    drag(view, start, start + QPointF(200, 120))
    search = window.search
    qtbot.waitUntil(search.isVisible, timeout=5000)
    offered = {search.results.item(i).data(Qt.ItemDataRole.UserRole) for i in range(search.results.count())}
    assert offered == {"GuiPreview", "GuiSink", "GuiSleep", "GuiFail"}  # IMAGE or "*" inputs only
    assert search.results.item(0).data(Qt.ItemDataRole.UserRole) == "GuiPreview"  # the exact type first
    screenshot(search, "node_search_filtered.png")
    QTest.keyClicks(search.query, "preview")
    QTest.keyClick(search.query, Qt.Key.Key_Return)
    new_id = next(n for n in scene.workflow.nodes if n != gradient)
    assert [(k.source, k.target, k.input) for k in scene.workflow.links] == [(gradient, new_id, "image")]
    scene.undo_stack.undo()  # one step: the node and its link
    assert list(scene.workflow.nodes) == [gradient] and scene.workflow.links == []


def test_copy_paste_duplicate_modes_collapse_group_and_title_all_undo(make_window):
    window = make_window()
    scene = window.scene
    number = scene.add_node("GuiNumber", (0, 0))
    scale = scene.add_node("GuiScale", (300, 0))
    scene.connect_ports(scene.node_items[number].outputs[0], scene.node_items[scale].inputs["number"])
    start = scene.workflow.to_dict()
    start_index = scene.undo_stack.index()

    for item in scene.node_items.values():
        item.setSelected(True)
    window.copy_action.trigger()
    copied = json.loads(QApplication.clipboard().text())
    assert copied["format"] == "sluice-workflow" and len(copied["nodes"]) == 2 and len(copied["links"]) == 1
    window.paste_action.trigger()
    assert len(scene.workflow.nodes) == 4 and len(scene.workflow.links) == 2
    pasted = scene.selected_node_ids()
    assert len(pasted) == 2 and not set(pasted) & {number, scale}
    window.duplicate_action.trigger()
    assert len(scene.workflow.nodes) == 6 and len(scene.workflow.links) == 3

    window.mute_action.trigger()
    assert {scene.workflow.nodes[n].mode for n in scene.selected_node_ids()} == {"muted"}
    window.bypass_action.trigger()
    assert {scene.workflow.nodes[n].mode for n in scene.selected_node_ids()} == {"bypassed"}
    window.bypass_action.trigger()
    assert {scene.workflow.nodes[n].mode for n in scene.selected_node_ids()} == {"normal"}
    window.collapse_action.trigger()
    assert all(scene.workflow.nodes[n].collapsed for n in scene.selected_node_ids())
    window.group_action.trigger()
    assert len(scene.workflow.groups) == 1
    group_id = scene.workflow.groups[0].id
    scene.set_group_title(group_id, "Seeds")
    scene.set_title(number, "First number")
    scene.set_seed_control(number, "seed", "increment")
    window.delete_action.trigger()
    assert len(scene.workflow.nodes) == 4

    while scene.undo_stack.index() > start_index:
        scene.undo_stack.undo()
    assert scene.workflow.to_dict() == start


def test_group_title_drag_moves_its_nodes_and_undo_moves_them_back(make_window):
    window = make_window()
    scene, view = window.scene, window.view
    number = scene.add_node("GuiNumber", (0, 0))
    scene.node_items[number].setSelected(True)
    group_id = scene.create_group("Frame")
    scene.clearSelection()
    before = (scene.workflow.nodes[number].pos, scene.group_by_id(group_id).rect)
    view.fitInView(scene.itemsBoundingRect().adjusted(-100, -100, 100, 100))
    x, y, w, _ = scene.group_by_id(group_id).rect
    title = QPointF(x + w / 2, y + 10)
    drag(view, title, title + QPointF(80, 60))
    node_pos = scene.workflow.nodes[number].pos
    group_rect = scene.group_by_id(group_id).rect
    assert node_pos[0] - before[0][0] == pytest.approx(group_rect[0] - before[1][0], abs=0.02)
    assert node_pos[1] - before[0][1] == pytest.approx(group_rect[1] - before[1][1], abs=0.02)
    assert node_pos[0] > before[0][0] and node_pos[1] > before[0][1]
    scene.undo_stack.undo()
    assert (scene.workflow.nodes[number].pos, scene.group_by_id(group_id).rect) == before


def test_fuzzy_search_prefers_substrings_and_recently_used(registry):
    assert fuzzy_score("grad", "Test Gradient Image") > fuzzy_score("grdnt", "Test Gradient Image") > 0
    assert fuzzy_score("xyz", "Test Gradient Image") == 0
    ranked = [t.type_name for t in rank_node_types(registry.types(), "test", recent=["GuiSleep"])]
    assert ranked[0] == "GuiSleep" and len(ranked) == len(registry)
    by_description = [t.type_name for t in rank_node_types(registry.types(), "interruptible", [])]
    assert by_description == ["GuiSleep"]
    outputs_image = [t.type_name for t in rank_node_types(registry.types(), "", [], "IMAGE",
                                                           needs_input=False)]
    assert outputs_image == ["GuiGradient"]


def test_fit_to_view_shows_every_node(make_window):
    window = make_window()
    scene, view = window.scene, window.view
    for index in range(3):
        scene.add_node("GuiNumber", (index * 1500, index * 900))
    window.fit_action.trigger()
    visible = view.mapToScene(view.viewport().rect()).boundingRect()
    assert all(visible.contains(item.sceneBoundingRect()) for item in scene.node_items.values())

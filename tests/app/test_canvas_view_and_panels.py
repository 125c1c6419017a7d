"""The canvas view (zoom around the cursor, pan), the inspector, the palette, and unknown node types."""

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QDoubleSpinBox, QSpinBox

from app.canvas.view import NODE_TYPE_MIME
from engine.graph.document import Workflow


def wheel(view, at: QPoint, steps: int) -> None:
    event = QWheelEvent(QPointF(at), QPointF(view.viewport().mapToGlobal(at)), QPoint(0, 0),
                        QPoint(0, 120 * steps), Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier,
                        Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(view.viewport(), event)


def test_wheel_zooms_around_the_cursor_and_middle_drag_pans(make_window):
    window = make_window()
    view = window.view
    window.scene.add_node("GuiNumber", (0, 0))
    cursor = QPoint(200, 150)
    under_cursor = view.mapToScene(cursor)
    zoom = view.zoom()
    wheel(view, cursor, 2)
    assert view.zoom() > zoom * 1.3
    after = view.mapToScene(cursor)
    assert abs(after.x() - under_cursor.x()) < 2 and abs(after.y() - under_cursor.y()) < 2

    start = view.mapToScene(QPoint(300, 300))
    viewport = view.viewport()
    no_modifier = Qt.KeyboardModifier.NoModifier
    QTest.mousePress(viewport, Qt.MouseButton.MiddleButton, no_modifier, QPoint(300, 300))
    QTest.mouseMove(viewport, QPoint(350, 330))
    QTest.mouseRelease(viewport, Qt.MouseButton.MiddleButton, no_modifier, QPoint(350, 330))
    moved = view.mapToScene(QPoint(350, 330))
    assert abs(moved.x() - start.x()) < 2 and abs(moved.y() - start.y()) < 2  # the canvas followed the mouse
    assert window.scene.workflow.nodes["1"].pos == (0, 0)


def test_inspector_edits_go_through_the_undo_stack_and_follow_undo(make_window):
    window = make_window()
    scene = window.scene
    number = scene.add_node("GuiNumber", (0, 0))
    scale = scene.add_node("GuiScale", (300, 0))
    scene.node_items[scale].setSelected(True)
    inspector = window.inspector
    assert inspector.node_id == scale
    factor = inspector.editors["factor"]
    assert isinstance(factor, QDoubleSpinBox) and factor.toolTip() == "factor"
    factor.setValue(3.5)
    factor.editingFinished.emit()
    assert scene.workflow.nodes[scale].widgets["factor"] == 3.5
    scene.undo_stack.undo()
    assert scene.workflow.nodes[scale].widgets["factor"] == 2.0 and factor.value() == 2.0

    scene.clearSelection()
    scene.node_items[number].setSelected(True)
    value = inspector.editors["value"]
    assert isinstance(value, QSpinBox) and value.toolTip() == "the number to output"
    inspector.editors["seed.control"].setCurrentText("randomize")
    assert scene.workflow.nodes[number].seed_controls == {"seed": "randomize"}
    inspector.editors["__mode__"].setCurrentText("bypassed")
    assert scene.workflow.nodes[number].mode == "bypassed"
    inspector.editors["__title__"].setText("Steps")
    inspector.editors["__title__"].editingFinished.emit()
    assert scene.node_items[number].title_text() == "Steps"


def test_palette_double_click_and_drop_add_nodes(make_window):
    window = make_window()
    tree = window.palette.tree
    leaves = {}
    for item in tree.findItems("*", Qt.MatchFlag.MatchWildcard | Qt.MatchFlag.MatchRecursive):
        if item.data(0, Qt.ItemDataRole.UserRole):
            leaves[item.data(0, Qt.ItemDataRole.UserRole)] = item
    assert set(leaves) == {"GuiNumber", "GuiScale", "GuiGradient", "GuiPreview", "GuiSink", "GuiSleep",
                           "GuiFail"}
    tree.itemDoubleClicked.emit(leaves["GuiScale"], 0)
    assert [n.type for n in window.scene.workflow.nodes.values()] == ["GuiScale"]
    data = tree.mimeData([leaves["GuiSink"]])
    assert bytes(data.data(NODE_TYPE_MIME)) == b"GuiSink"
    window.palette.filter.setText("grad")
    assert not leaves["GuiGradient"].isHidden() and leaves["GuiSink"].isHidden()


def test_unknown_node_types_are_drawn_with_their_links_and_marked_invalid(make_window, tmp_path):
    window = make_window()
    workflow = Workflow()
    number = workflow.add_node("GuiNumber")
    mystery = workflow.add_node("CheckpointLoaderFromTheFuture", pos=(300, 0))
    sink = workflow.add_node("GuiSink", pos=(600, 0))
    workflow.connect(number.id, 0, mystery.id, "steps", "INT")
    workflow.connect(mystery.id, 1, sink.id, "value", "MODEL")
    path = tmp_path / "future.json"
    workflow.save(path)
    assert window.open_file(str(path))
    item = window.scene.node_items[mystery.id]
    assert item.title_text() == "CheckpointLoaderFromTheFuture (unknown)"
    assert set(item.inputs) == {"steps"} and len(item.outputs) == 2
    assert len(window.scene.wire_items) == 2
    assert window.queue() is None
    assert "unknown node type" in item.errors[0]

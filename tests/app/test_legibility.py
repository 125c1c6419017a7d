"""Legibility (issue 20, point 6): the first fit keeps node text readable, the side docks and the inspector
follow the window's size, the minimap can be hidden, and `_for_testing` nodes stay out of sight unless asked
for."""

from PySide6.QtCore import QRectF, Qt
from PySide6.QtWidgets import QDockWidget

from app.canvas.view import READABLE_TEXT_PIXELS
from app.canvas.widgets_paint import NODE_TEXT_POINTS
from engine.graph.document import Workflow
from engine.graph.spec import NodeType, Output, combo_input

LONG_NAME = "a_checkpoint_with_a_very_long_file_name_that_users_really_have_v2_pruned_fp16.safetensors"


class LongChoices(NodeType):
    display_name = "Test Long Choices"
    category = "test/gui"
    inputs = (combo_input("ckpt_name", (LONG_NAME, "short.safetensors")),)
    outputs = (Output("MODEL", "MODEL"),)

    def run(self, ctx, ckpt_name):
        return (ckpt_name,)


class Experimental(NodeType):
    display_name = "Test Experimental"
    category = "_for_testing/gui"
    outputs = (Output("INT", "INT"),)

    def run(self, ctx):
        return (1,)


def text_pixels(view) -> float:
    return NODE_TEXT_POINTS * view.logicalDpiY() / 72.0 * view.zoom()


def test_first_fit_keeps_node_text_readable_and_fit_still_shows_everything(make_window, qtbot):
    window = make_window()
    window.resize(1600, 1000)
    wide = Workflow()
    for index in range(14):  # a long row of nodes, as a big ComfyUI graph
        wide.add_node("GuiNumber", pos=(index * 420.0, (index % 3) * 320.0))
    window.set_document(wide, None)
    qtbot.wait(50)  # the first fit runs once the document is shown
    view = window.view
    assert text_pixels(view) >= READABLE_TEXT_PIXELS - 1e-6
    shown = view.mapToScene(view.viewport().rect()).boundingRect()
    assert shown.contains(window.scene.node_items["1"].sceneBoundingRect())  # the start of the graph
    assert not shown.contains(window.scene.node_items["14"].sceneBoundingRect())  # the minimap shows the rest

    window.fit_action.trigger()  # F fits everything, however small
    shown = view.mapToScene(view.viewport().rect()).boundingRect()
    assert all(shown.contains(item.sceneBoundingRect()) for item in window.scene.node_items.values())
    assert text_pixels(view) < READABLE_TEXT_PIXELS

    small = Workflow()
    small.add_node("GuiNumber", pos=(0.0, 0.0))
    window.set_document(small, None)
    qtbot.wait(50)
    shown = view.mapToScene(view.viewport().rect()).boundingRect()
    assert shown.contains(window.scene.node_items["1"].sceneBoundingRect())
    assert abs(shown.center().x() - window.scene.node_items["1"].sceneBoundingRect().center().x()) < 2


def test_side_docks_and_inspector_follow_the_window_size(make_window, registry, qtbot):
    registry.register(LongChoices, "tests/app/test_legibility.py")
    window = make_window()
    window.resize(1024, 700)
    qtbot.wait(50)
    inspector_dock = window.findChild(QDockWidget, "dock_inspector")
    small = inspector_dock.width()
    node = window.scene.add_node("LongChoices", (0, 0))
    window.scene.node_items[node].setSelected(True)
    qtbot.wait(20)
    page = window.inspector.widget()
    assert page.minimumSizeHint().width() <= window.inspector.viewport().width()  # nothing clipped
    window.resize(2560, 1440)
    qtbot.wait(50)
    assert inspector_dock.width() > 1.8 * small  # the inspector grew with the window
    assert window.view.width() > 1400
    window.resize(1024, 700)
    qtbot.wait(50)
    assert abs(inspector_dock.width() - small) < 0.15 * small


def test_the_minimap_can_be_hidden_from_the_view_menu_and_stays_hidden(make_window):
    window = make_window()
    assert window.minimap_action in window.view_menu.actions()
    assert window.minimap_action.isChecked() and window.view.minimap.isVisible()
    window.minimap_action.trigger()
    assert not window.view.minimap.isVisible()
    window.close()
    again = make_window()
    assert not again.minimap_action.isChecked() and not again.view.minimap.isVisible()


def test_for_testing_nodes_are_hidden_unless_asked_for(make_window, registry):
    registry.register(Experimental, "tests/app/test_legibility.py")
    window = make_window()

    def palette_types():
        tree = window.palette.tree
        found = tree.findItems("*", Qt.MatchFlag.MatchWildcard | Qt.MatchFlag.MatchRecursive)
        return {item.data(0, Qt.ItemDataRole.UserRole) for item in found} - {None}

    assert "Experimental" not in palette_types()
    assert "Experimental" not in {t.type_name for t in window.visible_node_types()}
    search = window.open_search(window.view.mapToScene(window.view.viewport().rect().center()))
    assert "Experimental" not in {t.type_name for t in search.node_types}
    search.close()
    window.testing_nodes_action.trigger()
    assert "Experimental" in palette_types()
    assert "Experimental" in {t.type_name for t in window.visible_node_types()}
    workflow = Workflow()
    workflow.add_node("Experimental")  # a file that uses one still opens and shows it
    window.set_document(workflow, None)
    assert window.scene.node_items["1"].node_type is Experimental
    assert isinstance(window.scene.node_items["1"].boundingRect(), QRectF)


def test_the_memory_dock_keeps_its_share_of_the_window_height(make_window, qtbot):
    window = make_window()
    memory_dock = window.findChild(QDockWidget, "dock_memory")
    heights = {}
    for width, height in ((1024, 700), (2560, 1440), (1600, 1000), (1024, 700)):
        window.resize(width, height)
        qtbot.wait(50)
        heights[height] = memory_dock.height()
        assert 0.25 * height <= memory_dock.height() <= 0.36 * height  # about 30 %
    assert heights[1440] > 1.8 * heights[700]  # the memory plots grow with a large screen
    window.resizeDocks([memory_dock], [320], Qt.Orientation.Vertical)  # the user drags its edge
    qtbot.wait(20)
    dragged = memory_dock.height()
    assert dragged > 0.36 * 700
    window.resize(1024, 900)
    qtbot.wait(50)
    assert abs(memory_dock.height() - dragged * 900 / 700) < 0.06 * dragged  # the share the user gave it

"""Before a job whose steps, image size or batch go beyond what finishes in reasonable time, the window asks
(a dialog whose default is No) and `sluice run` warns; an ordinary job is queued without a question."""

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

from app.cli import default_workflow_path
from engine.graph.document import Workflow
from engine.graph.job_guard import BATCH_WARNING, PIXELS_WARNING, STEPS_WARNING, slow_job_warnings
from engine.graph.spec import NodeType, int_input

TIMEOUT_MS = 15000


class GuiSizes(NodeType):
    """Stands for a sampler and an empty latent: the widgets the warning reads; runs at once."""

    category = "test/gui"
    output_node = True
    inputs = (int_input("width", 512, min=16, max=16384), int_input("height", 512, min=16, max=16384),
              int_input("batch_size", 1, min=1, max=4096), int_input("steps", 20, min=1, max=10000))

    def run(self, ctx, width, height, batch_size, steps):
        return ()


@pytest.fixture
def registry(registry):
    registry.register_all((GuiSizes,), "tests/app/test_slow_job_warning.py")
    return registry


def test_the_default_workflow_is_not_slow_and_each_excess_is_named():
    workflow = Workflow.load(default_workflow_path())
    assert slow_job_warnings(workflow) == []
    workflow.nodes["6"].widgets["steps"] = 10000
    workflow.nodes["5"].widgets.update(width=4096, height=4096, batch_size=64)
    steps, size, batch = slow_job_warnings(workflow)
    assert steps.startswith("10000 steps (node 6, KSampler)") and f"over {STEPS_WARNING}" in steps
    assert "4096x4096 (17 megapixels)" in size and f"over {PIXELS_WARNING / 1e6:.1f} megapixels" in size
    assert "a batch of 64 images" in batch and f"over {BATCH_WARNING}" in batch


def answer_dialog(button: QMessageBox.StandardButton, seen: list[str]) -> None:
    """Press `button` in the dialog about to open (once the modal loop runs); keep its text in `seen`."""

    def press() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(20, press)
            return
        seen.append(box.text())
        assert box.defaultButton() is box.button(QMessageBox.StandardButton.No)
        box.button(button).click()

    QTimer.singleShot(0, press)


def test_the_window_asks_before_a_long_job_and_runs_it_only_when_accepted(make_window, qtbot):
    window = make_window()
    node = window.scene.add_node("GuiSizes", (0, 0))
    window.scene.workflow.nodes[node].widgets.update(steps=1000, width=4096, height=4096)
    seen: list[str] = []
    answer_dialog(QMessageBox.StandardButton.No, seen)
    assert window.queue() is None
    assert "1000 steps" in seen[0] and "4096x4096" in seen[0] and seen[0].endswith("Run it anyway?")
    assert not window.runs.labels  # nothing queued
    answer_dialog(QMessageBox.StandardButton.Yes, seen)
    job_id = window.queue()
    assert job_id is not None and len(seen) == 2
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "finished", timeout=TIMEOUT_MS)


def test_an_ordinary_job_is_queued_without_a_question(make_window, qtbot, monkeypatch):
    window = make_window()
    window.scene.add_node("GuiSizes", (0, 0))
    monkeypatch.setattr(QMessageBox, "question", lambda *args: pytest.fail("asked about an ordinary job"))
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) == "finished", timeout=TIMEOUT_MS)

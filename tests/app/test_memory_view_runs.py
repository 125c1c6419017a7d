"""The memory view people watch: the default workflow on the embedded model, run from the window under a CPU
budget small enough that the diffusion model streams in segments; the plan before the first run, the run
itself, a second run beside the first, and the dock floated to a window of its own."""

import pytest
from PySide6.QtWidgets import QDockWidget

from app.memory_panel import DevicePlot
from engine.memory.runtime import MemoryRuntime, set_runtime
from engine.settings import resources_dir

BUDGET = {"max_vram": "cpu=0.02"}  # 20.5 MiB: the embedded UNet (26 MiB at fp32) runs in segments
STEPS = 4


@pytest.fixture
def streamed_window(make_default_window):
    previous = set_runtime(MemoryRuntime())  # a runtime of its own: the CPU budget stays in this test
    window = make_default_window(models_root=resources_dir() / "models", size=(1024, 700))
    window.scene.workflow.settings["memory"] = dict(BUDGET)
    window.scene.workflow.nodes["6"].widgets["steps"] = STEPS
    window.scene.document_changed.emit()
    yield window
    window.close()  # before the runtime goes back: a job still running is interrupted first
    set_runtime(previous)


def memory_dock(window):
    return window.findChild(QDockWidget, "dock_memory")


def test_the_plan_shows_before_the_first_run(qtbot, streamed_window, screenshot):
    panel = streamed_window.memory_panel
    qtbot.waitUntil(lambda: panel.planned is not None and panel.planned.settings is not None
                    and panel.planned.settings.max_vram == "cpu=0.02", timeout=5000)
    text = panel.plan_label.text()
    assert "diffusion" in text and "streams from RAM" in text and "copied per step" in text
    assert "vae" in text and "te" in text
    assert not panel.model.snapshot()["devices"]  # nothing has run
    panel.refresh(force=True)
    plot = panel.device_plots["cpu"]
    assert plot.budget.getData()[1][0] == pytest.approx(20.48, abs=0.01)  # in MiB, before any run
    screenshot(memory_dock(streamed_window), "memory_view_plan_before_run.png")


def test_a_streamed_run_under_a_budget_fills_the_memory_view(qtbot, streamed_window, screenshot):
    window = streamed_window
    panel = window.memory_panel

    def streaming():
        snapshot = panel.model.snapshot()
        plan = snapshot["plan"]
        return (plan is not None and plan["module"] == "diffusion" and len(plan["segments"]) > 2
                and any(s["state"] == "computing" for s in plan["segments"]) and snapshot["copied_bytes"] > 0)

    job = window.queue()
    qtbot.waitUntil(streaming, timeout=60_000)
    qtbot.wait(300)  # a few timer ticks: the panel draws what it pulled
    panel.refresh(force=True)
    snapshot = panel.model.snapshot()
    cpu = snapshot["devices"]["cpu"]
    assert cpu["budget"] == int(0.02 * 1024**3)
    assert "diffusion" in cpu["series"]["weights"] and not any("#" in m for m in cpu["series"]["weights"])
    plot: DevicePlot = panel.device_plots["cpu"]
    assert plot.scale_bytes < 4 * cpu["budget"]  # the scale fits the budget, not the 20 GiB of free RAM
    assert "copying" in panel.segment_bar.header()
    screenshot(window, "main_window_1024x700_streamed_run.png")
    screenshot(memory_dock(window), "memory_view_streamed_run.png")
    qtbot.waitUntil(lambda: window.runs.statuses.get(job) in ("finished", "failed"), timeout=120_000)
    assert window.runs.statuses[job] == "finished"

    window.scene.set_widget("6", "seed", 12345)  # a new image from the models already loaded
    second = window.queue()
    qtbot.waitUntil(lambda: window.runs.statuses.get(second) in ("finished", "failed"), timeout=120_000)
    panel.refresh(force=True)
    snapshot = panel.model.snapshot()
    assert snapshot["run"] == "run 2"
    assert [p["run"] for p in snapshot["devices"]["cpu"]["previous"]] == ["run 1"]
    assert snapshot["devices"]["cpu"]["series"]["time"][0] == 0.0  # the run's own time axis

    dock = memory_dock(window)
    assert dock.features() & QDockWidget.DockWidgetFeature.DockWidgetFloatable
    docked_height = plot.height()
    dock.setFloating(True)
    dock.resize(1100, 640)
    qtbot.wait(200)
    panel.refresh(force=True)
    assert plot.height() > docked_height  # the view grows with its window
    assert panel.throughput_plot.isVisible()  # the copy rate, where there is room for it
    screenshot(dock, "memory_view_floating_second_run.png")

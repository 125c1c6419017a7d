"""app/gui_garbage.py: while the desktop app runs, cyclic garbage made on the engine thread is collected on
the GUI thread (Qt objects destroyed on another thread warn and can crash)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

from PySide6.QtCore import QTimer

from app.gui_garbage import GuiThreadGarbageCollector

ROOT = Path(__file__).resolve().parents[2]


class _Cyclic:
    """A reference cycle holding a Qt timer, the way a closed dialog's items hold their connections."""

    collected_on: list[str] = []

    def __init__(self) -> None:
        self.me = self
        self.timer = QTimer()

    def __del__(self) -> None:
        _Cyclic.collected_on.append(threading.current_thread().name)


def _make_garbage_on_another_thread() -> list[list]:
    """Leave a `_Cyclic` unreachable on an engine thread that then allocates past the automatic threshold;
    returns those allocations (alive, so the counts that call for a collection stay up)."""
    made: list[list] = []

    def engine() -> None:
        _Cyclic()  # unreachable at once, freed only by a collection
        made.extend([] for _ in range(5 * gc.get_threshold()[0]))

    thread = threading.Thread(target=engine, name="engine-thread")
    thread.start()
    thread.join(30)
    return made


def test_cyclic_garbage_of_the_engine_thread_is_collected_on_the_gui_thread(qtbot) -> None:
    _Cyclic.collected_on.clear()
    collector = GuiThreadGarbageCollector(interval_ms=10)
    collector.start()
    try:
        made = _make_garbage_on_another_thread()
        assert _Cyclic.collected_on == []  # no collection ran on the engine thread
        qtbot.waitUntil(lambda: bool(_Cyclic.collected_on), timeout=5000)
        assert _Cyclic.collected_on == [threading.main_thread().name]
        del made
    finally:
        collector.stop()
    assert gc.isenabled()


def test_without_the_collector_an_engine_thread_collects_qt_objects() -> None:
    """The failure the collector prevents: the automatic collection runs on the allocating thread."""
    _Cyclic.collected_on.clear()
    assert gc.isenabled()
    made = _make_garbage_on_another_thread()
    del made
    gc.collect()
    assert _Cyclic.collected_on == ["engine-thread"]


_RUN_THE_APP = """
import gc, sys
from pathlib import Path
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
from app import main_window
from engine.settings import Settings

folder = Path(sys.argv[1])
main_window.resources_dir = lambda: folder / "no_resources"
main_window.MainWindow.prompt_unsaved = lambda self: "discard"
seen = []

def look_then_quit():
    seen.append(gc.isenabled())
    for widget in QApplication.topLevelWidgets():
        widget.close()
    QApplication.instance().quit()

application = QApplication(sys.argv)  # run_gui uses it; the timer needs it first
QTimer.singleShot(200, look_then_quit)
code = main_window.run_gui(Settings(models_root=folder / "models", output_dir=folder / "output",
                                    plugins_dir=None))
print("exit", code, "enabled while running", seen, "enabled after", gc.isenabled())
"""


def test_the_desktop_app_collects_on_the_gui_thread_while_it_runs(tmp_path) -> None:
    """In a process of its own: run_gui quits the QApplication, which later tests in this one share."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", SLUICE_APP_DATA=str(tmp_path / "app_data"))
    env.pop("SLUICE_AUTO_RESTORE", None)
    result = subprocess.run([sys.executable, "-c", _RUN_THE_APP, str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # automatic collection was off while the app ran, and is on again after it quit
    assert result.stdout.strip().splitlines()[-1] == "exit 0 enabled while running [False] enabled after True"

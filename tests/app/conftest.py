"""GUI test fixtures: offscreen Qt, an isolated app data folder, small test node types, a main window.

Every test here shares one QApplication: a test that quits it (app.main_window.run_gui does, when its
window closes) must run in a process of its own (see test_gui_garbage.py), or later tests that wait on
the engine thread time out."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import gc  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402
from PySide6.QtCore import QCoreApplication, QEvent  # noqa: E402

from engine.graph.spec import (  # noqa: E402
    ANY,
    FLOAT,
    INT,
    NodeType,
    Output,
    combo_input,
    float_input,
    int_input,
    link_input,
    seed_input,
)
from engine.settings import Settings  # noqa: E402
from engine.telemetry import bus  # noqa: E402
from nodes.registry import NodeRegistry, default_registry  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
RELEASE_SLEEPER = threading.Event()  # GuiSleep runs until this is set (or it is interrupted)


class GuiNumber(NodeType):
    display_name = "Test Number"
    category = "test/gui"
    description = "Outputs its value (a test node)."
    inputs = (int_input("value", 3, min=0, max=100, description="the number to output"),
              seed_input("seed", 7))
    outputs = (Output("INT", INT),)

    def run(self, ctx, value, seed):
        return (value,)


class GuiScale(NodeType):
    display_name = "Test Scale"
    category = "test/gui"
    description = "Multiplies an integer by a factor."
    inputs = (link_input("number", INT), float_input("factor", 2.0, min=0.0, max=10.0, step=0.5))
    outputs = (Output("FLOAT", FLOAT),)

    def run(self, ctx, number, factor):
        return (number * factor,)


class GuiGradient(NodeType):
    display_name = "Test Gradient Image"
    category = "test/gui"
    description = "A small RGB gradient image, tinted by a colour; reports a step preview."
    inputs = (int_input("size", 48, min=8, max=256, step=8), combo_input("tint", ("red", "green", "blue")))
    outputs = (Output("IMAGE", "IMAGE"),)

    def run(self, ctx, size, tint):
        ramp = np.linspace(0, 255, size, dtype=np.float32)
        image = np.zeros((size, size, 3), np.uint8)  # (H, W, RGB)
        channel = ("red", "green", "blue").index(tint)
        image[:, :, channel] = ramp[None, :].astype(np.uint8)
        image[:, :, (channel + 1) % 3] = ramp[:, None].astype(np.uint8)
        ctx.report_progress(1, 2)
        ctx.report_preview(image)
        ctx.report_progress(2, 2)
        return (image,)


class GuiPreview(NodeType):
    display_name = "Test Preview Image"
    category = "test/gui"
    description = "Writes the image as a PNG to the output folder and publishes image_preview."
    output_node = True
    inputs = (link_input("image", "IMAGE"),)

    def run(self, ctx, image):
        path = ctx.settings.output_path("gui_test/preview", "png")
        Image.fromarray(image).save(path)
        bus.publish("image_preview", node_id=ctx.node_id, path=str(path))
        return ()


class GuiSink(NodeType):
    display_name = "Test Sink"
    category = "test/gui"
    description = "An output node that accepts anything."
    output_node = True
    inputs = (link_input("value", ANY),)

    def run(self, ctx, value):
        return ()


class GuiSleep(NodeType):
    display_name = "Test Sleep"
    category = "test/gui"
    description = "Waits in small interruptible steps until the test releases it."
    output_node = True
    inputs = (link_input("value", ANY, optional=True),)

    def run(self, ctx, value):
        step = 0
        while not RELEASE_SLEEPER.wait(0.005):
            ctx.check_interrupt()
            step += 1
            ctx.report_progress(step % 100, 100)
        return ()


class GuiFail(NodeType):
    display_name = "Test Fail"
    category = "test/gui"
    description = "Always raises."
    output_node = True
    inputs = (link_input("value", ANY),)

    def run(self, ctx, value):
        raise RuntimeError("the test node failed on purpose")


TEST_TYPES = (GuiNumber, GuiScale, GuiGradient, GuiPreview, GuiSink, GuiSleep, GuiFail)


@pytest.fixture(autouse=True, scope="session")
def freeze_imported_objects():
    """Move what the imports made (torch, Qt, the engine) out of the collector's sight, so that the
    collection after each test below looks only at what tests made."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def collect_garbage_between_tests(freeze_imported_objects):
    """After each GUI test, delete its Qt objects and collect its cyclic garbage while no engine thread runs.

    Once, in a fresh clone's suite, the interpreter crashed (SIGSEGV) in a garbage collection that began on
    the GUI thread while test_default_workflow_gui's engine thread was running a job; the collection was
    freeing garbage left by earlier tests. Collecting at each test's end leaves later tests little to free.
    """
    yield
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    gc.collect()


@pytest.fixture
def registry():
    registry = NodeRegistry()
    registry.register_all(TEST_TYPES, "tests/app/conftest.py")
    return registry


@pytest.fixture
def app_data(tmp_path, monkeypatch):
    folder = tmp_path / "app_data"
    monkeypatch.setenv("SLUICE_APP_DATA", str(folder))
    monkeypatch.delenv("SLUICE_AUTO_RESTORE", raising=False)
    return folder


@pytest.fixture
def settings(tmp_path):
    return Settings(models_root=tmp_path / "models", output_dir=tmp_path / "output", plugins_dir=None)


@pytest.fixture
def make_window(qtbot, app_data, settings, registry, monkeypatch):
    """Build a shown MainWindow on the test registry; it never prompts (not even when closed during a run),
    and it opens no default workflow."""
    from app import main_window, theme

    monkeypatch.setattr(main_window, "resources_dir", lambda: app_data / "no_resources")
    theme.apply_dark_theme(qtbot_app())
    RELEASE_SLEEPER.clear()
    windows = []  # strong references: qtbot keeps only weak ones, and a window collected mid-paint crashes

    def make(**options):
        window = never_prompting(main_window.MainWindow(settings, registry, **options))
        windows.append(window)
        window.show()
        qtbot.waitExposed(window)
        return window

    yield make
    RELEASE_SLEEPER.set()
    for window in windows:
        window.close()
        window.deleteLater()  # deleted now, not whenever the garbage collector finds the window
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


def never_prompting(window):
    """`window`, made to answer its own questions: unsaved changes are discarded and closing during a run
    goes ahead (a test that fails or ends with a job running would otherwise wait on a modal dialog)."""
    window.prompt_unsaved = lambda: "discard"
    window.confirm_close_during_run = lambda: True
    return window


@pytest.fixture
def make_default_window(qtbot, app_data, tmp_path):
    """Build a shown MainWindow on the default registry (the real nodes, the default workflow, the embedded
    model); it never prompts, and teardown closes it, interrupting a job still running."""
    from app import main_window, theme

    theme.apply_dark_theme(qtbot_app())
    windows = []

    def make(models_root: Path | None = None, size: tuple[int, int] | None = None):
        settings = Settings(models_root=models_root or tmp_path / "models", output_dir=tmp_path / "output",
                            plugins_dir=None)
        window = never_prompting(main_window.MainWindow(settings, default_registry(settings)))
        windows.append(window)
        if size is not None:
            window.resize(*size)
        window.show()
        qtbot.waitExposed(window)
        return window

    yield make
    for window in windows:
        window.close()
        window.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


def qtbot_app():
    from PySide6.QtWidgets import QApplication

    return QApplication.instance()


@pytest.fixture
def screenshot():
    """Save `widget.grab()` as tests/artifacts/NAME (git-ignored) and return the path."""

    def save(widget, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        assert widget.grab().save(str(path))
        return path

    return save


@pytest.fixture
def release_sleeper():
    return RELEASE_SLEEPER

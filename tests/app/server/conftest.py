"""Server test fixtures: settings in a temporary folder (the embedded model is found as always), the default
registry plus small test node types, and `start_server(**options)`, which serves in-process on a free
loopback port and stops at the end of the test."""

import tempfile
import threading

import pytest

from app.server.server import BackgroundServer, ServerOptions, SluiceServer
from engine.graph.spec import ANY, NodeType, link_input
from engine.settings import Settings
from nodes.registry import default_registry

RELEASE = threading.Event()  # ServeWait runs until this is set (or it is interrupted)


class ServeWait(NodeType):
    category = "test/serve"
    description = "An output node that waits in interruptible steps until the test releases it."
    output_node = True
    inputs = (link_input("value", ANY, optional=True),)

    def run(self, ctx, value):
        step = 0
        while not RELEASE.wait(0.005):
            ctx.check_interrupt()
            step += 1
            ctx.report_progress(step % 100, 100)
        return ()


class ServeFail(NodeType):
    category = "test/serve"
    description = "An output node that always raises."
    output_node = True
    inputs = (link_input("value", ANY, optional=True),)

    def run(self, ctx, value):
        raise RuntimeError("the test node failed on purpose")


@pytest.fixture
def serve_settings(tmp_path, monkeypatch):
    for name in ("SLUICE_MODELS", "SLUICE_OUTPUT", "SLUICE_PLUGINS", "SLUICE_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "no-settings.json"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the preview folder (type "temp") of this test
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)
    return Settings(models_root=tmp_path / "models", output_dir=tmp_path / "output", plugins_dir=None)


@pytest.fixture
def serve_registry(serve_settings):
    registry = default_registry(serve_settings)
    registry.register_all((ServeWait, ServeFail), "tests/app/server/conftest.py")
    return registry


@pytest.fixture
def start_server(serve_settings, serve_registry, one_torch_thread):
    """start_server(**ServerOptions fields) -> (url, SluiceServer); stopped after the test."""
    running = []
    RELEASE.clear()

    def start(**options):
        server = SluiceServer(serve_settings, serve_registry, ServerOptions(**options))
        background = BackgroundServer(server)
        url = background.__enter__()
        running.append(background)
        return url, server

    yield start
    RELEASE.set()
    for background in running:
        background.__exit__(None, None, None)


@pytest.fixture
def release():
    return RELEASE

"""A cluster job carries the input-folder files it names (engine/cluster/inputs.py): a worker's input folder
is its own, so a LoadImage of an uploaded file must find the file there. Here the worker runs in-process
(the class a Ray actor wraps); tests/app/server/test_serve_ray.py runs it on Ray behind `sluice serve`."""

from __future__ import annotations

import io
import os
import threading
import time

import numpy as np
import pytest
from PIL import Image

from engine.cluster.inputs import job_inputs, write_inputs
from engine.cluster.worker import SluiceWorker
from engine.graph.document import Workflow
from engine.settings import resources_dir
from nodes.registry import default_registry


def _load_and_save(*names: str, mode: str = "normal") -> Workflow:
    workflow = Workflow()
    for index, name in enumerate(names):
        load = workflow.add_node("LoadImage", widgets={"image": name})
        save = workflow.add_node("SaveImage", widgets={"filename_prefix": f"copy{index}"})
        workflow.connect(load.id, 0, save.id, "images", "IMAGE")
        load.mode = mode
    return workflow


def _png(color: tuple[int, int, int], size: int = 12) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def registry():
    return default_registry(None)


def test_a_job_carries_the_input_files_its_active_nodes_name(tmp_path, registry):
    folder = tmp_path / "input"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.png").write_bytes(b"a")
    (folder / "sub" / "b.png").write_bytes(b"b")
    (tmp_path / "secret.png").write_bytes(b"secret")
    os.symlink(tmp_path / "secret.png", folder / "link.png")
    workflow = _load_and_save("a.png", "sub/b.png", "missing.png", "../secret.png", "link.png",
                              str(tmp_path / "secret.png"))
    assert job_inputs(workflow, registry.get, folder) == {"a.png": b"a", "sub/b.png": b"b"}
    assert job_inputs(_load_and_save("a.png", mode="bypassed"), registry.get, folder) == {}


def test_written_inputs_keep_their_time_when_the_bytes_are_the_same(tmp_path):
    write_inputs(tmp_path, {"x/pic.png": b"one"})
    path = tmp_path / "x" / "pic.png"
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    write_inputs(tmp_path, {"x/pic.png": b"one"})
    assert path.stat().st_mtime_ns == 1_000_000_000  # a repeated job's LoadImage stays cached
    write_inputs(tmp_path, {"x/pic.png": b"two"})
    assert path.read_bytes() == b"two" and not list(tmp_path.glob("x/.*"))
    for name in ("../out.png", "/etc/passwd", ""):
        with pytest.raises(ValueError, match="not a name inside the input folder"):
            write_inputs(tmp_path, {name: b"x"})
    assert not (tmp_path.parent / "out.png").exists()


def test_a_worker_loads_the_files_its_job_carries(tmp_path, registry):
    worker = SluiceWorker(default_registry)
    try:
        pixels = (200, 30, 90)
        document = _load_and_save("uploads/pic.png").dumps()
        result = worker.run(document, "job", {"uploads/pic.png": _png(pixels)})
        assert result.status == "finished", result.message
        ((name, data),) = result.images
        with Image.open(io.BytesIO(data)) as image:
            assert (np.asarray(image.convert("RGB")) == pixels).all()
        without = worker.run(_load_and_save("other.png").dumps(), "job2")
        assert without.status == "failed" and "other.png" in without.message
    finally:
        worker.close()


def test_a_worker_reports_its_latest_preview_frame_once(registry):
    worker = SluiceWorker(default_registry)
    workflow = Workflow.load(resources_dir() / "workflows" / "default.json")
    sampler = next(node for node in workflow.nodes.values() if node.type == "KSampler")
    sampler.widgets["steps"] = 10000  # interrupted once a frame came
    latent = next(node for node in workflow.nodes.values() if node.type == "EmptyLatentImage")
    latent.widgets.update(width=64, height=64)
    workflow.settings["preview"] = {"method": "auto"}
    results = []
    running = threading.Thread(target=lambda: results.append(worker.run(workflow.dumps(), "sampling")))
    running.start()
    try:
        frame = None
        deadline = time.monotonic() + 120
        while frame is None and time.monotonic() < deadline and running.is_alive():
            _, _, _, frame = worker.report("sampling", 0, -1)
            time.sleep(0.02)
        assert frame is not None, results
        serial, jpeg = frame
        with Image.open(io.BytesIO(jpeg)) as image:
            assert image.format == "JPEG" and image.size == (64, 64)
        assert worker.report("sampling", 0, None)[3] is None  # a caller that takes no frames gets none
        assert worker.report("another job", 0, -1) == (worker.name, [], None, None)
        newer = worker.report("sampling", 0, serial)[3]
        assert newer is None or newer[0] > serial
    finally:
        worker.interrupt()
        running.join(60)
        worker.close()
    assert results and results[0].status == "interrupted"

"""The desktop app's queue on a server (issue 19, item 5): the window's RunController sends its jobs to a
`sluice serve` running in this process on the embedded model, and shows them as it shows local ones; a
server that cannot be reached, or refuses the token, is an error the window shows, and the worker goes on."""

import json
import socket

import numpy as np
from PIL import Image
from serve_client import request

from app.queue_target import QueueTarget, set_queue_target
from app.server.server import BackgroundServer, ServerOptions, SluiceServer
from app.server_worker import ServerWorker
from app.worker import EngineWorker
from engine.graph.executor import Executor
from engine.settings import Settings, default_settings_file
from engine.telemetry import EventBus
from nodes.registry import default_registry

SAMPLER = "6"  # the default workflow's KSampler


def point_queue_at(window, url, token=None):
    """What OK in the settings dialog does for the queue: the settings file's target, taken by the window."""
    set_queue_target(window.settings, QueueTarget(url, token))
    window.runs.apply_queue_target()


def recorded_events(worker):
    events = []
    worker.bus.subscribe(events.append)
    return events


def wait_for_status(qtbot, window, job_id, timeout=120_000):
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) is not None, timeout=timeout)
    return window.runs.statuses[job_id]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_default_workflow_queued_on_a_server_shows_its_image_equal_to_a_local_run(
        qtbot, make_default_window, start_server, serve_settings, tmp_path):
    serve_settings.output_dir = tmp_path / "server-output"  # not the window's: the image must be fetched
    url, server = start_server()
    window = make_default_window()

    dialog = window.show_settings()
    assert not dialog.memory_on_server_note.isVisibleTo(dialog)  # local jobs: the memory defaults apply
    dialog.queue_place.setCurrentIndex(dialog.queue_place.findData("server"))
    assert dialog.memory_on_server_note.isVisibleTo(dialog)  # says they do not reach the server
    assert "server's own settings" in dialog.memory_on_server_note.text()
    dialog.server_edit.setText(url)
    dialog.accept()
    assert json.loads(default_settings_file().read_text())["queue"] == {"server": url}
    assert isinstance(window.runs.worker, ServerWorker) and window.runs.worker.base == url
    assert window.memory_panel.remote_label.isVisibleTo(window.memory_panel)
    assert url in window.memory_panel.remote_label.text()

    events = recorded_events(window.runs.worker)
    queued = window.scene.workflow.copy()  # the seeds the job runs with (Queue advances the document's)
    job_id = window.queue()
    assert wait_for_status(qtbot, window, job_id) == "finished"
    qtbot.waitUntil(lambda: len(window.gallery.paths()) == 1, timeout=10_000)

    (history,) = server.queue.history().values()  # the job ran on the server
    assert history["status"]["status_str"] == "success"
    (ref,) = history["outputs"]["8"]["images"]
    shown = window.gallery.paths()[0]
    assert str(shown).startswith(str(window.settings.output_dir))
    assert open(shown, "rb").read() == (serve_settings.output_dir / ref["filename"]).read_bytes()

    kinds = [event.kind for event in events]
    assert [event["node_id"] for event in events if event.kind == "node_started"] == \
        ["1", "2", "3", "4", "5", "6", "7", "8"]
    assert [(event["value"], event["max"]) for event in events
            if event.kind == "progress" and event["node_id"] == SAMPLER][-1] == (20, 20)
    assert any(event.kind == "preview" and event["node_id"] == SAMPLER for event in events)
    assert kinds[0] == "job_started" and kinds[-1] == "job_finished" and "image_saved" in kinds
    assert window.queue_panel.state_of(job_id) == "finished"

    local_settings = Settings(models_root=tmp_path / "models", output_dir=tmp_path / "local-output",
                              plugins_dir=None)
    local = Executor(default_registry(local_settings).get, EventBus(), local_settings).run(queued, "local")
    assert local.status == "finished"
    (local_image,) = (tmp_path / "local-output").glob("*.png")
    assert np.array_equal(np.asarray(Image.open(shown)), np.asarray(Image.open(local_image)))


def test_unreachable_server_is_an_error_naming_it_and_the_worker_runs_the_next_job(
        qtbot, make_default_window, serve_settings, serve_registry, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    window = make_default_window()
    window.scene.workflow.nodes[SAMPLER].widgets["steps"] = 2
    point_queue_at(window, url)
    worker = window.runs.worker

    job_id = window.queue()
    assert wait_for_status(qtbot, window, job_id, timeout=30_000) == "failed"
    message = window.status_label.text()
    assert message.startswith("Queue error: cannot reach the server at " + url), message
    assert window.queue_panel.state_of(job_id) == "failed"
    assert worker.isRunning() and window.runs.worker is worker
    assert not window.progress_bar.isVisible()

    with BackgroundServer(SluiceServer(serve_settings, serve_registry, ServerOptions()), port=port):
        second = window.queue()
        assert wait_for_status(qtbot, window, second) == "finished"
    assert window.runs.worker is worker
    qtbot.waitUntil(lambda: len(window.gallery.paths()) == 1, timeout=10_000)


def test_a_server_that_refuses_the_token_is_an_error_that_says_so(qtbot, make_default_window, start_server):
    url, server = start_server(auth_token="the-token")
    window = make_default_window()
    window.scene.workflow.nodes[SAMPLER].widgets["steps"] = 2
    for token, words in ((None, "needs an auth token"), ("wrong", "refused the auth token")):
        point_queue_at(window, url, token)
        job_id = window.queue()
        assert wait_for_status(qtbot, window, job_id, timeout=30_000) == "failed"
        assert window.status_label.text() == f"Queue error: the server at {url} {words}" + \
            (": check the token in Settings" if token else ": give it in Settings (or SLUICE_AUTH_TOKEN)")
    point_queue_at(window, url, "the-token")
    job_id = window.queue()
    assert wait_for_status(qtbot, window, job_id) == "finished"
    assert len(server.queue.history()) == 1


def test_cancel_and_interrupt_from_the_window_reach_the_server(qtbot, make_default_window, start_server):
    url, server = start_server()
    interrupts = []
    interrupt = server.executor.interrupt
    server.executor.interrupt = lambda: (interrupts.append(server.engine.executing()), interrupt())
    window = make_default_window()
    window.runs.confirm_slow_job = lambda warnings: True
    point_queue_at(window, url)
    events = recorded_events(window.runs.worker)

    window.scene.workflow.nodes[SAMPLER].widgets["steps"] = 10000
    long_job = window.queue()
    waiting_job = window.queue()
    qtbot.waitUntil(lambda: any(event.kind == "progress" and event["node_id"] == SAMPLER for event in events),
                    timeout=60_000)
    window.runs.cancel(waiting_job)  # pending here: it never reaches the server
    assert window.runs.statuses[waiting_job] == "cancelled"
    window.interrupt()
    assert wait_for_status(qtbot, window, long_job, timeout=30_000) == "interrupted"
    assert interrupts and interrupts[0][2] == SAMPLER
    assert [event["node_id"] for event in events if event.kind == "job_interrupted"] == [SAMPLER]
    assert window.status_label.text() == "Interrupted"
    (entry,) = server.queue.history().values()
    assert [name for name, _ in entry["status"]["messages"]][-1] == "execution_interrupted"

    window.scene.workflow.nodes[SAMPLER].widgets["steps"] = 2
    after = window.queue()
    assert wait_for_status(qtbot, window, after) == "finished"
    assert len(server.queue.history()) == 2


def test_the_queue_runs_here_again_when_the_setting_says_this_machine(qtbot, make_default_window,
                                                                       start_server):
    url, _ = start_server()
    window = make_default_window()
    point_queue_at(window, url)
    assert isinstance(window.runs.worker, ServerWorker)
    point_queue_at(window, None)
    assert type(window.runs.worker) is EngineWorker
    assert not window.memory_panel.remote_label.isVisibleTo(window.memory_panel)
    assert window.status_label.text() == "Jobs run on this machine"



def submit_as_queued(window, workflow):
    """Send `workflow` to the window's worker as Queue would, without the window's own validation (which
    would refuse what the server should refuse here)."""
    job_id = window.runs.worker.submit(workflow, "Job")
    window.runs.labels[job_id] = "Job"
    return job_id


def test_a_prompt_the_server_refuses_marks_the_node_it_names(qtbot, make_default_window, start_server):
    url, server = start_server()
    window = make_default_window()
    point_queue_at(window, url)
    workflow = window.scene.workflow.copy()
    workflow.nodes["1"].widgets["ckpt_name"] = "not-on-the-server.safetensors"

    job_id = submit_as_queued(window, workflow)
    assert wait_for_status(qtbot, window, job_id, timeout=30_000) == "invalid", window.status_label.text()
    assert list(window.runs.node_errors) == ["1"]
    assert "not-on-the-server.safetensors" in window.runs.node_errors["1"][0]
    assert window.status_label.text() == "Not run: the workflow is invalid"
    assert server.queue.history() == {}


def test_a_node_that_fails_on_the_server_is_marked_and_reported(qtbot, make_default_window, start_server):
    url, _ = start_server()
    window = make_default_window()
    point_queue_at(window, url)
    workflow = window.scene.workflow.copy()
    workflow.nodes[SAMPLER].widgets["steps"] = 2
    failing = workflow.add_node("ServeFail").id  # a test node type of the server's alone
    workflow.connect("7", 0, failing, "value", "IMAGE")
    failures = []
    window.runs.node_failed.connect(lambda *failure: failures.append(failure))

    job_id = submit_as_queued(window, workflow)
    assert wait_for_status(qtbot, window, job_id) == "failed", window.status_label.text()
    assert window.runs.node_errors == {failing: ["RuntimeError: the test node failed on purpose"]}
    (failure,) = failures
    assert failure[:2] == (f"node {failing}", "RuntimeError: the test node failed on purpose")
    assert "raise RuntimeError" in failure[2]  # the server's traceback


def test_interrupt_of_a_job_waiting_in_the_servers_queue_takes_it_out(qtbot, make_default_window,
                                                                       start_server, release):
    """Another client's prompt runs on the server; the window's job waits behind it until interrupted, which
    removes it from the server's queue and leaves the other prompt running."""
    url, server = start_server()
    waiting = {"1": {"class_type": "ServeWait", "inputs": {}}}
    other_id = request("POST", f"{url}/prompt", json={"prompt": waiting}).json()["prompt_id"]
    qtbot.waitUntil(lambda: server.engine.executing()[1] == other_id, timeout=10_000)
    window = make_default_window()
    point_queue_at(window, url)

    job_id = window.queue()
    qtbot.waitUntil(lambda: len(server.queue.pending()) == 1, timeout=10_000)
    window.interrupt()
    assert wait_for_status(qtbot, window, job_id, timeout=30_000) == "interrupted"
    assert server.queue.pending() == []
    assert server.engine.executing()[1] == other_id
    release.set()
    qtbot.waitUntil(lambda: other_id in server.queue.history(), timeout=10_000)
    assert list(server.queue.history()) == [other_id]

"""The queue on a server: ServerWorker has EngineWorker's interface (app/worker.py) and sends each queued job
to a running `sluice serve` (or ComfyUI) at a URL, one at a time, turning the server's websocket messages
back into the engine's events, so the RunController shows a job on a server as it shows one run here.

A job is the workflow as an API prompt (to_api_prompt), POST /prompt with a fresh client id, then that
client's websocket until `executing` with node null for the prompt. The messages become events:
execution_start -> job_started; execution_cached -> node_cached per node; executing -> node_finished of the
node before and node_started; progress -> progress; a binary preview frame -> preview of the running node;
executed -> image_saved (image_preview for a temporary image) once the image is fetched through /view into
the local output folder (the preview folder for temporary ones); execution_error -> node_failed;
execution_interrupted -> job_interrupted; then job_finished. A prompt the server refuses with problems under
its nodes is an "invalid" job, as local validation's. A server that cannot be reached, refuses the token or
goes away mid-job gives a job_error naming its URL, and the worker goes on with the next job. Interrupting
the running job POSTs /queue (delete, for a prompt still waiting on the server) and /interrupt.

The events go to a bus of the worker's own: the memory panel follows the engine's bus of this process, and
the memory of a job on a server is the server's.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
import uuid
from typing import Any

import aiohttp
from PySide6.QtCore import QObject, QThread, Signal

from app.server.remote import (
    auth_headers,
    keep_image,
    parse_message,
    preview_image,
    prompt_problems,
    server_url,
    websocket_url,
)
from app.worker import EventRelay, Job, JobQueue
from engine import telemetry
from engine.graph.comfy_export import to_api_prompt
from engine.graph.document import Workflow
from engine.graph.errors import ValidationError
from engine.graph.executor import JobResult, Lookup
from nodes.image import preview_dir

CONNECT_SECONDS = 10.0  # to open a connection to the server
REQUEST_SECONDS = 60.0  # one HTTP request, or the websocket's handshake
STOP_GRACE_MS = 5000  # stop() waits this long for an interrupted job to end before cutting its connection
ENDINGS = {"execution_success": "finished", "execution_error": "failed",  # a prompt's last message -> status
           "execution_interrupted": "interrupted"}


class ServerUnusable(Exception):
    """The server cannot run the job (unreachable, refusing the token, gone mid-job); says so with its URL."""


class ServerWorker(QThread):
    """Runs queued jobs on the server at `url`, one at a time; `job_started` and `job_finished` are emitted
    on the worker thread, as EngineWorker's."""

    job_started = Signal(str)
    job_finished = Signal(str, str, object)  # job id, status, JobResult

    def __init__(self, url: str, token: str | None, lookup: Lookup, settings: Any,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.base = server_url(url)
        self.token = token
        self.lookup = lookup
        self.settings = settings  # the local output folder, where fetched images go
        self.bus = telemetry.EventBus()
        self.queue = JobQueue()
        self.relay = EventRelay(self.bus)
        self.running_job_id: str | None = None
        self._lock = threading.Lock()
        self._remote: RemoteJob | None = None

    def submit(self, workflow: Workflow, label: str) -> str:
        """Queue a copy of `workflow`; returns the job id."""
        job = Job(uuid.uuid4().hex[:12], workflow.copy(), label)
        self.queue.put(job)
        return job.job_id

    def cancel(self, job_id: str) -> bool:
        """Remove a pending job, or interrupt it on the server when it is the running one."""
        if self.queue.remove(job_id):
            return True
        if job_id == self.running_job_id:
            self.interrupt()
            return True
        return False

    def interrupt(self) -> None:
        with self._lock:
            remote = self._remote
        if remote is not None:
            remote.request_interrupt()

    def stop(self) -> None:
        """Interrupt the running job, drop the pending ones and end the thread; a job whose server does not
        answer the interrupt in STOP_GRACE_MS loses its connection."""
        self.queue.close()
        self.interrupt()
        if not self.wait(STOP_GRACE_MS):
            with self._lock:
                remote = self._remote
            if remote is not None:
                remote.cut()
            self.wait()
        self.relay.close()

    def run(self) -> None:
        while (job := self.queue.take()) is not None:
            remote = RemoteJob(self, job)
            with self._lock:
                self._remote = remote
            self.running_job_id = job.job_id
            self.relay.current_job_id = job.job_id
            self.job_started.emit(job.job_id)
            result = remote.run()
            with self._lock:
                self._remote = None
            self.relay.current_job_id = None
            self.running_job_id = None
            self.job_finished.emit(job.job_id, result.status, result)


class RemoteJob:
    """One job on the server: its own event loop, HTTP session and websocket on the worker thread."""

    def __init__(self, worker: ServerWorker, job: Job) -> None:
        self.worker = worker
        self.job = job
        self.base = worker.base
        self.client_id = uuid.uuid4().hex
        self.prompt: dict[str, Any] = {}
        self.prompt_id: str | None = None
        self.started = time.perf_counter()
        self.execution_started = False  # the server took the prompt from its queue
        self.deleted = False  # interrupted while it waited in the server's queue, and removed from it
        self.cached: set[str] = set()
        self.running: tuple[str, float] | None = None  # node id, perf_counter() when it started
        self.executed: list[str] = []
        self._interrupt_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._background: set[asyncio.Task] = set()

    # -- other threads --

    def request_interrupt(self) -> None:
        self._interrupt_requested = True  # read once the prompt is queued, if it is not yet
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._interrupt_soon)
            except RuntimeError:  # the job's loop has ended: so has the job
                pass

    def cut(self) -> None:
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass

    # -- the worker thread --

    def run(self) -> JobResult:
        try:
            return asyncio.run(self._main())
        except ServerUnusable as error:
            message, trace = str(error), ""
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
            message, trace = f"the connection to the server at {self.base} failed: {_said(error)}", ""
        except asyncio.CancelledError:
            message, trace = f"stopped waiting for the server at {self.base}", ""
        except Exception as error:  # a bug here must not end the thread
            message, trace = f"{type(error).__name__}: {error}", traceback.format_exc()
        self._publish("job_error", message=message, traceback=trace)
        self._publish("job_finished", status="failed", seconds=time.perf_counter() - self.started)
        return JobResult(self.job.job_id, "failed", executed=self.executed)

    async def _main(self) -> JobResult:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self.prompt = to_api_prompt(self.job.workflow, self.worker.lookup)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_SECONDS)
        async with aiohttp.ClientSession(headers=auth_headers(self.worker.token), timeout=timeout) as session:
            self._session = session
            async with await self._connect() as self._ws:
                refused = await self._queue_prompt()
                if refused is not None:
                    return refused
                if self._interrupt_requested:
                    self._interrupt_soon()
                outcome = await self._follow(self._ws)
            await asyncio.gather(*self._background, return_exceptions=True)
        return self._finish(outcome)

    async def _connect(self) -> aiohttp.ClientWebSocketResponse:
        assert self._session is not None
        url = websocket_url(self.base, self.client_id)
        try:
            return await asyncio.wait_for(self._session.ws_connect(url, heartbeat=30.0), REQUEST_SECONDS)
        except aiohttp.WSServerHandshakeError as error:
            raise ServerUnusable(self._refusal(error.status, error.message)) from None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
            raise ServerUnusable(f"cannot reach the server at {self.base}: {_said(error)}; check the address "
                                 f"in Settings (Queue runs on), and that `sluice serve` runs there") from None

    def _refusal(self, status: int, message: str) -> str:
        if status == 401 and self.worker.token:
            return f"the server at {self.base} refused the auth token: check the token in Settings"
        if status == 401:
            return (f"the server at {self.base} needs an auth token: give it in Settings (or "
                    f"SLUICE_AUTH_TOKEN)")
        return f"the server at {self.base} refused the connection: {status} {message}"

    async def _queue_prompt(self) -> JobResult | None:
        """POST /prompt; a JobResult when the server refuses it."""
        assert self._session is not None
        request = {"prompt": self.prompt, "client_id": self.client_id}
        async with self._session.post(f"{self.base}/prompt", json=request,
                                      timeout=aiohttp.ClientTimeout(total=REQUEST_SECONDS)) as answer:
            try:
                body = await answer.json(content_type=None)
            except ValueError:
                body = None
        if answer.status in (401, 403):
            raise ServerUnusable(self._refusal(answer.status, answer.reason or ""))
        if answer.status == 200 and isinstance(body, dict) and isinstance(body.get("prompt_id"), str):
            self.prompt_id = body["prompt_id"]
            return None
        if body is None:
            raise ServerUnusable(f"the server at {self.base} answered POST /prompt with {answer.status} "
                                 f"{answer.reason} and no JSON: is it `sluice serve` or ComfyUI?")
        return self._refused(body)

    def _refused(self, body: Any) -> JobResult:
        """A prompt the server will not run: its node problems mark the nodes (status "invalid", as local
        validation's); without any, the server's summary is the job's error."""
        summary, problems = prompt_problems(body)
        errors = [ValidationError("bad_value", problem, node_id, node_type=class_type)
                  for node_id, class_type, problem in problems]
        seconds = time.perf_counter() - self.started
        if not errors:
            raise ServerUnusable(f"the server at {self.base} refused the workflow: {summary}")
        self._publish("job_started", node_count=0)
        self._publish("job_finished", status="invalid", seconds=seconds)
        return JobResult(self.job.job_id, "invalid", errors=errors, seconds=seconds)

    async def _follow(self, ws: aiohttp.ClientWebSocketResponse) -> tuple[str, dict[str, Any]] | None:
        """Publish the prompt's messages as events until `executing` with node null; returns its
        execution_* message, None when the websocket ended first."""
        outcome = None
        async for message in ws:
            if message.type == aiohttp.WSMsgType.BINARY:
                self._on_frame(message.data)
                continue
            parsed = parse_message(message.data) if message.type == aiohttp.WSMsgType.TEXT else None
            if parsed is None or parsed[1].get("prompt_id") != self.prompt_id:
                continue
            kind, data = parsed
            if kind == "executing" and data.get("node") is None:
                self._node_done()
                break
            if kind in ENDINGS:
                outcome = (kind, data)
            await self._on_message(kind, data)
        return outcome

    async def _on_message(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "execution_start":
            self.execution_started = True
            self._publish("job_started", node_count=len(self.prompt))
        elif kind == "execution_cached":
            self.cached = {str(node_id) for node_id in data.get("nodes", [])}
            for node_id in data.get("nodes", []):
                self._publish("node_cached", node_id=str(node_id))
        elif kind == "executing":
            self._node_done()
            node_id = str(data["node"])
            self.running = (node_id, time.perf_counter())
            self._publish("node_started", node_id=node_id,
                          node_type=self.prompt.get(node_id, {}).get("class_type"))
        elif kind == "progress" and data.get("node") is not None:
            self._publish("progress", node_id=str(data["node"]), value=data.get("value"), max=data.get("max"))
        elif kind == "executed" and str(data.get("node")) not in self.cached:
            await self._fetch_images(str(data.get("node")), (data.get("output") or {}).get("images") or [])
        elif kind == "execution_interrupted":
            self.running = None
            self._publish("job_interrupted", node_id=data.get("node_id"))
        elif kind == "execution_error":
            self.running = None
            trace = "".join(data.get("traceback") or [])
            if data.get("node_id") is not None:
                self._publish("node_failed", node_id=str(data["node_id"]), node_type=data.get("node_type"),
                              exception_type=data.get("exception_type"),
                              message=data.get("exception_message"), traceback=trace)
            else:
                self._publish("job_error", traceback=trace, message=f"the server at {self.base}: "
                              f"{data.get('exception_type')}: {data.get('exception_message')}")

    def _node_done(self) -> None:
        if self.running is not None:
            node_id, started = self.running
            self.running = None
            self.executed.append(node_id)
            self._publish("node_finished", node_id=node_id, seconds=time.perf_counter() - started)

    def _on_frame(self, frame: bytes) -> None:
        if self.running is None:
            return  # a frame before this prompt's first node: another client's prompt
        image = preview_image(frame)
        if image is not None:
            self._publish("preview", node_id=self.running[0], image=image)

    async def _fetch_images(self, node_id: str, refs: list[dict[str, Any]]) -> None:
        """Fetch an output node's images through /view: saved ones into the local output folder, temporary
        ones (PreviewImage's) into the preview folder."""
        assert self._session is not None
        for ref in refs:
            kind = ref.get("type")
            if kind not in ("output", "temp"):
                continue
            params = {key: str(ref.get(key, "")) for key in ("filename", "subfolder", "type")}
            async with self._session.get(f"{self.base}/view", params=params,
                                         timeout=aiohttp.ClientTimeout(total=REQUEST_SECONDS)) as answer:
                if answer.status != 200:
                    raise ServerUnusable(f"the server at {self.base} did not send the image "
                                         f"{params['filename']!r}: {answer.status} {answer.reason}")
                data = await answer.read()
            root = self.worker.settings.output_dir if kind == "output" else preview_dir()
            path = await asyncio.to_thread(keep_image, root, params["subfolder"], params["filename"], data)
            self._publish("image_saved" if kind == "output" else "image_preview", node_id=node_id,
                          path=str(path))

    def _interrupt_soon(self) -> None:
        if self.prompt_id is not None and self._session is not None:
            task = asyncio.ensure_future(self._interrupt())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _interrupt(self) -> None:
        """Take the prompt from the server's queue and stop it where it runs; a prompt that was only waiting
        sends no more messages, so its websocket is closed here."""
        assert self._session is not None
        try:
            async with self._session.post(f"{self.base}/queue", json={"delete": [self.prompt_id]}):
                pass
            async with self._session.post(f"{self.base}/interrupt", json={"prompt_id": self.prompt_id}):
                pass
            if not self.execution_started and await self._gone_from_server():
                self.deleted = True
                if self._ws is not None:
                    await self._ws.close()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass  # the websocket tells the job a lost server

    async def _gone_from_server(self) -> bool:
        """Whether the prompt is neither queued, running nor in the history (deleted before it ran)."""
        assert self._session is not None
        async with self._session.get(f"{self.base}/queue") as answer:
            queue = await answer.json(content_type=None)
        listed = [entry[1] for name in ("queue_running", "queue_pending") for entry in queue.get(name, [])]
        if self.prompt_id in listed:
            return False
        async with self._session.get(f"{self.base}/history/{self.prompt_id}") as answer:
            return not await answer.json(content_type=None)

    def _finish(self, outcome: tuple[str, dict[str, Any]] | None) -> JobResult:
        seconds = time.perf_counter() - self.started
        if outcome is None and self.deleted:
            self._publish("job_interrupted", node_id=None)
            status = "interrupted"
        elif outcome is None:
            raise ServerUnusable(f"the connection to the server at {self.base} ended before the job did")
        else:
            status = ENDINGS[outcome[0]]
        self._publish("job_finished", status=status, seconds=seconds)
        return JobResult(self.job.job_id, status, seconds=seconds, executed=self.executed)

    def _publish(self, kind: str, **fields: Any) -> None:
        self.worker.bus.publish(kind, job_id=self.job.job_id, **fields)


def _said(error: BaseException) -> str:
    """An exception's words, or its type's name when it has none (asyncio's TimeoutError)."""
    return str(error) or type(error).__name__

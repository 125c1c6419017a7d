"""`sluice run WORKFLOW --server URL`: run a workflow on a running `sluice serve`, whose models stay loaded
between runs, the way ComfyUI's script_examples drive ComfyUI.

The workflow is read and overridden (--set) here, sent as an API prompt with a fresh client id, and followed
on the websocket (progress lines as `sluice run` prints them) until `executing` with node null. The images
the prompt saved come through /history and /view and are written where `sluice run` writes them, the local
output folder under the server's subfolder and file name, never over a different file; when the server
shares the folder (the same file with the same bytes is already there) the path is printed as it is.
Exit codes are `sluice run`'s; a server that cannot be reached, or that refuses the token, is a usage error.
Ctrl+C asks the server to interrupt the prompt; a second Ctrl+C stops waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from app.cli import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    MEMORY_FLAGS,
    ProgressPrinter,
    _load_workflow,
    _registry,
    _settings,
    apply_overrides,
    print_saved_files,
)
from app.server.main import auth_token
from app.server.remote import (
    auth_headers,
    keep_image,
    parse_message,
    prompt_problems,
    server_url,
    websocket_url,
)
from engine.graph.comfy_export import to_api_prompt
from engine.settings import Settings
from engine.telemetry import Event


def run_on_server(path: str | Path, args: argparse.Namespace) -> int:
    settings = _settings(args)
    registry = _registry(settings)
    workflow = _load_workflow(path, registry.get)
    apply_overrides(workflow, args.set or [], registry.get)
    ignored = [name for name in MEMORY_FLAGS if getattr(args, name, None)]
    if ignored or workflow.settings.get("memory") or getattr(args, "trace", None):
        print("sluice: warning: with --server the server's memory settings apply; the memory flags, the "
              "workflow's memory settings and --trace are not used", file=sys.stderr)
    prompt = to_api_prompt(workflow, registry.get)
    run = RemoteRun(server_url(args.server), auth_token(args), prompt, workflow, settings, quiet=args.quiet,
                    show_traceback=args.traceback)
    try:
        return asyncio.run(run.main())
    except aiohttp.ClientError as error:
        print(f"sluice: cannot reach the Sluice server at {run.base}: {error}", file=sys.stderr)
        return EXIT_USAGE


class RemoteRun:
    def __init__(self, base: str, token: str | None, prompt: dict[str, Any], workflow: Any,
                 settings: Settings, quiet: bool = False, show_traceback: bool = False) -> None:
        self.base = base
        self.headers = auth_headers(token)
        self.prompt = prompt
        self.settings = settings
        self.show_traceback = show_traceback
        self.printer = ProgressPrinter(workflow, quiet=quiet)
        self.client_id = uuid.uuid4().hex
        self.prompt_id: str | None = None
        self.session: aiohttp.ClientSession | None = None
        self._interrupts = 0

    async def main(self) -> int:
        async with aiohttp.ClientSession(headers=self.headers) as self.session:
            try:
                ws = await self.session.ws_connect(websocket_url(self.base, self.client_id), heartbeat=30.0)
            except aiohttp.WSServerHandshakeError as error:
                return self._refused(error.status, error.message)
            async with ws:
                request = {"prompt": self.prompt, "client_id": self.client_id}
                async with self.session.post(f"{self.base}/prompt", json=request) as answer:
                    body = await answer.json(content_type=None)
                if answer.status != 200:
                    return self._rejected(answer.status, body)
                self.prompt_id = body["prompt_id"]
                self._catch_ctrl_c()
                try:
                    outcome = await self._follow(ws)
                finally:
                    self._release_ctrl_c()
                    self.printer.close()
            return await self._finish(outcome)

    def _refused(self, status: int, message: str) -> int:
        if status == 401:
            print("sluice: the server needs its auth token: give --auth-token TOKEN (or SLUICE_AUTH_TOKEN)",
                  file=sys.stderr)
        else:
            print(f"sluice: the server at {self.base} refused the websocket: {status} {message}",
                  file=sys.stderr)
        return EXIT_USAGE

    def _rejected(self, status: int, body: Any) -> int:
        if status in (401, 403):
            return self._refused(status, str(body))
        summary, problems = prompt_problems(body)
        print(f"sluice: invalid: {summary}", file=sys.stderr)
        for node_id, class_type, problem in problems:
            print(f"sluice: invalid: node {node_id} ({class_type}): {problem}", file=sys.stderr)
        return EXIT_FAILED

    def _catch_ctrl_c(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self._on_ctrl_c)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread: no handler
            pass

    def _release_ctrl_c(self) -> None:
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        except (ValueError, RuntimeError, NotImplementedError):
            pass

    def _on_ctrl_c(self) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            raise KeyboardInterrupt
        print("\nsluice: interrupting (Ctrl+C again to stop waiting)", file=sys.stderr)
        asyncio.get_running_loop().create_task(self._interrupt())

    async def _interrupt(self) -> None:
        assert self.session is not None
        await self.session.post(f"{self.base}/queue", json={"delete": [self.prompt_id]})
        await self.session.post(f"{self.base}/interrupt", json={"prompt_id": self.prompt_id})

    async def _follow(self, ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
        """Print the prompt's progress; returns its last execution_* message (type and data)."""
        started = time.perf_counter()
        outcome: dict[str, Any] = {"type": "lost", "data": {}}
        running: tuple[str, float] | None = None
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            parsed = parse_message(message.data)
            if parsed is None:
                continue  # not a message of ComfyUI's protocol
            kind, data = parsed
            if data.get("prompt_id") != self.prompt_id:
                continue
            if kind in ("execution_success", "execution_error", "execution_interrupted"):
                outcome = {"type": kind, "data": data}
            elif kind == "execution_cached":
                for node_id in data.get("nodes", []):
                    self._print("node_cached", node_id=node_id)
            elif kind == "progress":
                self._print("progress", node_id=data.get("node"), value=data.get("value"),
                            max=data.get("max"))
            elif kind == "executing":
                if running is not None:
                    self._print("node_finished", node_id=running[0], seconds=time.perf_counter() - running[1])
                    running = None
                node_id = data.get("node")
                if node_id is None:
                    break
                running = (node_id, time.perf_counter())
                self._print("node_started", node_id=node_id,
                            node_type=self.prompt.get(node_id, {}).get("class_type"))
        status = {"execution_success": "finished", "execution_error": "failed",
                  "execution_interrupted": "interrupted"}.get(outcome["type"], "lost")
        self._print("job_finished", status=status, seconds=time.perf_counter() - started)
        return outcome

    def _print(self, kind: str, **fields: Any) -> None:
        self.printer(Event(kind, time.perf_counter(), fields))

    async def _finish(self, outcome: dict[str, Any]) -> int:
        kind, data = outcome["type"], outcome["data"]
        if kind == "execution_interrupted":
            print("sluice: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        if kind == "execution_error":
            print(f"sluice: node {data.get('node_id')} ({data.get('node_type')}) failed: "
                  f"{data.get('exception_type')}: {data.get('exception_message')}", file=sys.stderr)
            if self.show_traceback and data.get("traceback"):
                print("".join(data["traceback"]).rstrip(), file=sys.stderr)
            return EXIT_FAILED
        if kind != "execution_success":
            print("sluice: the connection to the server ended before the prompt did", file=sys.stderr)
            return EXIT_FAILED
        print_saved_files([str(path) for path in await self._download_outputs()])
        return EXIT_OK

    async def _download_outputs(self) -> list[Path]:
        assert self.session is not None
        async with self.session.get(f"{self.base}/history/{self.prompt_id}") as answer:
            history = await answer.json(content_type=None)
        entry = history.get(self.prompt_id, {}) if isinstance(history, dict) else {}
        saved = []
        for node_output in entry.get("outputs", {}).values():
            for ref in node_output.get("images", []):
                if ref.get("type") != "output":
                    continue  # previews stay on the server, as `sluice run` keeps them out of the output
                params = {key: str(ref.get(key, "")) for key in ("filename", "subfolder", "type")}
                async with self.session.get(f"{self.base}/view", params=params) as answer:
                    answer.raise_for_status()
                    data = await answer.read()
                root = self.settings.output_dir
                saved.append(keep_image(root, params["subfolder"], params["filename"], data))
        return saved


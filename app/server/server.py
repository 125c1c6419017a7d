"""SluiceServer: ComfyUI's HTTP and websocket API on aiohttp, in front of one engine thread and a FIFO queue.

The event loop answers HTTP requests and feeds the websockets; the engine thread (engine_thread.py) runs
one prompt at a time. Messages from the engine thread reach the loop through `call_soon_threadsafe`, in
order, and each websocket has its own outgoing queue and sender task, so a slow client delays nobody else.
Preview frames and `sluice.memory` snapshots are dropped for a client that falls behind; protocol messages
are not (a client that falls too far behind is disconnected).

Every request passes one guard: with an auth token, every route and the websocket need it (`Authorization:
Bearer TOKEN`, or `?token=TOKEN` where a header cannot be set, as for a browser's websocket); without one,
a request whose Origin is not the server's own is refused (a web page must not queue prompts on a loopback
server, ComfyUI's check), and a server that listens on loopback only also refuses a Host that is not a
loopback address or localhost (a page whose DNS name was rebound to 127.0.0.1 sends its own name as both
Host and Origin). Request errors are JSON in ComfyUI's error shape with a message, never a
traceback; an unexpected failure is logged and answered with a 500 that says so.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import WSMsgType, web

from app.server.engine_thread import Engine, EngineThread
from app.server.prompts import error_entry
from app.server.queue import PromptQueue
from app.server.routes import RequestError, Routes
from engine import telemetry
from engine.graph.executor import Executor
from engine.jsonfile import JsonInputError, load_json
from engine.memory.runtime import get_runtime
from engine.settings import Settings
from nodes.registry import NodeRegistry

log = logging.getLogger("sluice.serve")
MiB = 1024 * 1024
DROP_AFTER = 32  # a client with this many messages waiting gets no more previews or memory snapshots
DISCONNECT_AFTER = 10000  # ... and is disconnected with this many
WS_MAX_MESSAGE = 64 * 1024  # the largest message a client may send on the websocket


@dataclass(frozen=True)
class ServerOptions:
    auth_token: str | None = None  # required on every request when set
    max_upload_bytes: int = 100 * MiB  # the largest request body (uploads; ComfyUI's default 100 MB)
    max_json_bytes: int = 16 * MiB  # the largest JSON body (a prompt)
    preview_method: str = "auto"  # engine/previews.py's method for prompts that do not choose one
    memory_interval: float = 0.25  # seconds between sluice.memory snapshots


def error_response(status: int, type_name: str, message: str, details: str = "") -> web.Response:
    return web.json_response({"error": error_entry(type_name, message, details), "node_errors": {}},
                             status=status)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) reaches only this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _loopback_host(host: str) -> bool:
    """Whether a request's Host names this machine without a DNS lookup: a loopback address, localhost or a
    name under .localhost (which browsers resolve to loopback themselves, RFC 6761)."""
    try:
        name = (urlsplit(f"//{host}").hostname or "").rstrip(".")
    except ValueError:  # not a host name ("[::1" ...)
        return False
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return name == "localhost" or name.endswith(".localhost")


def listen_problem(hosts: list[str], auth_token: str | None, insecure: bool) -> str | None:
    """Why the server must not listen on `hosts`, or None: a non-loopback address needs a token or
    --insecure."""
    if not hosts:
        return "--listen names no address; give one such as 127.0.0.1 or 0.0.0.0"
    exposed = [host for host in hosts if not is_loopback(host)]
    if exposed and not auth_token and not insecure:
        return (f"--listen {','.join(exposed)} would let anyone on the network run prompts and read the "
                f"output folder; give --auth-token TOKEN (or SLUICE_AUTH_TOKEN) so clients must send it, or "
                f"--insecure to serve without one")
    return None


def _is_feature_flags(text: str) -> bool:
    """Whether a client's websocket message is ComfyUI's {"type": "feature_flags", "data": {...}}."""
    try:
        message = load_json(text, "a websocket message")
    except JsonInputError:
        return False
    return isinstance(message, dict) and message.get("type") == "feature_flags"


class _Client:
    """One websocket: its outgoing queue and the task that sends it."""

    def __init__(self, sid: str, ws: web.WebSocketResponse, memory: bool) -> None:
        self.sid = sid
        self.ws = ws
        self.memory = memory  # sent sluice.memory snapshots
        self.outgoing: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self.sender = asyncio.create_task(self._send_all())

    def push(self, message: str | bytes, droppable: bool = False) -> None:
        waiting = self.outgoing.qsize()
        if droppable and waiting >= DROP_AFTER:
            return
        if waiting >= DISCONNECT_AFTER:
            log.warning("websocket client %s fell %d messages behind; disconnecting it", self.sid, waiting)
            self.close()
            return
        self.outgoing.put_nowait(message)

    def close(self) -> None:
        self.outgoing.put_nowait(None)

    async def _send_all(self) -> None:
        try:
            while (message := await self.outgoing.get()) is not None:
                if isinstance(message, bytes):
                    await self.ws.send_bytes(message)
                else:
                    await self.ws.send_str(message)
        except (ConnectionError, RuntimeError) as error:  # the client went away
            log.info("websocket client %s: %s", self.sid, error)
        finally:
            await self.ws.close()


class SluiceServer:
    """`engine(server)` makes what runs the prompts (ray_backend.py's); by default one EngineThread with its
    Executor (`executor`, None with another engine)."""

    def __init__(self, settings: Settings, registry: NodeRegistry, options: ServerOptions | None = None,
                 engine: Callable[[SluiceServer], Engine] | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.options = options or ServerOptions()
        self.queue = PromptQueue(on_change=self._queue_changed)
        self.executor: Executor | None = None
        if engine is None:
            self.executor = Executor(registry.get, telemetry.bus, settings)
            self.engine: Engine = EngineThread(self.queue, self.executor, self, settings)
        else:
            self.engine = engine(self)
        self.clients: dict[str, _Client] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._memory_task: asyncio.Task | None = None
        self._loopback_only = True  # every address it listens on is a loopback one (set by start)
        self.app = web.Application(client_max_size=self.options.max_upload_bytes, middlewares=[self._guard])
        Routes(self).add_to(self.app)

    # -- running --

    async def start(self, hosts: list[str], port: int) -> list[tuple[str, int]]:
        """Start the engine thread and listen; returns the bound (host, port) pairs."""
        self._loop = asyncio.get_running_loop()
        self._loopback_only = all(is_loopback(host) for host in hosts)
        self.engine.start()
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        try:
            for host in hosts:
                await web.TCPSite(self._runner, host, port).start()
        except BaseException:
            await self.stop()
            raise
        self._memory_task = asyncio.create_task(self._send_memory())
        return [(str(address[0]), int(address[1])) for address in self._runner.addresses]

    async def stop(self) -> None:
        if self._memory_task is not None:
            self._memory_task.cancel()
        for client in list(self.clients.values()):
            client.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    # -- messages (MessageSink; callable from any thread) --

    def send(self, event: str, data: dict[str, Any], sid: str | None) -> None:
        self._call_soon(self._push, json.dumps({"type": event, "data": data}, default=str), sid, False)

    def send_bytes(self, payload: bytes, sid: str | None) -> None:
        self._call_soon(self._push, payload, sid, True)

    def wants_bytes(self, sid: str | None) -> bool:
        return bool(self.clients) if sid is None else sid in self.clients

    def _call_soon(self, function: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop has closed: the server is stopping
            pass

    def _push(self, message: str | bytes, sid: str | None, droppable: bool) -> None:
        targets = list(self.clients.values()) if sid is None else [self.clients[sid]] if sid in self.clients \
            else []
        for client in targets:
            client.push(message, droppable)

    def features(self) -> dict[str, Any]:
        """ComfyUI's server feature flags (GET /features, and the answer to a client's feature_flags)."""
        return {"supports_preview_metadata": False, "max_upload_size": self.options.max_upload_bytes}

    def queue_info(self) -> dict[str, Any]:
        return {"exec_info": {"queue_remaining": self.queue.remaining()}}

    def _queue_changed(self) -> None:
        self.send("status", {"status": self.queue_info()}, None)

    async def _send_memory(self) -> None:
        while True:
            await asyncio.sleep(self.options.memory_interval)
            listeners = [client for client in self.clients.values() if client.memory]
            if listeners:
                text = json.dumps({"type": "sluice.memory", "data": get_runtime().snapshot()}, default=str)
                for client in listeners:
                    client.push(text, droppable=True)

    # -- the websocket --

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=WS_MAX_MESSAGE, heartbeat=30.0)
        await ws.prepare(request)
        sid = request.query.get("clientId", "") or uuid.uuid4().hex
        previous = self.clients.pop(sid, None)
        if previous is not None:  # the same client reconnecting: the old socket goes (ComfyUI's behaviour)
            previous.close()
        client = self.clients[sid] = _Client(sid, ws, request.query.get("sluice_memory", "") in ("1", "true"))
        client.push(json.dumps({"type": "status", "data": {"status": self.queue_info(), "sid": sid}}))
        executing_client, prompt_id, node_id = self.engine.executing()
        if executing_client == sid and node_id is not None:
            client.push(json.dumps({"type": "executing", "data": {"node": node_id, "display_node": node_id,
                                                                  "prompt_id": prompt_id}}))
        first_text = True
        try:
            async for message in ws:
                if message.type == WSMsgType.ERROR:
                    log.info("websocket client %s: %s", sid, ws.exception())
                elif message.type == WSMsgType.TEXT and first_text:
                    first_text = False
                    if _is_feature_flags(message.data):  # ComfyUI's negotiation: answer with the server's
                        client.push(json.dumps({"type": "feature_flags", "data": self.features()}))
        finally:
            if self.clients.get(sid) is client:
                del self.clients[sid]
            client.close()
            await client.sender
        return ws

    # -- the guard around every request --

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        token = self.options.auth_token
        if token is not None and not self._authorized(request, token):
            response = error_response(401, "unauthorized", "this server needs its auth token: send the "
                                      "header 'Authorization: Bearer TOKEN' (or ?token=TOKEN on the "
                                      "websocket URL)")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if token is None and self._loopback_only and not _loopback_host(request.host):
            return error_response(403, "forbidden_host", f"requests for host {request.host!r} are refused: "
                                  f"this server listens on loopback only and answers 127.0.0.1, [::1] and "
                                  f"localhost (another name may be a web page's DNS name rebound to this "
                                  f"machine); serve with --auth-token to accept other names")
        if token is None and not self._same_origin(request):
            return error_response(403, "forbidden_origin", f"requests from the web page at "
                                  f"{request.headers.get('Origin')!r} are refused: its origin is not this "
                                  f"server's ({request.host}); serve with --auth-token to allow other "
                                  f"origins")
        try:
            return await handler(request)
        except RequestError as error:
            return web.json_response(error.body, status=error.status)
        except web.HTTPRequestEntityTooLarge as error:
            return error_response(413, "request_too_large", f"the request body is larger than the limit of "
                                  f"{self.options.max_upload_bytes} bytes", str(error.text or ""))
        except web.HTTPException:
            raise
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("unexpected error in %s %s", request.method, request.path)
            return error_response(500, "internal_error", "the server failed on this request; its log has the "
                                  "details")

    @staticmethod
    def _authorized(request: web.Request, token: str) -> bool:
        header = request.headers.get("Authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else request.query.get("token", "")
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode("utf-8"))

    @staticmethod
    def _same_origin(request: web.Request) -> bool:
        origin = request.headers.get("Origin")
        if origin is None:
            return True
        return urlsplit(origin).netloc.lower() == request.host.lower()


class BackgroundServer:
    """A SluiceServer on its own event loop in a thread (tests, benchmarks): `with BackgroundServer(...) as
    url:` serves on a free loopback port."""

    def __init__(self, server: SluiceServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sluice-serve-loop", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        starting = asyncio.run_coroutine_threadsafe(self.server.start([self.host], self.port), self._loop)
        bound = starting.result()
        self.port = bound[0][1]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    def __exit__(self, *exc_info: Any) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

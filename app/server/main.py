"""`sluice serve [--listen [ADDR]] [--port 8188] [--auth-token TOKEN | --insecure] [--models DIR]
[--output DIR] [memory flags]`: serve ComfyUI's API until Ctrl+C (or SIGTERM).

The server binds 127.0.0.1 unless --listen says otherwise (--listen alone means 0.0.0.0, as in ComfyUI;
several addresses are separated by commas). A non-loopback address without an auth token (--auth-token or
SLUICE_AUTH_TOKEN) or an explicit --insecure is refused before anything loads. The memory flags are
`sluice run`'s and apply to every prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys

from app.cli import EXIT_OK, EXIT_USAGE, _registry, _settings, configure_memory
from app.server.server import MiB, ServerOptions, SluiceServer, listen_problem
from engine.graph.document import Workflow

TOKEN_ENV = "SLUICE_AUTH_TOKEN"


def auth_token(args: argparse.Namespace) -> str | None:
    return getattr(args, "auth_token", None) or os.environ.get(TOKEN_ENV) or None


def serve(args: argparse.Namespace) -> int:
    hosts = [host.strip() for host in args.listen.split(",") if host.strip()]
    token = auth_token(args)
    problem = listen_problem(hosts, token, args.insecure)
    if problem is not None:
        print(f"sluice: refusing to start: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if not 0 <= args.port <= 65535:
        print(f"sluice: --port {args.port} is not a port number (0 to 65535)", file=sys.stderr)
        return EXIT_USAGE
    if not math.isfinite(args.max_upload_size) or args.max_upload_size <= 0:
        print(f"sluice: --max-upload-size {args.max_upload_size:g} must be a positive number of MB",
              file=sys.stderr)
        return EXIT_USAGE
    settings = _settings(args)
    registry = _registry(settings)
    configure_memory(args, Workflow())
    options = ServerOptions(auth_token=token, max_upload_bytes=int(args.max_upload_size * MiB),
                            preview_method=args.preview_method)
    server = SluiceServer(settings, registry, options)
    try:
        return asyncio.run(_serve_until_stopped(server, hosts, args.port))
    except OSError as error:
        print(f"sluice: cannot listen on {','.join(hosts)} port {args.port}: {error}", file=sys.stderr)
        return EXIT_USAGE


async def _serve_until_stopped(server: SluiceServer, hosts: list[str], port: int) -> int:
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, stopped.set)
    bound = await server.start(hosts, port)
    for host, bound_port in bound:
        shown = f"[{host}]" if ":" in host else host
        print(f"sluice: serving ComfyUI's API on http://{shown}:{bound_port} (models "
              f"{server.settings.models_root}, output {server.settings.output_dir})", file=sys.stderr,
              flush=True)
    try:
        await stopped.wait()
    finally:
        print("sluice: stopping", file=sys.stderr)
        await server.stop()
    return EXIT_OK

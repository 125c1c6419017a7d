"""`sluice serve [--listen [ADDR]] [--port 8188] [--auth-token TOKEN | --insecure] [--models DIR]
[--output DIR] [--ray auto|ADDRESS [--workers N] [--retries N]] [memory flags]`: serve ComfyUI's API until
Ctrl+C (or SIGTERM).

The server binds 127.0.0.1 unless --listen says otherwise (--listen alone means 0.0.0.0, as in ComfyUI;
several addresses are separated by commas). A non-loopback address without an auth token (--auth-token or
SLUICE_AUTH_TOKEN) or an explicit --insecure is refused before anything loads. The memory flags are
`sluice run`'s and apply to every prompt (with --ray, on every worker: ray_backend.py).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
from typing import Any

from app.cli import (
    EXIT_OK,
    EXIT_USAGE,
    MEMORY_FLAGS,
    CommandError,
    _connect_ray,
    _registry,
    _settings,
    configure_memory,
)
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
    cluster = _ray_workers(args, settings) if getattr(args, "ray", None) else None
    engine = None
    if cluster is not None:
        from app.server.ray_backend import RayEngine

        workers = cluster[1]

        def engine(server: SluiceServer) -> RayEngine:
            return RayEngine(server.queue, server, settings, registry.get, workers, args.retries)

    server = SluiceServer(settings, registry, options, engine)
    try:
        return asyncio.run(_serve_until_stopped(server, hosts, args.port))
    except OSError as error:
        print(f"sluice: cannot listen on {','.join(hosts)} port {args.port}: {error}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if cluster is not None:
            _release(*cluster)


def _ray_workers(args: argparse.Namespace, settings: Any) -> tuple[Any, list[Any], bool]:
    """(ray, the workers started, whether this process connected Ray) for --ray; CommandError (exit 2)
    names what is wrong: Ray not installed (and how to install it), a cluster that cannot be reached."""
    from engine.cluster import ClusterError, require_ray
    from engine.cluster.scheduler import default_worker_count, start_workers
    from nodes.registry import default_registry

    if args.retries < 0:
        raise CommandError(f"--retries {args.retries}: expected 0 or more")
    try:
        ray = require_ray()
    except ClusterError as error:
        raise CommandError(str(error)) from None
    try:
        connected = _connect_ray(ray, args.ray)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise CommandError(f"--ray {args.ray}: cannot connect to Ray: {str(error).strip()}; start a cluster "
                           f"with `ray start --head` and give its address, or use --ray auto") from None
    flags = {name: getattr(args, name) for name in MEMORY_FLAGS if getattr(args, name, None)}
    try:
        count, gpus = default_worker_count(ray)
        workers = start_workers(args.workers or count, default_registry, gpus, flags,
                                str(settings.models_root), str(settings.plugins_dir) if settings.plugins_dir
                                else None)
    except ClusterError as error:
        if connected:
            ray.shutdown()
        raise CommandError(str(error)) from None
    return ray, workers, connected


def _release(ray: Any, workers: list[Any], connected: bool) -> None:
    """Kill the workers; disconnect Ray when this process connected it."""
    for handle in workers:
        ray.kill(handle, no_restart=True)
    if connected:
        ray.shutdown()


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

"""The `sluice` command: the desktop app by default, and headless subcommands (run, validate, nodes, devices,
plan, inspect, convert, serve, export).

Exit codes: 0 success, 1 invalid workflow or failed node, 2 bad usage or unreadable file, 130 interrupted.
This module never imports Qt at import time; a headless run never imports it at all. To add a subcommand,
write `_add_NAME_parser(subparsers, common)` (which sets `handler`) and `command_NAME(args) -> int`, and
call the former in `build_parser`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.graph.document import Workflow, id_sort_key
from engine.graph.errors import WorkflowError
from engine.new_files import wait_for_writes
from engine.settings import Settings, SettingsError, load_settings, resources_dir, with_memory_defaults
from nodes.registry import NodeRegistry, default_registry

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_WRITE_WAIT_S = 5.0  # how long a second Ctrl+C lets a file being written finish


def default_workflow_path() -> Path:
    return resources_dir() / "workflows" / "default.json"


class CommandError(Exception):
    """A user error the CLI reports as one line and exit code 2."""


# -- shared steps --

def _settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(models_root=args.models, output_dir=args.output, plugins_dir=args.plugins)
    named = args.models or os.environ.get("SLUICE_MODELS")  # the default folder need not exist yet
    source = "--models" if args.models else "SLUICE_MODELS"
    if named and settings.models_root.exists() and not settings.models_root.is_dir():
        raise CommandError(f"{source}: {settings.models_root} is not a folder; accepted: a folder of models "
                           f"(checkpoints/, loras/, vae/, ...)")
    if named and not settings.models_root.exists():
        print(f"sluice: warning: {source}: models folder {settings.models_root} does not exist; only the "
              f"embedded model will be found", file=sys.stderr)
    settings_file = os.environ.get("SLUICE_SETTINGS")
    if settings_file and not Path(settings_file).expanduser().exists():
        print(f"sluice: warning: SLUICE_SETTINGS: settings file {Path(settings_file).expanduser()} does not "
              f"exist; the defaults apply (the settings dialog saves there)", file=sys.stderr)
    return settings


def _registry(settings: Settings) -> NodeRegistry:
    registry = default_registry(settings)
    for failure in registry.plugin_failures:
        print(f"sluice: plugin not loaded: {failure}", file=sys.stderr)
    return registry


def _load_workflow(path: str | Path, lookup: Callable[[str], Any]) -> Workflow:
    """A Sluice, ComfyUI (UI or API) or PNG workflow file; import warnings go to stderr."""
    from engine.graph.interchange import load_any

    if not Path(path).is_file():
        raise CommandError(f"workflow file not found: {path}")
    try:
        workflow, warnings = load_any(Path(path), lookup)
    except WorkflowError as error:
        raise CommandError(f"cannot load workflow: {error}") from None
    for warning in warnings:
        print(f"sluice: warning: {warning}", file=sys.stderr)
    return workflow


def apply_memory_defaults(workflow: Workflow, settings: Settings) -> None:
    """Give the workflow the settings file's default memory settings it does not set itself."""
    memory = with_memory_defaults(workflow.settings.get("memory"), settings)
    if memory:
        workflow.settings["memory"] = memory


def parse_override(text: str) -> tuple[str, str, str]:
    """`NODE_ID.INPUT=VALUE` -> (node id, input name, value text)."""
    key, equals, value = text.partition("=")
    node_id, dot, input_name = key.partition(".")
    if not equals or not dot or not node_id or not input_name:
        raise CommandError(f"--set {text!r}: expected NODE_ID.INPUT=VALUE (e.g. --set 3.seed=42)")
    return node_id, input_name, value


def override_value(kind: str, text: str) -> Any:
    """The value of `--set`: JSON when it parses (through engine.jsonfile's limits: a NaN, an integer of
    5,000 digits or 100,000 nested lists is a CommandError), else the text; text widgets keep plain text."""
    from engine.graph.spec import COMBO, FLOAT, STRING
    from engine.jsonfile import JsonInputError, JsonSyntaxError, load_json

    try:
        value = load_json(text, "the value")
    except JsonSyntaxError:
        return text
    except JsonInputError as error:
        if kind in (STRING, COMBO):
            return text
        raise CommandError(f"--set: {error}") from None
    if kind in (STRING, COMBO) and not isinstance(value, str):
        return text
    if kind == FLOAT and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def apply_overrides(workflow: Workflow, overrides: list[str], lookup: Callable[[str], Any]) -> None:
    """Set widget values from `--set NODE_ID.INPUT=VALUE` arguments; errors name the node and its inputs."""
    for text in overrides:
        node_id, input_name, value_text = parse_override(text)
        node = workflow.nodes.get(node_id)
        if node is None:
            ids = ", ".join(sorted(workflow.nodes, key=id_sort_key)) or "none"
            raise CommandError(f"--set {text!r}: no node {node_id!r} in the workflow; node ids: {ids}")
        node_type = lookup(node.type)
        if node_type is None:
            raise CommandError(f"--set {text!r}: node {node_id} has unknown type {node.type!r}")
        widget = next((i for i in node_type.widget_inputs() if i.name == input_name), None)
        if widget is None:
            names = ", ".join(i.name for i in node_type.widget_inputs()) or "none"
            raise CommandError(f"--set {text!r}: node {node_id} ({node.type}) has no widget input "
                               f"{input_name!r}; widget inputs: {names}")
        link = workflow.links_into(node_id).get(input_name)
        if link is not None:
            raise CommandError(f"--set {text!r}: node {node_id} ({node.type}) input {input_name!r} is fed by "
                               f"a link from node {link.source}; --set changes only unlinked widget values")
        node.widgets[input_name] = override_value(widget.kind, value_text)


def leave_interrupted(signum: int = signal.SIGINT, frame: Any = None) -> None:
    """Exit 130 now, without a traceback: Ctrl+C during start-up (nothing written yet), or a second Ctrl+C
    during a job (the abort the first one offers). A file being written is finished first (new_files.py), for
    at most EXIT_WRITE_WAIT_S seconds; one cut off then leaves only its hidden partial file."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.write(2, b"\nsluice: interrupted\n")
    wait_for_writes(EXIT_WRITE_WAIT_S)  # a PNG being written is finished, not cut off
    os._exit(EXIT_INTERRUPTED)


@contextmanager
def _exit_on_ctrl_c() -> Iterator[None]:
    """While the CLI starts (imports, settings, the registry, loading the workflow), Ctrl+C exits 130 at once,
    without a traceback; a job's own handler (_interrupt_on_ctrl_c) takes over while it runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, leave_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _interrupt_on_ctrl_c(executor: Any) -> Iterator[None]:
    """The first Ctrl+C asks the executor to stop (it stops at the next step, block or tile); a second one
    exits 130 at once (leave_interrupted)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, leave_interrupted)
        print("\nsluice: interrupting (Ctrl+C again to abort)", file=sys.stderr)
        executor.interrupt()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` on a worker thread while this (main) thread waits, so a Ctrl+C handler runs at once
    even while the job is inside a long native call; the function's exception is raised here."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as error:  # handed to the waiting thread, which raises it
            outcome["error"] = error

    worker = threading.Thread(target=body, name="sluice-job", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


MEMORY_FLAGS = ("backend", "params_backend", "split_mode", "max_vram", "flash_attn", "conv_direct",
                "auto_fit", "vae_tiling", "cuda_graphs", "clip_on_cpu", "vae_on_cpu", "control_net_cpu",
                "offload_to_cpu", "dit_offload", "text_encoder_offload", "vae_offload", "disable_prefetch",
                "disable_segmented_compute", "weight_type", "tensor_type_rules")


class MemorySettingsError(Exception):
    """Memory settings of the workflow file that are not valid (exit code 1, like other invalid workflows)."""


def configure_memory(args: argparse.Namespace, workflow: Workflow) -> Any:
    """Give the process's memory runtime the CLI flags (over the workflow's settings["memory"]); returns it.

    A bad flag is a CommandError (exit 2) and bad workflow settings a MemorySettingsError (exit 1), each
    naming the value and what is accepted; every module's placement is resolved now, so an unknown device
    fails before anything loads."""
    from engine.memory.runtime import get_runtime
    from engine.placement import (
        MODULES,
        MemorySettings,
        PlacementError,
        placement_for,
        settings_from_namespace,
    )

    overrides = {name: getattr(args, name) for name in MEMORY_FLAGS if getattr(args, name, None)}
    try:
        settings_from_namespace(argparse.Namespace(**overrides))
    except PlacementError as error:
        raise CommandError(f"invalid memory flag: {error}") from None
    runtime = get_runtime()

    def resolved(settings: MemorySettings) -> MemorySettings:
        for module in MODULES:
            placement_for(module, settings, runtime.devices)
        return settings

    try:
        base = MemorySettings.from_dict(workflow.settings.get("memory", {}))
        settings = resolved(settings_from_namespace(argparse.Namespace(**overrides), base))
    except PlacementError as error:
        try:  # whose fault: the file's (exit 1), or the flags' (exit 2)
            resolved(MemorySettings.from_dict(workflow.settings.get("memory", {})))
        except PlacementError as file_error:
            raise MemorySettingsError(f"invalid settings.memory in the workflow: {file_error}") from None
        raise CommandError(f"invalid memory settings: {error}") from None
    for warning in settings.warnings:
        print(f"sluice: warning: {warning}", file=sys.stderr)
    runtime.overrides = overrides
    runtime.configure(settings)
    return runtime


def _placement_printer(quiet: bool) -> Callable[[Any], None]:
    def show(event: Any) -> None:
        if event.kind == "placement" and event.get("source") == "auto-fit" and not quiet:
            print(f"auto-fit: {event.get('module')} computes on {event.get('device')}, weights "
                  f"{event.get('params')} ({event.get('reason')})", file=sys.stderr)

    return show


def run_workflow(path: str | Path, args: argparse.Namespace) -> int:
    """Load, override, validate and run one workflow headless; the shared body of `run` and `--headless`."""
    from engine.graph.executor import Executor
    from engine.graph.job_guard import FORCE_KEY, check_device_memory, slow_job_warnings
    from engine.graph.validate import validate
    from engine.memory.trace import ChromeTrace
    from engine.telemetry import bus

    settings = _settings(args)
    registry = _registry(settings)
    workflow = _load_workflow(path, registry.get)
    apply_overrides(workflow, args.set or [], registry.get)
    if getattr(args, "force", False):
        workflow.settings[FORCE_KEY] = True
    apply_memory_defaults(workflow, settings)
    errors = validate(workflow, registry.get, settings.output_dir)
    if errors:
        for error in errors:
            print(f"sluice: invalid: {error}", file=sys.stderr)
        return EXIT_FAILED
    for warning in slow_job_warnings(workflow):
        print(f"sluice: warning: this job may take long: {warning}", file=sys.stderr)
    try:
        runtime = configure_memory(args, workflow)
    except MemorySettingsError as error:
        print(f"sluice: invalid: {error}", file=sys.stderr)
        return EXIT_FAILED
    for error in check_device_memory(workflow, runtime.devices, runtime.overrides):  # with the CLI's flags
        print(f"sluice: invalid: {error}", file=sys.stderr)
        return EXIT_FAILED
    executor = Executor(registry.get, bus=bus, settings=settings)
    printer = ProgressPrinter(workflow, quiet=args.quiet)
    unsubscribe = bus.subscribe(printer)
    unsubscribe_placements = bus.subscribe(_placement_printer(args.quiet))
    trace = ChromeTrace(args.trace, bus) if getattr(args, "trace", None) else None
    try:
        with _interrupt_on_ctrl_c(executor):
            result = run_in_thread(executor.run, workflow)
    finally:
        unsubscribe()
        unsubscribe_placements()
        printer.close()
        if trace is not None:
            print(f"sluice: trace written to {trace.close()}", file=sys.stderr)
    print_saved_files(printer.saved_files)
    if result.status == "finished":
        return EXIT_OK
    if result.status == "interrupted":
        print("sluice: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.status == "invalid":
        for error in result.errors:
            print(f"sluice: invalid: {error}", file=sys.stderr)
        return EXIT_FAILED
    failure = result.failure
    if failure is not None:
        print(f"sluice: node {failure.node_id} ({failure.node_type}) failed: {failure.exception_type}: "
              f"{failure.message}", file=sys.stderr)
        if args.traceback and failure.traceback:
            print(failure.traceback.rstrip(), file=sys.stderr)
    else:
        print(f"sluice: job {result.status}", file=sys.stderr)
    return EXIT_FAILED


# -- progress lines (a telemetry subscriber) --

def print_saved_files(paths: list[str]) -> None:
    """One saved path a line on stdout; a path with a control character (a newline could make it read as
    two paths) is printed as a quoted Python string literal instead."""
    for path in paths:
        print(path if path.isprintable() else repr(path))


SAVED_FILE_EVENT = "image_saved"  # published by nodes that write a file: bus.publish("image_saved", path=...)


class ProgressPrinter:
    """Writes one readable line per node event to stderr and collects the paths of saved files.

    Progress events become a bar redrawn in place on a terminal, and at most about ten
    "step 3/20" lines per node otherwise.
    """

    def __init__(self, workflow: Any, quiet: bool = False, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.saved_files: list[str] = []
        self._workflow = workflow
        self._terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth: dict[str, int] = {}
        self._bar_open = False
        self._lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        with self._lock:
            if event.kind == SAVED_FILE_EVENT and event.get("path") is not None:
                self.saved_files.append(str(event.get("path")))
            handler = getattr(self, f"_on_{event.kind}", None)
            if handler is not None and not self.quiet:
                handler(event)

    def close(self) -> None:
        with self._lock:
            self._end_bar()

    def _label(self, event: Any) -> str:
        node_id = str(event.get("node_id"))
        node = self._workflow.nodes.get(node_id)
        node_type = event.get("node_type") or (node.type if node is not None else "?")
        title = f" \"{node.title}\"" if node is not None and node.title else ""
        return f"[{node_id}] {node_type}{title}"

    def _line(self, text: str) -> None:
        self._end_bar()
        print(text, file=self.stream, flush=True)

    def _end_bar(self) -> None:
        if self._bar_open:
            print(file=self.stream, flush=True)
            self._bar_open = False

    def _on_node_started(self, event: Any) -> None:
        self._line(f"{self._label(event)} ...")

    def _on_node_cached(self, event: Any) -> None:
        self._line(f"{self._label(event)} cached")

    def _on_node_finished(self, event: Any) -> None:
        seconds = event.get("seconds")
        self._line(f"{self._label(event)} done" + (f" in {seconds:.2f} s" if seconds is not None else ""))

    def _on_progress(self, event: Any) -> None:
        value, maximum = int(event.get("value", 0)), int(event.get("max", 0) or 0)
        if maximum <= 0:
            return
        if self._terminal:
            filled = 30 * min(value, maximum) // maximum
            bar = "#" * filled + "-" * (30 - filled)
            print(f"\r  {self._label(event)} [{bar}] {value}/{maximum}", end="", file=self.stream, flush=True)
            self._bar_open = True
            return
        node_id = str(event.get("node_id"))
        tenth = 10 * min(value, maximum) // maximum
        if tenth != self._last_tenth.get(node_id) or value == maximum:
            self._last_tenth[node_id] = tenth
            self._line(f"  {self._label(event)} step {value}/{maximum}")

    def _on_job_finished(self, event: Any) -> None:
        seconds = event.get("seconds")
        took = f" in {seconds:.2f} s" if seconds is not None else ""
        self._line(f"job {event.get('status', 'finished')}{took}")


# -- node catalogue (`sluice nodes`) --

def describe_input(spec: Any) -> dict[str, Any]:
    try:
        choices = spec.current_choices()
    except Exception as error:  # a computed choice list (e.g. model files) that cannot be listed now
        choices = [f"<unavailable: {error}>"]
    return {"name": spec.name, "kind": spec.kind, "widget": spec.is_widget, "default": spec.default,
            "min": spec.min, "max": spec.max, "step": spec.step, "choices": choices or None,
            "optional": spec.optional, "multiline": spec.multiline, "description": spec.description}


def describe_node(node_type: Any, source: str | None = None) -> dict[str, Any]:
    return {"name": node_type.type_name, "display_name": node_type.display_name,
            "category": node_type.category, "description": node_type.description,
            "output_node": node_type.output_node, "memory_module": node_type.memory_module, "source": source,
            "inputs": [describe_input(i) for i in node_type.inputs],
            "outputs": [{"name": o.name, "type": o.type, "description": o.description}
                        for o in node_type.outputs]}


def describe_registry(registry: NodeRegistry) -> dict[str, Any]:
    return {"nodes": [describe_node(t, registry.source_of(t.type_name)) for t in registry.types()],
            "plugin_failures": [{"path": str(f.path), "message": f.message}
                                for f in registry.plugin_failures]}


def _input_summary(spec: dict[str, Any]) -> str:
    text = f"{spec['name']} {spec['kind']}"
    if spec["widget"]:
        text += f" = {spec['default']!r}"
        if spec["min"] is not None or spec["max"] is not None:
            low = "" if spec["min"] is None else spec["min"]
            high = "" if spec["max"] is None else spec["max"]
            text += f" [{low}..{high}" + (f", step {spec['step']}" if spec["step"] is not None else "") + "]"
        if spec["choices"]:
            shown = spec["choices"][:8]
            more = f", ... {len(spec['choices'])} in all" if len(spec["choices"]) > 8 else ""
            text += f" ({', '.join(map(str, shown))}{more})"
    elif spec["optional"]:
        text += " (optional)"
    return text


def format_catalog(registry: NodeRegistry) -> str:
    """Node types grouped by category: name, inputs (kinds, defaults, ranges), outputs, description."""
    lines: list[str] = []
    for category, node_types in registry.categories().items():
        lines.append(category)
        for node_type in node_types:
            info = describe_node(node_type)
            shown_name = info["name"]
            if info["display_name"] != info["name"]:
                shown_name += f" ({info['display_name']})"
            if info["output_node"]:
                shown_name += " [output node]"
            lines.append(f"  {shown_name}" + (": " + info["description"] if info["description"] else ""))
            for spec in info["inputs"]:
                lines.append(f"      in   {_input_summary(spec)}")
            for output in info["outputs"]:
                lines.append(f"      out  {output['name']} {output['type']}")
        lines.append("")
    return "\n".join(lines) + ("\n" if lines else "")


# -- subcommands --

def _add_run_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser("run", parents=[common], help="run a workflow without the GUI",
                                   description="Run a workflow file headless and print the saved files.")
    parser.add_argument("workflow", help="workflow JSON file")
    _add_run_options(parser, suppress=True)
    parser.add_argument("--trace", metavar="FILE",
                        help="write a Chrome trace (Perfetto) of the memory runtime")
    parser.add_argument("--server", metavar="URL",
                        help="run on a running `sluice serve` (e.g. http://127.0.0.1:8188), whose models "
                             "stay loaded between runs; the images still go to the output folder")
    parser.add_argument("--auth-token", metavar="TOKEN",
                        help="the server's auth token (or SLUICE_AUTH_TOKEN)")
    _add_cluster_options(parser)
    _add_memory_options(parser)
    parser.set_defaults(handler=command_run)


def _add_run_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    flag_default = argparse.SUPPRESS if suppress else False
    parser.add_argument("--set", action="append", metavar="NODE_ID.INPUT=VALUE",
                        default=argparse.SUPPRESS if suppress else None,
                        help="override a widget value (JSON, or plain text); repeatable")
    parser.add_argument("--quiet", action="store_true", default=flag_default, help="no progress lines")
    parser.add_argument("--traceback", action="store_true", default=flag_default,
                        help="print the full traceback of a failed node")
    parser.add_argument("--force", action="store_true", default=flag_default,
                        help="run a job whose estimated RAM is over what is available (a huge size or batch)")


def command_run(args: argparse.Namespace) -> int:
    if args.ray:
        return run_sweep(args)
    if args.sweep:
        raise CommandError("--sweep runs on Ray workers; add --ray auto (a running or new local Ray) or "
                           "--ray ADDRESS (e.g. --ray 10.0.0.5:6379)")
    if args.server:
        from app.server.client import run_on_server

        return run_on_server(args.workflow, args)
    return run_workflow(args.workflow, args)


# -- `sluice run --sweep ... --ray ADDRESS`: one workflow fanned out over Ray workers (engine/cluster) --

def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", action="append", metavar="NODE_ID.INPUT=VALUES",
                        help="run the workflow once per value: A..B (integers), @FILE (one value a line) or "
                             "a,b,c; several --sweep make their product; needs --ray")
    parser.add_argument("--ray", metavar="auto|ADDRESS",
                        help="run on Ray: 'auto' joins the Ray cluster of this machine (`ray start --head`) "
                             "or starts a local one; ADDRESS joins that cluster (needs sluice[cluster])")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="Ray workers to start (default: one per GPU of the cluster, else one per CPU)")
    parser.add_argument("--retries", type=int, default=2, metavar="N",
                        help="times a job whose worker died runs again elsewhere (default 2)")


RAY_CONNECT_TIMEOUT = 5.0  # seconds to open a TCP connection to --ray ADDRESS before Ray is asked


def _check_reachable(address: str) -> None:
    """Raise ConnectionError when nothing answers at `address` (HOST:PORT, or ray://HOST:PORT): Ray itself
    retries an unreachable address for minutes without a word."""
    import socket

    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT (e.g. 10.0.0.5:6379, or ray://HOST:10001)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT):
            pass
    except OSError as error:
        raise ConnectionError(f"nothing answers at {target} ({error.strerror or error})") from None


def _connect_ray(ray: Any, address: str) -> bool:
    """Connect this process to Ray; False when it already was (then the caller leaves it connected)."""
    if ray.is_initialized():
        return False
    if address != "auto":
        _check_reachable(address)
        ray.init(address=address, log_to_driver=False)
        return True
    try:
        ray.init(address="auto", log_to_driver=False)
    except ConnectionError:  # no cluster running on this machine: start one
        ray.init(include_dashboard=False, log_to_driver=False)
    return True


def run_sweep(args: argparse.Namespace) -> int:
    """The grid of `--sweep` overrides over Ray workers; images are written locally as they arrive."""
    import time

    from engine.cluster import ClusterError, require_ray
    from engine.cluster.inputs import job_inputs
    from engine.cluster.output import write_image
    from engine.cluster.scheduler import Job, Scheduler, default_worker_count, model_keys, start_workers
    from engine.cluster.sweep import grid, parse_sweep
    from engine.graph.job_guard import FORCE_KEY
    from engine.graph.validate import validate
    from nodes.image import input_dir
    from nodes.registry import default_registry

    try:
        ray = require_ray()
        combinations = grid([parse_sweep(text) for text in args.sweep or []])
    except ClusterError as error:
        raise CommandError(str(error)) from None
    settings = _settings(args)
    registry = _registry(settings)
    base = _load_workflow(args.workflow, registry.get)
    apply_overrides(base, args.set or [], registry.get)
    if getattr(args, "force", False):
        base.settings[FORCE_KEY] = True
    apply_memory_defaults(base, settings)
    try:
        configure_memory(args, base)  # checks the flags and settings here, before any worker starts
    except MemorySettingsError as error:
        print(f"sluice: invalid: {error}", file=sys.stderr)
        return EXIT_FAILED
    jobs = []
    for index, sets in enumerate(combinations):
        workflow = Workflow.loads(base.dumps())
        apply_overrides(workflow, sets, registry.get)
        errors = validate(workflow, registry.get)
        if errors:
            for error in errors:
                print(f"sluice: invalid ({', '.join(sets)}): {error}", file=sys.stderr)
            return EXIT_FAILED
        overrides = dict(text.split("=", 1) for text in sets)
        jobs.append(Job(index, workflow.dumps(), overrides, model_keys(workflow, registry.get, settings),
                        inputs=job_inputs(workflow, registry.get, input_dir(settings))))
    flags = {name: getattr(args, name) for name in MEMORY_FLAGS if getattr(args, name, None)}
    try:
        connected = _connect_ray(ray, args.ray)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise CommandError(f"--ray {args.ray}: cannot connect to Ray: {str(error).strip()}; start a cluster "
                           f"with `ray start --head` and give its address, or use --ray auto") from None
    try:
        count, gpus = default_worker_count(ray)
        workers = start_workers(args.workers or count, default_registry, gpus, flags,
                                str(settings.models_root) if args.models else None,
                                str(settings.plugins_dir) if args.plugins else None)
        scheduler = Scheduler(workers, retries=args.retries)
    except ClusterError as error:
        raise CommandError(str(error)) from None
    done = failed = interrupted = 0
    started = time.perf_counter()
    terminal = sys.stderr.isatty()
    with _interrupt_on_ctrl_c(scheduler):
        for outcome in scheduler.run(jobs):
            for name, data in outcome.images:
                print_saved_files([str(write_image(settings, name, data, outcome.job.overrides))])
            if outcome.status == "finished":
                done += 1
            elif outcome.status == "interrupted":
                interrupted += 1
            else:
                failed += 1
                sets = ", ".join(f"{k}={v}" for k, v in outcome.job.overrides.items())
                print(f"\nsluice: job {outcome.job.index + 1} ({sets}) {outcome.status}: {outcome.message}",
                      file=sys.stderr)
            if not args.quiet:
                line = progress_line(done, failed + interrupted, len(jobs), len(scheduler.workers), started)
                print(("\r" if terminal else "") + line, end="" if terminal else "\n", file=sys.stderr,
                      flush=True)
    if terminal and not args.quiet:
        print(file=sys.stderr)
    for handle in workers:
        ray.kill(handle, no_restart=True)
    if connected:
        ray.shutdown()
    if interrupted:
        print("sluice: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILED if failed else EXIT_OK


def progress_line(done: int, failed: int, total: int, workers: int, started: float) -> str:
    import time

    rate = done / max(time.perf_counter() - started, 1e-9)
    return f"[{done + failed}/{total}] {done} done, {failed} failed, {workers} workers, {rate:.2f} jobs/s"


def _add_validate_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser("validate", parents=[common], help="check a workflow without running it")
    parser.add_argument("workflow", help="workflow JSON file")
    parser.set_defaults(handler=command_validate)


def command_validate(args: argparse.Namespace) -> int:
    from engine.graph.validate import validate

    settings = _settings(args)
    registry = _registry(settings)
    errors = validate(_load_workflow(args.workflow, registry.get), registry.get, settings.output_dir)
    for error in errors:
        print(error)
    if not errors:
        print("ok")
    return EXIT_FAILED if errors else EXIT_OK


def _add_nodes_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser("nodes", parents=[common], help="list the node types by category")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=command_nodes)


def command_nodes(args: argparse.Namespace) -> int:
    registry = _registry(_settings(args))
    if args.json:
        print(json.dumps(describe_registry(registry), indent=2, default=str))
    else:
        print(format_catalog(registry), end="")
    return EXIT_OK


def _add_memory_options(parser: argparse.ArgumentParser) -> None:
    from engine.placement import add_placement_arguments

    add_placement_arguments(parser)


def _add_inspect_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser("inspect", parents=[common],
                                   help="what a model file holds (family, components, config, bytes); "
                                        "reads no weights")
    parser.add_argument("file", help="a .safetensors, .ckpt/.pt or .gguf file")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(handler=command_inspect)


def command_inspect(args: argparse.Namespace) -> int:
    from engine.models.inspect import format_inspection, inspect_file

    try:
        info = inspect_file(args.file)
    except (OSError, ValueError) as error:  # CheckpointError and UnsupportedModelError are ValueErrors
        print(f"sluice: cannot inspect {args.file}: {error}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return EXIT_OK


def _add_devices_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser("devices", parents=[common], help="list the compute devices and memory")
    parser.set_defaults(handler=command_devices)


def command_devices(args: argparse.Namespace) -> int:
    from engine.devices import format_devices

    print(format_devices())
    return EXIT_OK


def _add_plan_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser("plan", parents=[common], help="print the memory plan without loading",
                                   description="Print the auto-fit placement of every loader of a "
                                               "workflow and the predicted memory per device, from file "
                                               "headers alone.")
    parser.add_argument("workflow", help="workflow JSON file")
    parser.add_argument("--set", action="append", metavar="NODE_ID.INPUT=VALUE",
                        help="override a widget value")
    _add_memory_options(parser)
    parser.set_defaults(handler=command_plan)


def command_plan(args: argparse.Namespace) -> int:
    from nodes.loaders import workflow_plan

    settings = _settings(args)
    registry = _registry(settings)
    workflow = _load_workflow(args.workflow, registry.get)
    apply_overrides(workflow, args.set or [], registry.get)
    problems: list[str] = []
    apply_memory_defaults(workflow, settings)
    try:
        runtime = configure_memory(args, workflow)
        plan = workflow_plan(workflow, settings, runtime, problems)
    except MemorySettingsError as error:
        print(f"sluice: invalid: {error}", file=sys.stderr)
        return EXIT_FAILED
    if plan.choices:
        print(plan.format())
    elif not problems:
        print("no model loaders in this workflow")
    for line in device_memory_lines(workflow, runtime):
        print(line)
    print(job_memory_line(workflow))
    for problem in problems:  # a missing, corrupt or refused model file: the run would fail on it
        print(f"sluice: cannot plan {problem}", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


def device_memory_lines(workflow: Any, runtime: Any) -> list[str]:
    """`sluice plan`'s lines on each compute device's activation peak against its budget (job_guard.py)."""
    from engine.graph.job_guard import GIB, PHASE_NAMES, device_estimates

    lines = []
    for estimate in device_estimates(workflow, runtime.devices, runtime.overrides):
        phases = ", ".join(f"{PHASE_NAMES[p]} {b / GIB:.2f} GiB" for p, b in estimate.phases.items())
        budget = "no budget (the RAM line below)" if estimate.budget is None else (
            f"budget {estimate.budget / GIB:.1f} GiB" + (", over: `sluice run` refuses it without --force"
                                                        if estimate.peak > estimate.budget else ""))
        lines.append(f"job on {estimate.device}: about {estimate.peak / GIB:.2f} GiB of activations at its "
                     f"peak ({phases}; {budget})")
    return lines


def job_memory_line(workflow: Any) -> str:
    """`sluice plan`'s line on the job's own RAM estimate (engine/graph/job_guard.py)."""
    import psutil

    from engine.graph.job_guard import GIB, job_peak_bytes, largest_image

    width, height, batch, scale = largest_image(workflow)
    if not width:
        return "job: no image size in the workflow's widgets"
    needed, available = job_peak_bytes(workflow), psutil.virtual_memory().available
    return (f"job: largest image {width}x{height} x {batch}" + (f" scaled by {scale:g}" if scale > 1 else "")
            + f", about {needed / GIB:.2f} GiB of RAM at its peak ({available / GIB:.1f} GiB available"
            + (", over: `sluice run` refuses it without --force)" if needed > available else ")"))


def _add_convert_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "convert", parents=[common], help="convert a model file to GGUF, quantising it (--type)",
        description="Convert a safetensors, .ckpt/.pt or GGUF file to a GGUF file that stable-diffusion.cpp "
                    "and ComfyUI-GGUF load. Biases, norms, embeddings, 1-D tensors and rows that are not "
                    "whole blocks keep their stored type, as stable-diffusion.cpp does.")
    parser.add_argument("input", help="the model file to convert")
    parser.add_argument("output", help="the .gguf file to write")
    parser.add_argument("--type", dest="type_name", metavar="TYPE",
                        help="type of the converted weights: f32, f16, bf16, q8_0, q6_K, q5_K, q5_1, q5_0, "
                             "q4_K, q4_1, q4_0, iq4_nl, iq4_xs, q3_K, q2_K (default: every tensor keeps its "
                             "stored type)")
    parser.add_argument("--tensor-type-rules", dest="rules", default="", metavar="REGEX=TYPE,...",
                        help="per-tensor types: the first regex found in a tensor's name gives its type "
                             "(e.g. 'attn=q8_0,mlp=q4_0')")
    parser.add_argument("--device", default="auto", help="where to quantise (default: the first GPU)")
    parser.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress line")
    parser.set_defaults(handler=command_convert)


def command_convert(args: argparse.Namespace) -> int:
    import time

    from engine.devices import DeviceError, resolve_device
    from engine.models.formats import CheckpointError
    from engine.quant.convert import convert_checkpoint
    from engine.quant.quantize import tensor_type_rules

    try:
        tensor_type_rules(args.type_name, args.rules)
        device = resolve_device(args.device).torch_device
    except (ValueError, DeviceError) as error:
        raise CommandError(str(error)) from None
    if Path(args.output).resolve() == Path(args.input).resolve():
        raise CommandError(f"convert would overwrite its input {args.input}; give another output file")
    started = time.perf_counter()

    def progress(index: int, total: int, conversion: Any) -> None:
        if not args.quiet:
            print(f"\r[{index + 1}/{total}] {conversion.plan.name[:70]:<70}", end="", file=sys.stderr)

    try:
        summary = convert_checkpoint(args.input, args.output, args.type_name, args.rules, device, progress)
    except (OSError, CheckpointError, ValueError) as error:
        print(f"\nsluice: cannot convert {args.input}: {error}", file=sys.stderr)
        return EXIT_FAILED
    if not args.quiet:
        print(file=sys.stderr)
    counts = ", ".join(f"{name} {count}" for name, count in sorted(summary.type_counts().items()))
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output}: {len(summary.tensors)} tensors ({counts}), {size / 2**30:.2f} GiB, "
          f"architecture {summary.architecture or 'not detected'}, {time.perf_counter() - started:.1f} s")
    return EXIT_OK


def _add_serve_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    from engine.previews import PREVIEW_METHODS

    parser = subparsers.add_parser("serve", parents=[common], help="serve ComfyUI's HTTP and websocket API",
                                   description="Serve ComfyUI's API (POST /prompt, /ws, /history, /view, "
                                               "/object_info, ...) so ComfyUI clients drive Sluice's engine.")
    parser.add_argument("--listen", metavar="ADDR", nargs="?", const="0.0.0.0", default="127.0.0.1",
                        help="address(es) to listen on, comma-separated (default 127.0.0.1; alone: 0.0.0.0); "
                             "a non-loopback address needs --auth-token or --insecure")
    parser.add_argument("--port", type=int, default=8188, help="port (default 8188, ComfyUI's)")
    parser.add_argument("--auth-token", metavar="TOKEN",
                        help="every request must carry it (Authorization: Bearer TOKEN); or "
                             "SLUICE_AUTH_TOKEN")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback --listen without an auth token")
    parser.add_argument("--max-upload-size", type=float, metavar="MB", default=100,
                        help="the largest request body in MB (default 100)")
    parser.add_argument("--preview-method", choices=PREVIEW_METHODS, default="auto",
                        help="sampling previews sent on the websocket (default auto)")
    parser.add_argument("--ray", metavar="auto|ADDRESS",
                        help="run the prompts on Ray workers instead of one engine thread: 'auto' joins the "
                             "Ray cluster of this machine or starts a local one; ADDRESS joins that cluster "
                             "(needs sluice[cluster])")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="with --ray: workers to start (default: one per GPU of the cluster, else one "
                             "per CPU)")
    parser.add_argument("--retries", type=int, default=2, metavar="N",
                        help="with --ray: times a prompt whose worker died runs again elsewhere (default 2)")
    _add_memory_options(parser)
    parser.set_defaults(handler=command_serve)


def command_serve(args: argparse.Namespace) -> int:
    from app.server.main import serve

    return serve(args)


EXPORT_FORMATS = ("comfy-ui", "comfy-api")  # comfy_export's, which building the parser does not import


def _add_export_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser("export", parents=[common], help="write a workflow as a ComfyUI file",
                                   description="Write a workflow (any format Sluice opens) as a ComfyUI "
                                               "UI-format workflow or an API-format prompt.")
    parser.add_argument("workflow", help="workflow file: Sluice or ComfyUI JSON, or a PNG that embeds one")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS,
                        help="comfy-ui: the workflow ComfyUI's Load opens; comfy-api: the prompt its /prompt "
                             "endpoint runs")
    parser.add_argument("-o", dest="out_file", metavar="FILE", help="output file (default: stdout)")
    parser.set_defaults(handler=command_export)


def command_export(args: argparse.Namespace) -> int:
    from engine.graph.comfy_export import export_text

    registry = _registry(_settings(args))
    text = export_text(_load_workflow(args.workflow, registry.get), registry.get, args.format)
    if args.out_file is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        Path(args.out_file).write_text(text, encoding="utf-8")
    except OSError as error:
        raise CommandError(f"cannot write {args.out_file}: {error.strerror or error}") from None
    print(f"sluice: wrote {args.out_file}", file=sys.stderr)
    return EXIT_OK


def command_gui(args: argparse.Namespace) -> int:
    settings = _settings(args)
    try:
        from app.main_window import run_gui
    except ModuleNotFoundError as error:
        if error.name != "app.main_window":
            raise
        print("sluice: the desktop app is not built yet; use `sluice run WORKFLOW`", file=sys.stderr)
        return EXIT_USAGE
    return int(run_gui(settings) or 0)


def command_headless(args: argparse.Namespace) -> int:
    return run_workflow(default_workflow_path(), args)


# -- parser and entry point --

def _common_options(default: Any) -> argparse.ArgumentParser:
    """Options accepted before and after the subcommand (the subcommand copy must not reset them)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--models", metavar="DIR", default=default, help="models folder (ComfyUI layout)")
    common.add_argument("--output", "--out", dest="output", metavar="DIR", default=default,
                        help="folder for saved images")
    common.add_argument("--plugins", metavar="DIR", default=default, help="folder of node plugins")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", parents=[_common_options(None)],
        description="Sluice: a node-graph studio for diffusion image generation. "
                    "Without a command, opens the desktop app.")
    parser.add_argument("--headless", action="store_true",
                        help="run the default workflow without the GUI (like `sluice run`)")
    _add_run_options(parser, suppress=False)
    parser.set_defaults(handler=None)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = _common_options(argparse.SUPPRESS)
    _add_run_parser(subparsers, common)
    _add_validate_parser(subparsers, common)
    _add_nodes_parser(subparsers, common)
    _add_inspect_parser(subparsers, common)
    _add_devices_parser(subparsers, common)
    _add_plan_parser(subparsers, common)
    _add_convert_parser(subparsers, common)
    _add_serve_parser(subparsers, common)
    _add_export_parser(subparsers, common)
    return parser


HANDLES_CTRL_C = ("command_gui", "command_serve")  # commands with their own Ctrl+C handling


def main(argv: list[str] | None = None) -> int:
    with _exit_on_ctrl_c():
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_request:  # --help, or a usage error argparse already printed
            return int(exit_request.code or 0) if not isinstance(exit_request.code, str) else EXIT_USAGE
        handler = args.handler or (command_headless if args.headless else command_gui)
        if handler.__name__ in HANDLES_CTRL_C:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return handler(args)
        except (CommandError, SettingsError) as error:
            print(f"sluice: {error}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print("\nsluice: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # `sluice nodes | head`: the reader left; silence the flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_FAILED

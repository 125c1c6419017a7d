"""Start-up of a new Sluice process: `import torch`, then what `sluice run` imports on top of it (the engine,
the node registry and the executor, the registry built), then the first run of the default workflow.

    .venv/bin/python bench/startup.py [--repeats 5] [--no-run] [--cache DIR]

Every measurement is a fresh interpreter (`python -c`), so nothing is imported or measured already. Rows:

- import torch: seconds of `import torch`;
- + engine and nodes: seconds after that of importing app.cli (which imports nodes.registry), the
  executor and engine.memory.runtime, and building the default registry; the heavy optional libraries
  (spandrel, torchvision, diffusers, transformers, PySide6, torch._dynamo) it left imported are listed;
- first run, cold cache / warm cache: `sluice run` of the default workflow (--quiet), each node's seconds
  and the whole run. "cold" runs with an empty profile cache folder (every probe and stage profile
  measured), "warm" in a new process reading what the cold run wrote (engine/memory/profile_cache.py).

Prints medians over --repeats, with the minimum and maximum beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("spandrel", "torchvision", "diffusers", "transformers", "PySide6", "torch._dynamo", "gguf")

CHILD = """
import json, sys, time
began = time.perf_counter()
import torch
torch_s = time.perf_counter() - began
began = time.perf_counter()
import app.cli
import engine.graph.executor
import engine.memory.runtime
from nodes.registry import default_registry
default_registry()
engine_s = time.perf_counter() - began
heavy = [name for name in HEAVY if sys.modules.get(name) is not None]
result = {"import torch": torch_s, "+ engine and nodes": engine_s, "heavy": heavy}
if RUN:
    from engine.telemetry import bus
    nodes, types = {}, {}

    def record(event):
        if event.kind == "node_started":
            types[event["node_id"]] = event["node_type"]
        elif event.kind == "node_finished":
            nodes[f"  {event['node_id']} {types[event['node_id']]}"] = event["seconds"]

    bus.subscribe(record)
    began = time.perf_counter()
    code = app.cli.main(["--output", OUTPUT, "run", str(app.cli.default_workflow_path()), "--quiet"])
    result["run"] = time.perf_counter() - began
    result["nodes"] = nodes
    result["code"] = code
    result["heavy after run"] = [name for name in HEAVY if sys.modules.get(name) is not None]
print(json.dumps(result))
"""


def child(run: bool, output: str, cache: str) -> dict:
    code = f"HEAVY = {HEAVY!r}\nRUN = {run!r}\nOUTPUT = {output!r}\n" + CHILD
    env = {**os.environ, "SLUICE_CACHE": cache}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"the measuring process failed:\n{result.stderr}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    if run and data["code"] != 0:
        raise SystemExit(f"sluice run exited {data['code']}:\n{result.stderr}")
    return data


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.3f}  ({min(values):.3f} to {max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per row (default 5)")
    parser.add_argument("--no-run", action="store_true", help="imports only, no default-workflow run")
    parser.add_argument("--cache", type=Path, default=None,
                        help="profile cache folder of the warm runs (default: a new temporary folder)")
    args = parser.parse_args()

    rows: dict[str, list[float]] = {}
    heavy: set[str] = set()
    heavy_after_run: set[str] = set()
    with tempfile.TemporaryDirectory() as scratch:
        output = str(Path(scratch) / "output")
        warm_cache = str(args.cache or Path(scratch) / "cache")
        for repeat in range(args.repeats):
            imports = child(False, output, "off")
            for name in ("import torch", "+ engine and nodes"):
                rows.setdefault(name, []).append(imports[name])
            heavy.update(imports["heavy"])
            if args.no_run:
                continue
            cold = Path(scratch) / f"cold{repeat}"
            runs = [("first run, cold cache", str(cold))]
            runs.append(("first run, warm cache", warm_cache))
            if repeat == 0 and args.cache is None:
                child(True, output, warm_cache)  # fills the warm cache
            for label, cache in runs:
                data = child(True, output, cache)
                rows.setdefault(label, []).append(data["run"])
                for node, seconds in data["nodes"].items():
                    rows.setdefault(f"{node} ({label.split(', ')[1]})", []).append(seconds)
                heavy_after_run.update(data["heavy after run"])

    print(f"python {sys.version.split()[0]}, {args.repeats} fresh processes per row; "
          f"seconds: median (min to max)")
    width = max(len(name) for name in rows)
    for name, values in rows.items():
        print(f"{name:<{width}}  {summary(values)}")
    print(f"heavy modules imported by engine and nodes: {', '.join(sorted(heavy)) or 'none'}")
    if not args.no_run:
        print(f"heavy modules imported by the end of the run: {', '.join(sorted(heavy_after_run)) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

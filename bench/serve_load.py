"""Issue 18's load: 200 prompts queued at once by 8 concurrent clients against a `sluice serve` process, each
client following its own prompts on the websocket; then checks that every prompt ran exactly once and is in
the history, and prints the server's resident memory (RSS) as the prompts complete.

    .venv/bin/python bench/serve_load.py [--prompts 200] [--clients 8] [--steps 20] [--every 20] [--threads N]
                                         [--out bench/results]

The prompts are the default workflow (the embedded model, 128x128) with a seed each, so every one samples,
decodes and saves while the loaders stay cached. The server runs in its own process (`python -m app serve`
on a free loopback port, output in a temporary folder), so the RSS is the server's alone; --threads sets its
OMP_NUM_THREADS (1 on a CPU shared with other work, where OpenMP's barriers cost more than a second thread
gains). Prints a row per --every completed prompts (elapsed seconds, RSS in MiB), then the totals: prompts
lost, run twice, in the history, the images in the output folder, and the RSS growth from the 10th prompt
to the last ("flat" is what the issue asks for). The table goes to --out as serve_load_cpu_<time>.log, the
rows and totals as .json, and RSS and seconds over the completed prompts as .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from plots import Line, Panel, draw  # noqa: E402

from engine.graph.comfy_export import to_api_prompt  # noqa: E402
from engine.graph.document import Workflow  # noqa: E402
from engine.settings import resources_dir  # noqa: E402
from nodes.registry import default_registry  # noqa: E402

MiB = 1024 * 1024
FIRST_FEW = 10  # RSS growth is measured from this many completed prompts on
RESULTS = ROOT / "bench" / "results"


@dataclass
class Report:
    """The lines printed, kept for the .log file."""

    lines: list[str] = field(default_factory=list)

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prompts(count: int, steps: int) -> list[dict]:
    registry = default_registry()
    workflow = Workflow.load(resources_dir() / "workflows" / "default.json")
    base = to_api_prompt(workflow, registry.get)
    made = []
    for seed in range(count):
        prompt = json.loads(json.dumps(base))
        prompt["6"]["inputs"].update(seed=seed, steps=steps)
        made.append(prompt)
    return made


def start_server(folder: Path, port: int, threads: int | None) -> tuple[subprocess.Popen, Path]:
    log = folder / "server.log"
    env = {**os.environ, "SLUICE_SETTINGS": str(folder / "no-settings.json")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    process = subprocess.Popen([sys.executable, "-m", "app", "--output", str(folder / "output"), "--models",
                                str(folder / "models"), "serve", "--port", str(port)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    return process, log


async def wait_until_up(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with code {process.returncode}")
            try:
                async with session.get(f"{url}/prompt") as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the server did not answer within {timeout} s")


class Load:
    def __init__(self, url: str, server: psutil.Process, every: int, report: Report) -> None:
        self.url = url
        self.server = server
        self.every = every
        self.report = report
        self.seen: Counter = Counter()  # (message type, prompt id) -> count
        self.done = 0
        self.rss: list[tuple[int, float, int]] = []  # (prompts done, seconds, RSS bytes)
        self.started = time.perf_counter()

    def completed(self) -> None:
        self.done += 1
        rss = self.server.memory_info().rss
        self.rss.append((self.done, time.perf_counter() - self.started, rss))
        if self.done % self.every == 0 or self.done == FIRST_FEW:
            self.report(f"{self.done:>9} {self.rss[-1][1]:>10.1f} {rss / MiB:>10.1f}")

    async def client(self, client_id: str, batch: list[dict]) -> list[str]:
        if not batch:
            return []
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{self.url}/ws?clientId={client_id}", max_msg_size=0) as ws:

                async def post(prompt: dict) -> str:
                    body = {"prompt": prompt, "client_id": client_id}
                    async with session.post(f"{self.url}/prompt", json=body) as answer:
                        reply = await answer.json()
                        if answer.status != 200:
                            raise RuntimeError(f"POST /prompt answered {answer.status}: {reply}")
                        return reply["prompt_id"]

                prompt_ids = await asyncio.gather(*(post(prompt) for prompt in batch))
                waiting = set(prompt_ids)
                async for message in ws:
                    if message.type != aiohttp.WSMsgType.TEXT:
                        continue
                    parsed = json.loads(message.data)
                    prompt_id = parsed["data"].get("prompt_id")
                    self.seen[parsed["type"], prompt_id] += 1
                    if parsed["type"] == "executing" and parsed["data"]["node"] is None:
                        self.completed()
                        waiting.discard(prompt_id)
                        if not waiting:
                            break
        return prompt_ids


async def run(args: argparse.Namespace, folder: Path) -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process, log = start_server(folder, port, args.threads)
    report = Report()
    try:
        await wait_until_up(url, process)
        server = psutil.Process(process.pid)
        all_prompts = prompts(args.prompts, args.steps)
        start_rss = server.memory_info().rss
        report(f"server pid {process.pid}, RSS at start {start_rss / MiB:.1f} MiB; {args.prompts} prompts "
               f"({args.steps} steps) by {args.clients} clients, server OMP_NUM_THREADS "
               f"{args.threads or 'unset'}")
        report(f"{'completed':>9} {'seconds':>10} {'RSS MiB':>10}")
        load = Load(url, server, args.every, report)
        batches = [all_prompts[index::args.clients] for index in range(args.clients)]
        results = await asyncio.gather(*(load.client(f"load-{index}", batch)
                                         for index, batch in enumerate(batches)))
        elapsed = time.perf_counter() - load.started
        ids = [prompt_id for batch in results for prompt_id in batch]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/history") as answer:
                history = await answer.json()
        ran_twice = [i for i in ids if load.seen["execution_start", i] > 1]
        lost = [i for i in ids if load.seen["execution_success", i] != 1]
        succeeded = sum(entry["status"]["status_str"] == "success" for entry in history.values())
        images = len(list((folder / "output").glob("*.png")))
        first_few = next(rss for done, _, rss in load.rss if done == min(FIRST_FEW, len(load.rss)))
        after = [rss for done, _, rss in load.rss if done >= FIRST_FEW] or [first_few]
        growth = after[-1] - first_few
        report()
        report(f"{len(ids)} prompts queued, {len(set(ids))} distinct ids; {len(lost)} lost or failed, "
               f"{len(ran_twice)} run twice; history holds {len(history)} ({succeeded} successful); "
               f"{images} images in the output folder")
        report(f"{elapsed:.1f} s in all, {elapsed / max(1, len(ids)):.3f} s per prompt")
        report(f"RSS after {FIRST_FEW} prompts {first_few / MiB:.1f} MiB, highest after that "
               f"{max(after) / MiB:.1f} MiB, at the end {after[-1] / MiB:.1f} MiB: growth "
               f"{growth / MiB:+.1f} MiB ({growth / first_few:+.1%})")
        passed = not lost and not ran_twice and len(history) == len(ids) == images == args.prompts
        write_results(args, report, {
            "prompts": args.prompts, "clients": args.clients, "steps": args.steps, "threads": args.threads,
            "queued": len(ids), "distinct_ids": len(set(ids)), "lost_or_failed": len(lost),
            "run_twice": len(ran_twice), "history": len(history), "history_successful": succeeded,
            "images": images, "seconds": elapsed, "rss_start_bytes": start_rss,
            "rss_after_first_few_bytes": first_few, "rss_highest_after_bytes": max(after),
            "rss_end_bytes": after[-1], "rss_growth_bytes": growth, "passed": passed,
            "rss_rows": [{"completed": done, "seconds": seconds, "rss_bytes": rss}
                         for done, seconds, rss in load.rss]})
        return 0 if passed else 1
    except Exception:
        print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def write_results(args: argparse.Namespace, report: Report, summary: dict) -> None:
    """The run as `--out/serve_load_cpu_<time>.json`, `.log` and `.png` (RSS and elapsed seconds over the
    completed prompts)."""
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"serve_load_cpu_{time.strftime('%Y%m%d_%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    stem.with_suffix(".log").write_text("\n".join(report.lines) + "\n")
    rows = [(row["completed"], row["seconds"], row["rss_bytes"]) for row in summary["rss_rows"]]
    title = (f"sluice serve: {args.prompts} prompts ({args.steps} steps) from {args.clients} clients; "
             f"{summary['lost_or_failed']} lost or failed, {summary['run_twice']} run twice")
    memory = Panel("server memory", "completed prompts", "RSS MiB", y_from_zero=True,
                   note=f"growth from prompt {FIRST_FEW} on: {summary['rss_growth_bytes'] / MiB:+.1f} MiB",
                   lines=[Line("RSS", [(done, size / MiB) for done, _, size in rows])])
    pace = Panel("progress", "completed prompts", "seconds since the first was queued",
                 lines=[Line("seconds", [(done, seconds) for done, seconds, _ in rows])])
    draw(stem.with_suffix(".png"), [memory, pace], title)
    print(f"wrote {stem}.json, .log and .png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=200, help="prompts in all (default 200)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--steps", type=int, default=20, help="sampling steps per prompt (default 20)")
    parser.add_argument("--every", type=int, default=20, help="print a row per this many prompts")
    parser.add_argument("--threads", type=int, help="the server's OMP_NUM_THREADS (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the .json, .log and .png")
    args = parser.parse_args()
    for name in ("prompts", "clients", "steps", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} must be at least 1")
    with tempfile.TemporaryDirectory(prefix="sluice-serve-load-") as folder:
        return asyncio.run(run(args, Path(folder)))


if __name__ == "__main__":
    raise SystemExit(main())

"""What the desktop app costs a run: the default workflow's job time from the GUI against `sluice --headless`
on the same machine, and the start-up of the app to a shown window (issue 20, point 3).

    .venv/bin/python bench/gui_overhead.py [--repeats 5] [--size 1600x1000] [--threads N] [--no-startup]

Every measurement is a fresh interpreter; the GUI ones run Qt offscreen (QT_QPA_PLATFORM=offscreen), with the
window at --size, its docks (memory panel included) as a user first sees them, and the embedded model. GUI and
headless children alternate, so a busy machine slows both alike. Rows:

- job, first run: the executor's job seconds (what `sluice run` prints as "job finished in") of the first run
  in a new process, models loaded: `sluice --headless` against Queue in the window;
- job, next run: a second run in the same process with a new seed (the sampler, the decoder and the save run
  again, the loaders come from the cache): the headless child runs the workflow again on its executor, the GUI
  child presses Queue again (control after generate randomizes the seed);
- gui thread cpu: CPU seconds the GUI thread used during the first and the next job;
- start-up to a shown window: from the start of the process (`python -m app`'s path: app.cli.main) to the
  first paint inside the main window, and the CPU seconds the process used until then (on a busy machine the
  wall time grows with the load, the CPU time much less: it is what an idle machine's wall time approaches).

All children share one profile cache folder, filled by a headless run before the measurements. Prints the
median over --repeats with the minimum and maximum, and the GUI / headless ratio of the medians; writes the
table as gui_overhead_cpu_<time>.log, every measurement as .json and a plot of the medians (whiskers: minimum
to maximum) as .png under --out.

--threads sets torch's CPU threads in every child (OMP_NUM_THREADS; default: torch's own, one per core): on a
machine others load too, two OpenMP threads on two cores wait for each other whenever one is descheduled,
which swamps what is measured; one thread each keeps the comparison readable there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plots import Bars, Panel, draw  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

HEADLESS_CHILD = """
import json
from engine.telemetry import bus
jobs = []
bus.subscribe(lambda event: jobs.append(event["seconds"]) if event.kind == "job_finished" else None)
import app.cli
code = app.cli.main(["--output", OUTPUT, "--headless", "--quiet"])
if code != 0:
    raise SystemExit(f"sluice --headless exited {code}")
# The next run: the same workflow with a new seed on a fresh executor of this process (models cached in the
# memory runtime, as the GUI's worker keeps them).
from engine.graph.executor import Executor
from engine.graph.interchange import load_any
from engine.settings import load_settings
from nodes.registry import default_registry
settings = load_settings(output_dir=OUTPUT)
registry = default_registry(settings)
workflow, _ = load_any(app.cli.default_workflow_path(), registry.get)
executor = Executor(registry.get, bus=bus, settings=settings)
executor.run(workflow)  # fills this executor's node cache, as the GUI's first run did
sampler = next(node for node in workflow.nodes.values() if node.type == "KSampler")
sampler.widgets["seed"] += 1
result = executor.run(workflow)
print(json.dumps({"first": jobs[0], "next": result.seconds}))
"""

GUI_CHILD = """
import json, os, sys, threading, time
import psutil
from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication
from engine.settings import load_settings
from engine.telemetry import bus
from nodes.registry import default_registry
from app import theme
from app.main_window import MainWindow

application = QApplication(sys.argv)
theme.apply_dark_theme(application)
settings = load_settings(output_dir=OUTPUT)
window = MainWindow(settings, default_registry(settings))
window.prompt_unsaved = lambda: "discard"
window.resize(WIDTH, HEIGHT)
window.show()
deadline = time.perf_counter() + 2
while time.perf_counter() < deadline:  # let the first layout, fit and paints happen, as a user would wait
    application.processEvents()
gui_thread = threading.main_thread().native_id
process = psutil.Process()


def gui_cpu():
    return next(t.user_time + t.system_time for t in process.threads() if t.id == gui_thread)


def queue_and_wait():
    loop = QEventLoop()
    seconds = []
    unsubscribe = bus.subscribe(lambda event: seconds.append(event["seconds"])
                                if event.kind == "job_finished" else None)
    window.runs.job_done.connect(loop.quit)
    cpu = gui_cpu()
    job_id = window.queue()
    QTimer.singleShot(600_000, loop.quit)
    loop.exec()
    window.runs.job_done.disconnect(loop.quit)
    unsubscribe()
    if window.runs.statuses.get(job_id) != "finished":
        raise SystemExit(f"the GUI job ended {window.runs.statuses.get(job_id)}")
    return seconds[0], gui_cpu() - cpu


first, first_cpu = queue_and_wait()
after_next, next_cpu = queue_and_wait()
window.close()
print(json.dumps({"first": first, "next": after_next, "first_cpu": first_cpu, "next_cpu": next_cpu}))
"""

STARTUP_CHILD = """
import json, sys, time
import psutil
from PySide6.QtCore import QEvent, QObject, QTimer
from PySide6.QtWidgets import QApplication, QWidget
application = QApplication(sys.argv)


class ShownWatch(QObject):
    \"\"\"Reports the first paint inside the main window, in seconds since the process started.\"\"\"

    done = False

    def eventFilter(self, watched, event):
        if not self.done and event.type() == QEvent.Type.Paint and isinstance(watched, QWidget) \\
                and type(watched.window()).__name__ == "MainWindow" and watched.window().isVisible():
            self.done = True
            process = psutil.Process()
            shown = time.time() - process.create_time()
            times = process.cpu_times()
            print(json.dumps({"shown": shown, "cpu": times.user + times.system}), flush=True)
            QTimer.singleShot(0, watched.window().close)
        return False


watch = ShownWatch()
application.installEventFilter(watch)
import app.cli
app.cli.main(["--output", OUTPUT])
"""


def child(code: str, env: dict[str, str], **values: object) -> dict:
    prelude = "".join(f"{name} = {value!r}\n" for name, value in values.items())
    result = subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"the measuring process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} s  ({min(values):.2f} .. {max(values):.2f})"


def plot(rows: dict[str, list[float]], path: Path, title: str) -> Path:
    """The medians of the table, headless beside GUI, each with a whisker from the minimum to the maximum."""
    kinds = (("job, first run", "headless first", "gui first"),
             ("job, next run (new seed)", "headless next", "gui next"),
             ("GUI thread CPU, first job", None, "gui cpu first"),
             ("GUI thread CPU, next job", None, "gui cpu next"),
             ("start-up to a shown window", None, "start-up"),
             ("CPU seconds until shown", None, "start-up cpu"))
    kinds = tuple(kind for kind in kinds if rows[kind[2]])

    def bars(label: str, index: int) -> Bars:
        keys = [kind[index] for kind in kinds]
        return Bars(label, [statistics.median(rows[k]) if k else None for k in keys],
                    [(min(rows[k]), max(rows[k])) if k else None for k in keys])

    panel = Panel("median seconds (whiskers: minimum to maximum)", "seconds",
                  categories=[kind[0] for kind in kinds], bars=[bars("headless", 1), bars("GUI", 2)])
    return draw(path, [panel], title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="children of each kind (default 5)")
    parser.add_argument("--size", default="1600x1000", help="window size, WIDTHxHEIGHT (default 1600x1000)")
    parser.add_argument("--threads", type=int, help="torch CPU threads in every child (default: torch's)")
    parser.add_argument("--no-startup", action="store_true", help="leave out the start-up measurement")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the .log, .json and .png go")
    args = parser.parse_args()
    width, height = (int(part) for part in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory(prefix="sluice-gui-overhead-") as folder:
        env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "SLUICE_CACHE": str(Path(folder) / "cache"),
               "SLUICE_SETTINGS": str(Path(folder) / "no-settings.json"),
               "SLUICE_APP_DATA": str(Path(folder) / "app-data"), "SLUICE_AUTO_RESTORE": "0"}
        env.pop("SLUICE_MODELS", None)
        if args.threads is not None:
            env["OMP_NUM_THREADS"] = str(args.threads)
        output = str(Path(folder) / "output")
        child(HEADLESS_CHILD, env, OUTPUT=output)  # fills the profile cache; not counted
        rows: dict[str, list[float]] = {name: [] for name in (
            "headless first", "gui first", "headless next", "gui next", "gui cpu first", "gui cpu next",
            "start-up", "start-up cpu")}
        for repeat in range(args.repeats):
            headless = child(HEADLESS_CHILD, env, OUTPUT=output)
            gui = child(GUI_CHILD, env, OUTPUT=output, WIDTH=width, HEIGHT=height)
            startup = {"shown": float("nan")} if args.no_startup else child(STARTUP_CHILD, env, OUTPUT=output)
            rows["headless first"].append(headless["first"])
            rows["headless next"].append(headless["next"])
            rows["gui first"].append(gui["first"])
            rows["gui next"].append(gui["next"])
            rows["gui cpu first"].append(gui["first_cpu"])
            rows["gui cpu next"].append(gui["next_cpu"])
            if not args.no_startup:
                rows["start-up"].append(startup["shown"])
                rows["start-up cpu"].append(startup["cpu"])
            print(f"repeat {repeat + 1}/{args.repeats}: headless {headless['first']:.2f} / "
                  f"{headless['next']:.2f} s, GUI {gui['first']:.2f} / {gui['next']:.2f} s, shown after "
                  f"{startup['shown']:.2f} s (load average {os.getloadavg()[0]:.1f})", file=sys.stderr,
                  flush=True)
    threads = f"{args.threads} torch thread(s)" if args.threads else "torch's threads"
    title = (f"default workflow, window {width}x{height} offscreen, {args.repeats} repeats, "
             f"{os.cpu_count()} cores, {threads}")
    lines = [f"{title}; median (min .. max)", f"{'':28}{'headless':>28}{'GUI':>30}{'GUI / headless':>16}"]
    for label, key in (("job, first run", "first"), ("job, next run (new seed)", "next")):
        headless, gui = rows[f"headless {key}"], rows[f"gui {key}"]
        ratio = statistics.median(gui) / statistics.median(headless)
        lines.append(f"{label:28}{summary(headless):>28}{summary(gui):>30}{ratio:>15.2f}x")
    lines.append(f"{'gui thread cpu, first job':28}{'':>28}{summary(rows['gui cpu first']):>30}")
    lines.append(f"{'gui thread cpu, next job':28}{'':>28}{summary(rows['gui cpu next']):>30}")
    if rows["start-up"]:
        lines.append(f"{'start-up to a shown window':28}{'':>28}{summary(rows['start-up']):>30}")
        lines.append(f"{'  cpu seconds until then':28}{'':>28}{summary(rows['start-up cpu']):>30}")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"gui_overhead_cpu_{time.strftime('%Y%m%d_%H%M%S')}"
    stem.with_suffix(".log").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(
        {"repeats": args.repeats, "window": [width, height], "threads": args.threads, "cores": os.cpu_count(),
         "seconds": rows}, indent=2))
    plot(rows, stem.with_suffix(".png"), title)
    print(f"wrote {stem}.log, .json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

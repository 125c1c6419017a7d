"""The issue's acceptance: a 40-image seed sweep of the embedded model (its default workflow, 128x128, 20
steps) over two local Ray CPU workers gives 40 distinct new files, none lost or twice, each pixel-identical to
the same seed run alone in-process; the same when one worker is killed halfway (`ray.kill`).

Running all 40 seeds alone as well would double the module's time on a 2-core machine, so each sweep is
compared with REFERENCES seeds run alone, picked at random on every run from the 40 (the picks are in the
failure message), and the two sweeps' 40 images with each other: a worker that ran a seed differently, or a
retried job that came out differently, fails one comparison or the other."""

from __future__ import annotations

import io
import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ray = pytest.importorskip("ray")

from app.cli import default_workflow_path, main  # noqa: E402
from engine.cluster.output import OVERRIDES_CHUNK, write_image  # noqa: E402
from engine.cluster.scheduler import Job, Scheduler, model_keys, start_workers  # noqa: E402
from engine.cluster.worker import SluiceWorker  # noqa: E402
from engine.graph.document import Workflow  # noqa: E402
from engine.images import png_text  # noqa: E402
from engine.settings import Settings, load_settings  # noqa: E402
from nodes.registry import default_registry  # noqa: E402

COUNT = 40
REFERENCES = 4  # seeds of each sweep also run alone
FIRST_SEED = 1000
SEED, SAMPLER = "6", "6"


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _document(seed: int) -> str:
    workflow = Workflow.loads(default_workflow_path().read_text(encoding="utf-8"))
    workflow.nodes[SAMPLER].widgets["seed"] = seed
    return workflow.dumps()


def _jobs(registry) -> list[Job]:
    jobs = []
    for index in range(COUNT):
        document = _document(FIRST_SEED + index)
        keys = model_keys(Workflow.loads(document), registry.get)
        jobs.append(Job(index, document, {f"{SEED}.seed": str(FIRST_SEED + index)}, keys))
    return jobs


def _pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


@pytest.fixture(scope="module")
def local_worker():
    """A worker in this process, with one torch thread as each Ray worker of one CPU has (Ray sets
    OMP_NUM_THREADS): two threads change a few pixels by one level."""
    worker = SluiceWorker(default_registry)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield worker
    torch.set_num_threads(threads)
    worker.close()


@pytest.fixture(scope="module")
def alone(local_worker):
    """alone(seed) -> the pixels of that seed run alone in this process (each seed run once)."""
    results: dict[str, np.ndarray] = {}

    def run(seed: str) -> np.ndarray:
        if seed not in results:
            result = local_worker.run(_document(int(seed)))
            assert result.status == "finished", result.message
            (name, data), = result.images
            assert name == "sluice_00001_.png"  # the worker's folder is emptied after each job
            results[seed] = _pixels(data)
        return results[seed]

    return run


@pytest.fixture(scope="module")
def sweeps() -> dict[str, dict[str, np.ndarray]]:
    """Each sweep's images by seed, for comparing the sweeps with each other."""
    return {}


def test_a_repeated_job_saves_its_image_again(local_worker, alone) -> None:
    first = alone(str(FIRST_SEED))
    result = local_worker.run(_document(FIRST_SEED))  # every node's result is cached now
    assert result.status == "finished" and len(result.images) == 1
    assert np.array_equal(_pixels(result.images[0][1]), first)


def _check_output(folder: Path, alone, sweeps: dict, name: str) -> None:
    """COUNT files, one per seed, with their overrides and workflow; all distinct; REFERENCES of them (picked
    at random) equal to their seed run alone, and every one equal to the other sweep's image of its seed."""
    files = sorted(folder.glob("*.png"))
    assert len(files) == COUNT
    images: dict[str, np.ndarray] = {}
    for file in files:
        chunks = png_text(file)
        seed = json.loads(chunks[OVERRIDES_CHUNK])[f"{SEED}.seed"]
        assert Workflow.loads(chunks["sluice-workflow"]).nodes[SAMPLER].widgets["seed"] == int(seed)
        assert seed not in images, f"seed {seed} written twice"
        images[seed] = _pixels(file.read_bytes())
    assert sorted(images) == sorted(str(FIRST_SEED + index) for index in range(COUNT))  # none lost
    assert len({pixels.tobytes() for pixels in images.values()}) == COUNT  # 40 distinct images
    picked = random.sample(sorted(images), REFERENCES)
    for seed in picked:
        assert np.array_equal(images[seed], alone(seed)), f"seed {seed} (picked: {picked}) differs from it " \
                                                          f"run alone"
    for other, seen in sweeps.items():
        differ = [seed for seed in images if not np.array_equal(images[seed], seen[seed])]
        assert not differ, f"seeds {differ} differ between the {name} sweep and the {other} one"
    sweeps[name] = images


def _sweep(tmp_path: Path, kill_after: int | None) -> tuple[Scheduler, list]:
    registry = default_registry(load_settings())
    workers = start_workers(2, default_registry)
    scheduler = Scheduler(workers, retries=2)
    settings = Settings(tmp_path / "models", tmp_path / "out", None)
    outcomes = []
    for outcome in scheduler.run(_jobs(registry)):
        outcomes.append(outcome)
        for name, data in outcome.images:
            write_image(settings, name, data, outcome.job.overrides)
        if kill_after is not None and len(outcomes) == kill_after:
            ray.kill(workers[0], no_restart=True)
    for handle in workers:
        ray.kill(handle, no_restart=True)
    return scheduler, outcomes


def test_seed_sweep_on_two_workers_gives_each_image_once_as_run_alone(cluster, alone, sweeps,
                                                                     tmp_path: Path) -> None:
    scheduler, outcomes = _sweep(tmp_path, kill_after=None)
    assert [o.status for o in outcomes] == ["finished"] * COUNT, [o.message for o in outcomes]
    assert len({o.worker for o in outcomes}) == 2  # both workers took jobs
    assert scheduler.deaths == []
    _check_output(tmp_path / "out", alone, sweeps, "two-worker")


def test_a_worker_killed_halfway_loses_no_image(cluster, alone, sweeps, tmp_path: Path) -> None:
    scheduler, outcomes = _sweep(tmp_path, kill_after=COUNT // 2)
    assert [o.status for o in outcomes] == ["finished"] * COUNT, [o.message for o in outcomes]
    assert len(scheduler.deaths) == 1 and len(scheduler.workers) == 1
    assert any(o.job.attempts == 1 for o in outcomes)  # a job the dead worker held ran again elsewhere
    assert len({o.worker for o in outcomes[COUNT // 2 + 2:]}) == 1  # after the kill, one worker is left
    _check_output(tmp_path / "out", alone, sweeps, "killed-worker")


def test_jobs_go_to_the_worker_whose_budget_their_models_fit(cluster, tmp_path: Path) -> None:
    small = start_workers(1, default_registry, memory_flags={"max_vram": "cpu=0.01"})[0]  # under the UNet
    large = start_workers(1, default_registry, memory_flags={"max_vram": "cpu=1"})[0]
    try:
        document = _document(FIRST_SEED)
        fits = ray.get([small.model_fit.remote(document), large.model_fit.remote(document)])
        assert [fit.fits for fit in fits] == [False, True] and fits[0].model == "1/diffusion"
        assert fits[0].size == fits[1].size > fits[0].budget  # the same CPU dtype on both
        workflow = Workflow.loads(document)
        workflow.nodes[SAMPLER].widgets["steps"] = 2
        workflow.nodes["5"].widgets.update(width=64, height=64)
        keys = model_keys(workflow, default_registry(load_settings()).get)
        jobs = []
        for index in range(4):
            workflow.nodes[SAMPLER].widgets["seed"] = index
            jobs.append(Job(index, workflow.dumps(), model_keys=keys))
        outcomes = list(Scheduler([small, large], depth=1).run(jobs))
        assert [o.status for o in outcomes] == ["finished"] * 4, [o.message for o in outcomes]
        assert {o.worker for o in outcomes} == {ray.get(large.ping.remote())}  # the small one stayed idle
    finally:
        for handle in (small, large):
            ray.kill(handle, no_restart=True)


def test_an_interrupt_stops_the_jobs_waiting_for_the_running_one(local_worker) -> None:
    finished = []
    with local_worker._run_lock:  # a job is running
        waiting = threading.Thread(target=lambda: finished.append(local_worker.run(_document(7))))
        waiting.start()
        time.sleep(0.2)
        local_worker.interrupt()
    waiting.join()
    assert finished[0].status == "interrupted" and finished[0].images == []


def test_sluice_run_sweeps_seeds_on_ray(cluster, alone, tmp_path: Path, capsys) -> None:
    seeds = f"6.seed={FIRST_SEED}..{FIRST_SEED + 1}"
    assert main(["run", str(default_workflow_path()), "--sweep", seeds, "--ray", "auto", "--workers", "1",
                 "--output", str(tmp_path), "--quiet"]) == 0
    written = sorted(Path(line) for line in capsys.readouterr().out.split())
    assert written == sorted(tmp_path.glob("*.png")) and len(written) == 2
    for path in written:
        seed = json.loads(png_text(path)[OVERRIDES_CHUNK])["6.seed"]
        assert np.array_equal(_pixels(path.read_bytes()), alone(seed))
    assert ray.is_initialized()  # the test's Ray stays connected

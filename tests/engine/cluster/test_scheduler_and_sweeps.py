"""The scheduler's placement and retries on fake workers (no Ray), sweeps and their grid, images written with
their overrides, and `sluice run --ray` without Ray installed."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from app.cli import main
from engine.cluster import ClusterError
from engine.cluster import scheduler as scheduler_module
from engine.cluster.output import OVERRIDES_CHUNK, with_text_chunk, write_image
from engine.cluster.scheduler import Job, Scheduler
from engine.cluster.sweep import grid, parse_sweep
from engine.cluster.worker import ModelFit, WorkerResult
from engine.images import png_text, save_png
from engine.settings import Settings


class RayError(Exception):
    pass


class ActorDied(RayError):
    pass


SIZES = {"big": 10, "small": 2}  # a job's model, named by its document's letters, -> its bytes


class FitRef:
    def __init__(self, worker: FakeWorker, document: str) -> None:
        self.worker, self.document = worker, document


class FakeRay:
    """ray.wait / ray.get over FakeWorkers: a ref is done when made; a worker in `dead` raises ActorDied."""

    exceptions = SimpleNamespace(RayActorError=ActorDied, RayError=RayError)

    def __init__(self) -> None:
        self.dead: set[str] = set()

    def wait(self, refs, num_returns, timeout):  # the oldest job finishes first
        oldest = min(refs, key=lambda ref: int(ref[1].strip("abcdefghijklmnopqrstuvwxyz")))
        return [oldest], [ref for ref in refs if ref is not oldest]

    def get(self, ref):
        if isinstance(ref, FitRef):
            if ref.worker.name in self.dead:
                raise ActorDied(f"The actor {ref.worker.name} died unexpectedly")
            ref.worker.asked.append(ref.document)
            return ModelFit(SIZES.get(ref.document.rstrip("0123456789"), 0), ref.worker.budget)
        worker, document = ref
        if worker.name in self.dead:
            raise ActorDied(f"The actor {worker.name} died unexpectedly")
        if document.endswith("boom"):
            raise RayError("RayTaskError: the worker could not return")
        worker.ran.append(document)
        return WorkerResult("finished", [(f"{document}_00001_.png", b"")], worker=worker.name)


class FakeWorker:
    def __init__(self, name: str, budget: int | None = None) -> None:
        self.name = name
        self.budget = budget
        self.ran: list[str] = []
        self.asked: list[str] = []  # documents whose model_fit it was asked
        self.model_fit = SimpleNamespace(remote=lambda document: FitRef(self, document))
        self.run = SimpleNamespace(remote=lambda document, token, inputs: (self, document))
        self.interrupt = SimpleNamespace(remote=lambda: None)


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    fake = FakeRay()
    monkeypatch.setattr(scheduler_module, "require_ray", lambda: fake)
    return fake


def test_a_job_goes_to_the_worker_that_holds_its_models(fake_ray: FakeRay) -> None:
    a, b = FakeWorker("a"), FakeWorker("b")
    jobs = [Job(i, f"{model}{i}", model_keys=frozenset({model})) for i, model in enumerate("xyyx")]
    outcomes = list(Scheduler([a, b], depth=2).run(jobs))
    assert [o.status for o in outcomes] == ["finished"] * 4
    # y2 could go to a or b (one job each): b holds y's models; x3 then finds only a free
    assert a.ran == ["x0", "x3"] and b.ran == ["y1", "y2"]


def test_a_job_waits_for_a_worker_whose_budget_its_models_fit(fake_ray: FakeRay) -> None:
    small, large = FakeWorker("small", budget=4), FakeWorker("large", budget=16)
    jobs = [Job(i, f"{model}{i}", model_keys=frozenset({model})) for i, model in
            enumerate(["big", "big", "small", "big", "small"])]
    outcomes = list(Scheduler([small, large], depth=1).run(jobs))
    assert sorted(o.job.index for o in outcomes) == [0, 1, 2, 3, 4]
    assert large.ran == ["big0", "big1", "big3"]  # big1 waited for it while small took small2
    assert small.ran == ["small2", "small4"]
    assert len(small.asked) == len(large.asked) == 2  # once per set of models


def test_models_that_fit_no_worker_run_on_any(fake_ray: FakeRay) -> None:
    a, b = FakeWorker("a", budget=4), FakeWorker("b", budget=1)
    outcomes = list(Scheduler([a, b], depth=1).run([Job(i, f"big{i}", model_keys=frozenset({"big"}))
                                                    for i in range(4)]))
    assert [o.status for o in outcomes] == ["finished"] * 4 and a.ran and b.ran
    fake_ray.dead.add("a")  # the one worker they fit is dead: they run on the one left
    a, b = FakeWorker("a", budget=16), FakeWorker("b", budget=1)
    outcomes = list(Scheduler([a, b], depth=1).run([Job(i, f"big{i}", model_keys=frozenset({"big"}))
                                                    for i in range(2)]))
    assert [o.status for o in outcomes] == ["finished"] * 2 and sorted(b.ran) == ["big0", "big1"]


def test_a_dead_workers_jobs_run_elsewhere_then_fail_after_the_retries(fake_ray: FakeRay) -> None:
    a, b = FakeWorker("a"), FakeWorker("b")
    fake_ray.dead.add("a")
    outcomes = list(Scheduler([a, b], retries=1).run([Job(i, f"j{i}") for i in range(4)]))
    assert sorted(o.job.index for o in outcomes) == [0, 1, 2, 3]
    assert all(o.status == "finished" and o.worker == "b" for o in outcomes)
    fake_ray.dead.add("b")
    outcomes = list(Scheduler([FakeWorker("a"), FakeWorker("b")], retries=1).run([Job(0, "j0")]))
    assert [o.status for o in outcomes] == ["lost"] and "died" in outcomes[0].message


def test_a_job_that_fails_in_ray_fails_once(fake_ray: FakeRay) -> None:
    a = FakeWorker("a")
    outcomes = list(Scheduler([a], retries=2).run([Job(0, "j0boom"), Job(1, "j1")]))
    assert [(o.job.index, o.status) for o in outcomes] == [(0, "failed"), (1, "finished")]
    assert "RayTaskError" in outcomes[0].message and a.ran == ["j1"]


def test_jobs_added_one_at_a_time_and_one_interrupted_while_it_waits(fake_ray: FakeRay) -> None:
    a = FakeWorker("a")
    scheduler = Scheduler([a], depth=1)
    assert scheduler.has_room() and not scheduler.busy()
    scheduler.add(Job(0, "j0"))
    scheduler.add(Job(1, "j1"))
    assert not scheduler.has_room() and scheduler.busy()
    assert scheduler.interrupt_job(1) and not scheduler.interrupt_job(7)
    outcomes = []
    while scheduler.busy():
        outcomes += scheduler.step()
    assert sorted((o.job.index, o.status) for o in outcomes) == [(0, "finished"), (1, "interrupted")]
    assert a.ran == ["j0"] and scheduler.has_room()


def test_sweeps_and_their_grid(tmp_path: Path) -> None:
    (tmp_path / "prompts.txt").write_text("a fox\n\na cat = 2, grey\n", encoding="utf-8")
    seeds, prompts = parse_sweep("6.seed=1..3"), parse_sweep("3.text=@prompts.txt", tmp_path)
    assert seeds.values == ("1", "2", "3") and prompts.values == ("a fox", "a cat = 2, grey")
    assert parse_sweep("6.cfg=4,5.5").values == ("4", "5.5")
    assert grid([prompts, seeds])[:4] == [["3.text=a fox", "6.seed=1"], ["3.text=a fox", "6.seed=2"],
                                         ["3.text=a fox", "6.seed=3"], ["3.text=a cat = 2, grey", "6.seed=1"]]
    for bad in ("6.seed", "seed=1..3", "6.seed=3..1", "6.seed=@missing.txt"):
        with pytest.raises(ClusterError, match="--sweep"):
            parse_sweep(bad, tmp_path)


def test_returned_images_are_new_files_with_their_overrides_and_untouched_pixels(tmp_path: Path) -> None:
    image = torch.rand(6, 5, 3, generator=torch.Generator().manual_seed(0))
    data = save_png(image, tmp_path / "one.png", {"sluice-workflow": "{}"}).read_bytes()
    settings = Settings(tmp_path, tmp_path / "out", None)
    first = write_image(settings, "run/img_00007_.png", data, {"6.seed": "5"})
    second = write_image(settings, "run/img_00007_.png", data, {"6.seed": "6"})
    assert (first.name, second.name) == ("img_00001_.png", "img_00002_.png") and first.parent.name == "run"
    assert json.loads(png_text(second)[OVERRIDES_CHUNK]) == {"6.seed": "6"}
    assert png_text(second)["sluice-workflow"] == "{}"
    with Image.open(io.BytesIO(with_text_chunk(data, "k", "v"))) as read:
        assert np.array_equal(np.asarray(read), np.asarray(Image.open(tmp_path / "one.png")))


def test_ray_flags_without_ray_say_how_to_install_it(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["run", "any.json", "--sweep", "6.seed=1..2", "--ray", "auto"]) == 2
    assert "pip install 'sluice[cluster]'" in capsys.readouterr().err
    assert main(["run", "any.json", "--sweep", "6.seed=1..2"]) == 2
    assert "--ray" in capsys.readouterr().err


class _NeverInitRay:
    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        raise AssertionError(f"ray.init called with {kwargs} for an address nothing answers at")


def test_an_address_nothing_answers_at_fails_at_once_naming_it() -> None:
    import socket

    from app.cli import _connect_ray

    with socket.socket() as listener:  # a port that was just free: nothing listens there once closed
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"nothing answers at 127.0.0.1:{port}"):
        _connect_ray(_NeverInitRay(), f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="'somewhere' is not HOST:PORT"):
        _connect_ray(_NeverInitRay(), "somewhere")


def test_sluice_run_with_an_unreachable_ray_address_exits_2_naming_it(tmp_path, capsys) -> None:
    workflow = Path(__file__).resolve().parents[3] / "resources" / "workflows" / "default.json"
    code = main(["run", str(workflow), "--sweep", "6.seed=1..2", "--ray", "127.0.0.1:1",
                 "--output", str(tmp_path / "out")])
    assert code == 2
    error = capsys.readouterr().err
    assert "--ray 127.0.0.1:1: cannot connect to Ray: nothing answers at 127.0.0.1:1" in error

"""The driver's side: Ray workers (one actor per GPU, or per CPU core) and one queue of jobs over them.

Placement: a job goes only to a worker whose budget its models fit (each worker's --max-vram on the device
it computes them on, against their size from the files' headers: SluiceWorker.model_fit, asked once per
worker and set of models), unless none of the workers left fits them; then to any. Among those, it goes to
the least loaded worker, and among equally loaded ones to one whose held models include the job's (the
loaders' cache signatures): an idle worker that holds them first, else any idle one, else a busy one with
room. Each worker is taken to hold the models of the last job given to it (its executor caches that job's
loaders). A worker has room while it has fewer than `depth` jobs given to it (a second one waits in the
actor, so the worker does not idle between jobs). A job that must wait for a worker its models fit lets the
jobs behind it that can start now go first.

Faults: a worker that dies (killed, out of memory, its host gone: RayActorError) is dropped and each of its
jobs goes back to the front of the queue, at most `retries` times per job; after that the job fails with the
reason. A failed node fails its job once, without retry (it would fail again).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.cluster import ClusterError, require_ray
from engine.cluster.worker import ModelFit, SluiceWorker, WorkerResult

MAX_DEPTH = 4  # the most jobs given to one worker at once (its actor has 2 threads more: interrupt, fit)


@dataclass
class Job:
    index: int  # place in the grid (0-based)
    document: str  # the Sluice document as JSON, overrides applied
    overrides: dict[str, str] = field(default_factory=dict)  # "NODE_ID.INPUT" -> value text, as swept
    model_keys: frozenset[str] = frozenset()  # cache signatures of the job's model loaders
    attempts: int = 0  # times a worker died running it
    inputs: dict[str, bytes] = field(default_factory=dict)  # the input-folder files it reads (inputs.py)


@dataclass
class Outcome:
    job: Job
    status: str  # "finished" | "failed" | "interrupted" | "invalid" | "lost" (workers died `retries` times)
    images: list[tuple[str, bytes]] = field(default_factory=list)
    message: str = ""
    worker: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)  # the worker's (WorkerResult.events)
    failure: dict[str, str] | None = None  # the failed node's (WorkerResult.failure)


def model_keys(workflow: Any, lookup: Callable[[str], Any], settings: Any = None) -> frozenset[str]:
    """The cache signatures of the workflow's model loaders (nodes with a memory module): the same document
    gives the same keys, so two jobs with equal keys need the same models."""
    from engine.graph.executor import Executor

    signatures = Executor(lookup, settings=settings).signatures(workflow)
    return frozenset(f"{node_id}:{signature}" for node_id, signature in signatures.items()
                     if getattr(lookup(workflow.nodes[node_id].type), "memory_module", None))


def start_workers(count: int, registry_factory: Callable[[Any], Any], gpus: float = 0.0,
                  memory_flags: dict[str, Any] | None = None, models_root: str | None = None,
                  plugins_dir: str | None = None) -> list[Any]:
    """`count` SluiceWorker actors on the connected Ray cluster, each with `gpus` GPUs (1: a GPU of its own;
    0.5: two workers share one, each under its own --max-vram) or, with gpus 0, one CPU."""
    ray = require_ray()
    if count < 1:
        raise ClusterError(f"--workers {count}: expected at least 1")
    if gpus < 0 or (gpus > 1 and gpus != int(gpus)):
        raise ClusterError(f"{gpus} GPUs per worker: expected 0 (a CPU worker), a fraction of one, or a "
                           f"whole number")
    resources = {"num_gpus": gpus} if gpus else {"num_cpus": 1}
    actor = ray.remote(SluiceWorker).options(max_concurrency=MAX_DEPTH + 2, **resources)
    return [actor.remote(registry_factory, memory_flags, models_root, plugins_dir) for _ in range(count)]


def default_worker_count(ray: Any) -> tuple[int, float]:
    """(workers, GPUs per worker): one per GPU of the cluster, else one per CPU."""
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    return (gpus, 1.0) if gpus else (max(1, int(resources.get("CPU", 1))), 0.0)


@dataclass
class _Worker:
    handle: Any
    running: dict[Any, Job] = field(default_factory=dict)  # object ref -> job
    held: frozenset[str] = frozenset()
    done: int = 0
    fits: dict[frozenset[str], bool] = field(default_factory=dict)  # model keys -> fit its budget?


class Scheduler:
    def __init__(self, workers: list[Any], retries: int = 2, depth: int = 2) -> None:
        if not workers:
            raise ClusterError("no workers to schedule on")
        if retries < 0 or not 1 <= depth <= MAX_DEPTH:
            raise ClusterError(f"retries {retries}, depth {depth}: expected retries >= 0 and depth "
                               f"1..{MAX_DEPTH}")
        self.workers = [_Worker(handle) for handle in workers]
        self.retries = retries
        self.depth = depth
        self.deaths: list[str] = []  # why each dropped worker died
        self._stopping = False
        self._pending: deque[Job] = deque()
        self._dropped: list[Outcome] = []  # jobs interrupted while they waited, for the next step

    def run(self, jobs: Iterable[Job]) -> Iterator[Outcome]:
        """Run every job; yields each outcome as it arrives (not in grid order)."""
        self._pending.extend(jobs)
        while self.busy():
            yield from self.step()

    def add(self, job: Job) -> None:
        """Queue one more job (a server's prompt); `step` starts it."""
        self._pending.append(job)

    def busy(self) -> bool:
        """Whether a job waits or runs."""
        return bool(self._pending or self._dropped) or any(worker.running for worker in self.workers)

    def has_room(self) -> bool:
        """Whether a job added now would start at once (none waits and a worker has room), or be lost at once
        (no worker is left)."""
        return not self._pending and (not self.workers or any(len(worker.running) < self.depth
                                                              for worker in self.workers))

    def step(self, timeout: float = 1.0) -> list[Outcome]:
        """Start the jobs that can start, then wait at most `timeout` s for one to end (a timeout lets Ctrl+C
        be handled); returns the outcomes that came (none when nothing ended in time)."""
        ray = require_ray()
        outcomes, self._dropped = self._dropped, []
        if self._stopping:
            outcomes += [Outcome(job, "interrupted", message="interrupted before it started")
                         for job in self._pending]
            self._pending.clear()
        if not self.workers:
            reason = "; ".join(self.deaths) or "no workers"
            outcomes += [Outcome(job, "lost", message=f"no worker left: {reason}") for job in self._pending]
            self._pending.clear()
            return outcomes
        self._assign(self._pending)
        refs = [ref for worker in self.workers for ref in worker.running]
        if refs:
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
            if ready:
                outcomes += self._collect(ready[0], self._pending, ray)
        return outcomes

    def interrupt(self) -> None:
        """Stop: no new job starts, and every worker interrupts its running one."""
        self._stopping = True
        for worker in self.workers:
            worker.handle.interrupt.remote()

    def interrupt_job(self, index: int | None = None) -> bool:
        """Interrupt job `index` (every running job when None) and keep running the others; a job that waits
        to start is dropped (interrupted at the next step). With a depth over 1, the jobs given to the same
        worker are interrupted too. False when no such job waits or runs."""
        waiting = [job for job in self._pending if job.index == index]
        for job in waiting:
            self._pending.remove(job)
            self._dropped.append(Outcome(job, "interrupted", message="interrupted before it started"))
        hit = [worker for worker in self.workers if worker.running and (
            index is None or any(job.index == index for job in worker.running.values()))]
        for worker in hit:
            worker.handle.interrupt.remote()
        return bool(waiting or hit)

    def worker_of(self, index: int) -> Any | None:
        """The handle of the worker that job `index` was given to, None while it waits (or after it ended)."""
        return next((worker.handle for worker in self.workers
                     if any(job.index == index for job in worker.running.values())), None)

    def _assign(self, pending: deque[Job]) -> None:
        waiting: set[frozenset[str]] = set()  # models whose jobs wait for a worker they fit
        index = 0
        while index < len(pending) and not self._stopping:
            free = [worker for worker in self.workers if len(worker.running) < self.depth]
            if not free:
                return
            job = pending[index]
            fitting = {id(worker) for worker in self._able(job)} if job.model_keys not in waiting else set()
            able = [worker for worker in free if id(worker) in fitting]
            if not able:
                waiting.add(job.model_keys)
                index += 1
                continue
            worker = min(able, key=lambda w, keys=job.model_keys: (  # least loaded, then holding the models
                len(w.running), not (keys and keys <= w.held), w.done))
            del pending[index]
            worker.running[worker.handle.run.remote(job.document, str(job.index), job.inputs)] = job
            worker.held = job.model_keys

    def _able(self, job: Job) -> list[_Worker]:
        """The workers whose budget the job's models fit; every worker when none of them does."""
        if not job.model_keys:
            return self.workers
        ray = require_ray()
        asked = [(worker, worker.handle.model_fit.remote(job.document))
                 for worker in self.workers if job.model_keys not in worker.fits]
        for worker, ref in asked:
            try:
                fit: ModelFit = ray.get(ref)
                worker.fits[job.model_keys] = fit.fits
            except ray.exceptions.RayError:  # a dead worker fits nothing (its running jobs will say it died)
                worker.fits[job.model_keys] = False
        fitting = [worker for worker in self.workers if worker.fits[job.model_keys]]
        return fitting or self.workers

    def _collect(self, ref: Any, pending: deque[Job], ray: Any) -> Iterator[Outcome]:
        worker = next(worker for worker in self.workers if ref in worker.running)
        job = worker.running.pop(ref)
        try:
            result: WorkerResult = ray.get(ref)
        except ray.exceptions.RayActorError as error:
            self.workers.remove(worker)
            self.deaths.append(_first_line(error))
            again = []
            for lost in [job, *worker.running.values()]:  # its waiting jobs die with it
                lost.attempts += 1
                if lost.attempts > self.retries:
                    yield Outcome(lost, "lost", message=f"its worker died {lost.attempts} times; last: "
                                                        f"{_first_line(error)}")
                else:
                    again.append(lost)
            pending.extendleft(reversed(again))  # back at the front, in their order
            return
        except ray.exceptions.RayError as error:  # the job's own failure that the worker could not catch
            worker.done += 1
            yield Outcome(job, "failed", message=_first_line(error))
            return
        worker.done += 1
        yield Outcome(job, result.status, result.images, result.message, result.worker, result.events,
                      result.failure)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


"""Images per second of a seed sweep over Ray workers (engine/cluster): the acceptance program of issue 19.

    python bench/scale.py                        # CPU: the embedded model, 64x64, 2 steps, 1 and 2 workers
    python bench/scale.py --sd15 --workers 1,2,4 --max-vram 4   # a GPU: an SD1.5-shaped checkpoint (random
                                                 # fp16 weights), 512x512, 20 steps, N workers sharing it

Each row starts a local Ray (`ray.init`, CPUs for --cpu-workers, the GPUs it sees), starts N SluiceWorker
actors (CPU: one CPU each; --sd15: 1/N of the GPU each, every worker under its own --max-vram), gives each
one warm-up job (models load: "warm-up s"), then times a sweep of --images seeds through the Scheduler
("images/s" from the first job given to the last image back; the images themselves are not kept). Writes
scale_[sd15_]<device>_<time>.log, .json and .png (images/s against workers beside linear scaling, and the
warm-up) under --out. On a shared GPU
the workers' kernels interleave, so the sweep scales only while one worker leaves the GPU idle (small
images, the host's share of a step); --max-vram bounds each worker's ledger, not the CUDA caching allocator.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plots import Line, Panel, draw  # noqa: E402

from engine.cluster.scheduler import Job, Scheduler, start_workers  # noqa: E402
from engine.graph.document import Workflow  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def embedded_workflow(side: int, steps: int) -> Workflow:
    workflow = Workflow.loads((ROOT / "resources" / "workflows" / "default.json").read_text(encoding="utf-8"))
    workflow.nodes["5"].widgets.update(width=side, height=side)
    workflow.nodes["6"].widgets.update(steps=steps)
    return workflow


def sd15_workflow(side: int, steps: int) -> Workflow:
    """The default workflow's shape with one SD1.5 checkpoint (its CLIP and VAE too)."""
    workflow = Workflow()
    add = workflow.add_node
    checkpoint = add("CheckpointLoaderSimple", {"ckpt_name": "sd15.safetensors"}).id
    positive = add("CLIPTextEncode", {"text": "a lighthouse on a cliff at dusk"}).id
    negative = add("CLIPTextEncode", {"text": ""}).id
    latent = add("EmptyLatentImage", {"width": side, "height": side, "batch_size": 1}).id
    sampler = add("KSampler", {"seed": 0, "steps": steps, "cfg": 7.0, "sampler_name": "euler",
                               "scheduler": "normal", "denoise": 1.0}).id
    decode = add("VAEDecode", {}).id
    save = add("SaveImage", {"filename_prefix": "scale"}).id
    for source, output, target, name, kind in (
            (checkpoint, 1, positive, "clip", "CLIP"), (checkpoint, 1, negative, "clip", "CLIP"),
            (checkpoint, 0, sampler, "model", "MODEL"), (positive, 0, sampler, "positive", "CONDITIONING"),
            (negative, 0, sampler, "negative", "CONDITIONING"),
            (latent, 0, sampler, "latent_image", "LATENT"),
            (sampler, 0, decode, "samples", "LATENT"), (checkpoint, 2, decode, "vae", "VAE"),
            (decode, 0, save, "images", "IMAGE")):
        workflow.connect(source, output, target, name, kind)
    return workflow


def sampler_id(workflow: Workflow) -> str:
    return next(node_id for node_id, node in workflow.nodes.items() if node.type == "KSampler")


def jobs(workflow: Workflow, seeds: range) -> list[Job]:
    sampler, made = sampler_id(workflow), []
    for seed in seeds:
        workflow.nodes[sampler].widgets["seed"] = seed
        made.append(Job(seed, workflow.dumps(), {f"{sampler}.seed": str(seed)}, frozenset({"model"})))
    return made


def write_sd15(models: Path) -> None:
    """bench/e2e.py's SD1.5 checkpoint (every key and shape of a real one, random fp16 weights)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from e2e import write_checkpoint

    write_checkpoint(models / "checkpoints" / "sd15.safetensors", "sd15", "full", torch.float16, "cuda")


def measure(workflow: Workflow, count: int, images: int, gpus: float, flags: dict[str, Any],
            models: str | None) -> tuple[float, float]:
    """(warm-up s, images/s) of `images` seeds over `count` fresh workers."""
    import ray

    from nodes.registry import default_registry

    workers = start_workers(count, default_registry, gpus, flags, models)
    try:
        began = time.perf_counter()  # one job per worker: each loads the models
        warm_jobs = jobs(workflow, range(images, images + count))  # seeds the sweep does not use
        warm = ray.get([worker.run.remote(job.document)
                        for worker, job in zip(workers, warm_jobs, strict=True)])
        warm_up = time.perf_counter() - began
        began = time.perf_counter()
        done = list(Scheduler(workers, retries=0).run(jobs(workflow, range(images))))
        seconds = time.perf_counter() - began
        bad = [(o.status, o.message) for o in done if o.status != "finished"]
        bad += [(result.status, result.message) for result in warm if result.status != "finished"]
        if bad:
            raise SystemExit(f"a job did not finish: {bad[0][0]}: {bad[0][1]}")
        return warm_up, len(done) / seconds
    finally:
        for handle in workers:
            ray.kill(handle, no_restart=True)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    """images/s against workers beside linear scaling from one worker's rate, and the warm-up seconds."""
    first = rows[0]["images_per_s"] / rows[0]["workers"]
    rate = Panel("throughput", "workers", "images / s", y_from_zero=True, lines=[
        Line("measured", [(r["workers"], r["images_per_s"]) for r in rows]),
        Line(f"linear (the rate of {rows[0]['workers']} worker(s), per worker)",
             [(r["workers"], first * r["workers"]) for r in rows], "dashed")])
    warm = Panel("warm-up (each worker loads the models)", "workers", "seconds", y_from_zero=True,
                 lines=[Line("warm-up", [(r["workers"], r["warm_up_s"]) for r in rows])])
    return draw(path, [rate, warm], title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sd15", action="store_true", help="the SD1.5-shaped checkpoint on the GPU")
    parser.add_argument("--workers", default="1,2", help="comma list of worker counts (default 1,2)")
    parser.add_argument("--images", type=int, default=0, help="seeds per row (default: 8 CPU, 32 --sd15)")
    parser.add_argument("--side", type=int, default=0, help="image side (default: 64 CPU, 512 --sd15)")
    parser.add_argument("--steps", type=int, default=0, help="sampling steps (default: 2 CPU, 20 --sd15)")
    parser.add_argument("--max-vram", default="", help="each worker's --max-vram (GiB; --sd15)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/sluice_scale"),
                        help="where --sd15 writes its checkpoint once")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the .log, .json and .png go")
    args = parser.parse_args()
    import ray

    counts = [int(text) for text in args.workers.split(",")]
    if args.sd15:
        images, side, steps = args.images or 32, args.side or 512, args.steps or 20
        models = args.workdir / "models"
        write_sd15(models)
        workflow, gpus_of = sd15_workflow(side, steps), (lambda count: 1.0 / count)
        flags = {"max_vram": args.max_vram} if args.max_vram else {}
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(counts) + 1)
    else:
        images, side, steps = args.images or 8, args.side or 64, args.steps or 2
        models, workflow, gpus_of, flags = None, embedded_workflow(side, steps), (lambda count: 0.0), {}
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(counts))
    title = (f"{'SD1.5-shaped' if args.sd15 else 'embedded'} model, {side}x{side}, {steps} steps, "
             f"{images} images a row, {os.cpu_count()} CPUs"
             + (f", --max-vram {args.max_vram}" if flags else ""))
    lines = [title, f"{'workers':>8} {'warm-up s':>10} {'images/s':>9} {'x 1 worker':>11}"]
    print("\n".join(lines), flush=True)
    first, rows = math.nan, []
    for count in counts:
        warm_up, rate = measure(workflow, count, images, gpus_of(count), flags,
                                str(models) if models else None)
        first = rate if math.isnan(first) else first
        rows.append({"workers": count, "warm_up_s": warm_up, "images_per_s": rate,
                     "over_first": rate / first})
        lines.append(f"{count:>8} {warm_up:>10.1f} {rate:>9.2f} {rate / first:>11.2f}")
        print(lines[-1], flush=True)
    ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"scale_{'sd15_cuda' if args.sd15 else 'cpu'}_{time.strftime('%Y%m%d_%H%M%S')}"
    stem.with_suffix(".log").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(
        {"model": "sd15" if args.sd15 else "embedded", "side": side, "steps": steps, "images": images,
         "max_vram": args.max_vram or None, "cpus": os.cpu_count(), "rows": rows}, indent=2))
    plot(rows, stem.with_suffix(".png"), title)
    print(f"wrote {stem}.log, .json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

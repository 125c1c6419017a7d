"""Resident UNet step time: our UNet called directly, through the memory runtime, and diffusers' UNet.

    python bench/unet_resident.py [--profile]     # on a GPU: SD1.5 512x512 and SDXL 1024x1024, fp16, batch 2

Separates the model's own speed from the memory runtime's overhead (bench/memory.py measures the runtime).
Random weights (speed does not depend on their values). Each row: median of
--steps CUDA-event timings after --warmup, peak `torch.cuda.max_memory_allocated`, and the host time to
queue one step (when it is close to the step time the model is launch-bound). `--profile` prints the
ten CUDA kernels that take the most time per model and implementation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import _diffusers_config, model_cases, random_weights, registered_unet, unet_inputs  # noqa: E402

from engine.devices import GIB  # noqa: E402
from engine.models.unet import UNetModel  # noqa: E402


def timed(step, device: torch.device, warmup: int, steps: int) -> tuple[float, float, float]:
    """(median ms, peak GiB, median host ms to queue a step)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times, host = [], []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        step()
        host.append((time.perf_counter() - began) * 1e3)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated(device) / GIB, statistics.median(host)


def top_kernels(step, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"--- {label}: top CUDA kernels")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=70))


def bench_case(name, config, side, args, device, dtype) -> list[tuple]:
    from diffusers import UNet2DConditionModel

    weights = random_weights(config, dtype, device)
    x, timesteps, context, y = unet_inputs(config, side, dtype, device)
    ours = UNetModel(config, dtype=dtype, device="meta")
    ours.load_state_dict({k: v.to(device) for k, v in weights.items()}, assign=True)
    ours.eval()
    with torch.device(device):
        theirs = UNet2DConditionModel.from_config(_diffusers_config(config)).to(dtype).eval()
    added = None
    if config.adm_in_channels:
        added = {"text_embeds": y[:, :1280], "time_ids": torch.zeros(2, 6, device=device, dtype=dtype)}
    runtime, module, staged, _, _ = registered_unet(config, weights, device, "device", 1 << 50)
    steps = {
        "ours, direct forward": lambda: ours(x, timesteps, context, y),
        "ours, memory runtime (resident)": lambda: runtime.run(
            module, staged, staged.stages(), staged.initial_state(x, timesteps, context, y))["h"],
        "diffusers": lambda: theirs(x, timesteps, context, added_cond_kwargs=added).sample,
    }
    rows = []
    with torch.no_grad():
        for label, step in steps.items():
            ms, peak, host = timed(step, device, args.warmup, args.steps)
            rows.append((name, label, ms, peak, host))
            print(f"| {name} | {label} | {ms:.1f} | {peak:.3f} | {host:.1f} |", flush=True)
        if args.profile:
            for label in ("ours, direct forward", "diffusers"):
                top_kernels(steps[label], f"{name}, {label}")
    runtime.unregister(module)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device, dtype = torch.device("cuda", 0), torch.float16
    rows = []
    for name, config, side in model_cases(tiny=False):
        rows += bench_case(name, config, side, args, device, dtype)
        torch.cuda.empty_cache()
    print("| model | implementation | ms / step | peak GiB | host ms to queue |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, label, ms, peak, host in rows:
        print(f"| {name} | {label} | {ms:.1f} | {peak:.3f} | {host:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

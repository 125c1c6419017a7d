"""One UNet on one GPU against the same UNet split over two (reference/000 layer split and row split).

    .venv/bin/python bench/multi_gpu.py         # 2+ CUDA GPUs: SDXL UNet fp16, 1024x1024, batch 2
    .venv/bin/python bench/multi_gpu.py --tiny  # seconds on a CPU: a tiny UNet, float32, on two device names
                                                # (cuda0, cuda1) that both compute on the CPU

Random weights (drawn on the GPU, kept in pinned RAM as the checkpoint), every weight resident ("device"
home). Rows: single GPU (cuda0), layer split cuda0&cuda1, row split cuda0&cuda1. Each row: median ms per
UNet step (CUDA events on cuda0, after the step's work on every device) of --steps after --warmup, the peak
`torch.cuda.max_memory_allocated` of each device (with --tiny, the ledgers' tracked peak instead) and the
largest absolute difference of the output from the single-GPU output. Writes
multi_gpu_[tiny_]<device>_<time>.log, .json and .png (step time and each device's peak per mode) under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plots import Bars, Panel, draw  # noqa: E402

from engine.devices import GIB, ComputeDevice, list_devices  # noqa: E402
from engine.memory.ledger import DeviceLedger  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.models.detect import UNetConfig  # noqa: E402
from engine.models.unet import UNetModel, sdxl_unet_config  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TWO = ("cuda0", "cuda1")
MODES = (("single GPU (cuda0)", ("cuda0",), "layer"), ("layer split cuda0&cuda1", TWO, "layer"),
         ("row split cuda0&cuda1", TWO, "row"))


def tiny_config() -> UNetConfig:
    return UNetConfig(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
                      attention_levels=(0, 1), transformer_depth=(1, 2), transformer_depth_middle=1,
                      num_heads=-1, num_head_channels=16, context_dim=64, use_linear_in_transformer=True,
                      adm_in_channels=128, num_classes="sequential", prediction="eps", family="sdxl")


def random_weights(config: UNetConfig, dtype: torch.dtype, draw_on: torch.device) -> dict[str, torch.Tensor]:
    """Matrices and kernels of standard deviation 1/sqrt(fan_in), norm scales 1, biases 0 (activations of
    order one), drawn on `draw_on` and kept in RAM (pinned when drawn on a GPU)."""
    generator = torch.Generator(draw_on).manual_seed(0)
    weights = {}
    for name, parameter in UNetModel(config, dtype=dtype, device="meta").named_parameters():
        if parameter.ndim >= 2:
            tensor = (torch.randn(parameter.shape, generator=generator, device=draw_on)
                      / parameter[0].numel() ** 0.5).to(dtype)
        else:
            tensor = torch.full(parameter.shape, 1.0 if name.endswith("weight") else 0.0, dtype=dtype)
        weights[name] = tensor.cpu().pin_memory() if draw_on.type == "cuda" else tensor.cpu()
    return weights


def inputs(config: UNetConfig, side: int, dtype: torch.dtype, device: torch.device,
           ) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, config.in_channels, side, side, generator=generator)
    context = torch.randn(2, 77, config.context_dim, generator=generator)
    y = torch.randn(2, config.adm_in_channels, generator=generator)
    timesteps = torch.tensor([999.0, 10.0])
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() and t.ndim > 1 else t.dtype)
                 for t in (x, timesteps, context, y))


def cpu_runtime() -> MemoryRuntime:
    """Two device names on the CPU, each with a ledger of 1 GiB."""
    bus = EventBus()
    cpu = torch.device("cpu")
    devices = [ComputeDevice(f"cuda{i}", cpu, "gpu", "a GPU name on the CPU") for i in range(2)]
    ledgers = {d.name: DeviceLedger(d.name, GIB, bus=bus) for d in devices}
    return MemoryRuntime(MemorySettings(), devices=devices, bus=bus, ledgers=ledgers)


def time_step(step: Callable[[], torch.Tensor], on_gpu: bool) -> float:
    """Milliseconds of one step: CUDA events on cuda0 (the output is gathered there), else the wall clock."""
    if not on_gpu:
        began = time.perf_counter()
        step()
        return (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)
    return start.elapsed_time(end)


def run_mode(runtime: MemoryRuntime, config: UNetConfig, dtype: torch.dtype, weights: dict[str, torch.Tensor],
             devices: tuple[str, ...], split_mode: str, batch: tuple[torch.Tensor, ...], warmup: int,
             steps: int, on_gpu: bool) -> tuple[float, list[float], torch.Tensor]:
    """(median ms per step, peak GiB per device, output) of the UNet registered on `devices`."""
    unet = UNetModel(config, dtype=dtype, device="meta")
    name = runtime.register("diffusion", unet, "device", devices[0], weights.__getitem__, devices, split_mode)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return runtime.run(name, unet, unet.stages(), unet.initial_state(*batch))["h"]

    for _ in range(warmup):
        step()
    for index, device in enumerate(TWO):
        if on_gpu:
            torch.cuda.synchronize(index)
            torch.cuda.reset_peak_memory_stats(index)
        runtime.ledger(device).peak_tracked = runtime.ledger(device).tracked()
    times = [time_step(step, on_gpu) for _ in range(steps)]
    output = step().float().cpu()
    if on_gpu:
        peaks = [torch.cuda.max_memory_allocated(index) / GIB for index in range(2)]
    else:
        peaks = [runtime.ledger(device).peak_tracked / GIB for device in TWO]
    runtime.unregister(name)
    return statistics.median(times), peaks, output


def plot(rows: list[dict], path: Path, title: str, unit: str) -> Path:
    """ms per step per mode (with each split's largest difference from the single-GPU output), and each
    device's peak per mode."""
    modes = [row["mode"] for row in rows]
    note = "largest |difference| from the single GPU's output: " + ", ".join(
        f"{row['mode'].split()[0]} {row['max_abs_difference']:.3g}" for row in rows[1:])
    steps = Panel("ms per UNet step", "ms / step", categories=modes, note=note,
                  bars=[Bars("step", [row["ms"] for row in rows])])
    per_device = [Bars(device, [row["peaks"][index] for row in rows]) for index, device in enumerate(TWO)]
    peaks = Panel("peak memory per device", unit, categories=modes, bars=per_device)
    return draw(path, [steps, peaks], title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny UNet on two device names on the CPU")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    on_gpu = not args.tiny
    if on_gpu and torch.cuda.device_count() < 2:
        sys.exit(f"bench/multi_gpu.py needs 2 CUDA GPUs (found {torch.cuda.device_count()}); "
                 f"--tiny runs on a CPU")
    if on_gpu:
        config, side, dtype, draw_on = sdxl_unet_config(), 128, torch.float16, torch.device("cuda", 0)
        runtime = MemoryRuntime(MemorySettings(), devices=list_devices())
        title = f"SDXL UNet fp16, 1024x1024, batch 2, on {torch.cuda.get_device_name(0)} x2"
    else:
        config, side, dtype, draw_on = tiny_config(), 16, torch.float32, torch.device("cpu")
        runtime = cpu_runtime()
        title = "tiny UNet float32, 16x16 latent, batch 2, on two device names on the CPU"
    began = time.perf_counter()
    weights = random_weights(config, dtype, draw_on)
    batch = inputs(config, side, dtype, draw_on)
    rows, reference, measured = [], None, []
    for label, devices, split_mode in MODES:
        ms, peaks, output = run_mode(runtime, config, dtype, weights, devices, split_mode, batch, args.warmup,
                                     args.steps, on_gpu)
        reference = output if reference is None else reference
        scale = 1 if on_gpu else 1024  # GiB on a GPU, MiB for the tiny model
        difference = (output - reference).abs().max().item()
        measured.append({"mode": label, "ms": ms, "peaks": [peak * scale for peak in peaks],
                         "max_abs_difference": difference})
        rows.append((label, f"{ms:.1f}", f"{peaks[0] * scale:.2f}", f"{peaks[1] * scale:.2f}",
                     f"{difference:.3g}"))
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    peak = "peak GiB" if on_gpu else "ledger peak MiB"
    header = ("mode", "ms/step", f"cuda0 {peak}", f"cuda1 {peak}", "max |diff|")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [title] + ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                 for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                       for row in [header, *rows]]
    lines.append(f"({args.warmup} warmup + {args.steps} timed steps per mode; "
                 f"{time.perf_counter() - began:.0f} s)")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"multi_gpu_{'cuda_x2' if on_gpu else 'tiny_cpu'}_{time.strftime('%Y%m%d_%H%M%S')}"
    stem.with_suffix(".log").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(
        {"title": title, "warmup": args.warmup, "steps": args.steps, "peak_unit": peak, "rows": measured},
        indent=2))
    plot(measured, stem.with_suffix(".png"), title, peak)
    print(f"wrote {stem}.log, .json and .png")


if __name__ == "__main__":
    main()

"""FLUX.1-dev's transformer and SDXL's UNet on one GPU against the same model split over two (reference/000
layer split and row split).

    python3 bench/multi_gpu.py                # 2+ CUDA GPUs: FLUX.1-dev bf16 1024x1024 batch 1, SDXL UNet
                                              # fp16 1024x1024 batch 2
    python3 bench/multi_gpu.py --models flux  # one of them (flux, sdxl)
    python3 bench/multi_gpu.py --tiny         # seconds on a CPU: tiny models of the same shapes, float32, on
                                              # two device names (cuda0, cuda1) that both compute on the CPU

Random weights (drawn on the GPU, kept in pinned RAM as the checkpoint). Rows per model:
- single GPU (cuda0): every weight resident, no budget; the reference output and step;
- layer split cuda0&cuda1 and row split cuda0&cuda1, weights resident. FLUX's run with each GPU's budget
  (`--max-vram`) at half the transformer's weights plus the split's compute headroom (layer_split.py's
  SPLIT_HEADROOM, 2 GiB), so neither GPU could hold the model alone (`--budget-gib` sets another); SDXL's
  without budgets, as the earlier two-GPU runs (bench/results/multi_gpu_*);
- FLUX: the layer split again with T5-XXL on the second GPU (te=cuda1, its weights in pinned RAM, streamed
  within what the transformer's part leaves of cuda1's budget): a 512-token prompt encoded once (its ms in
  the row's note), then the steps.
Each row: median ms per step (CUDA events on cuda0, after every device's work) of --steps after --warmup; per
device the peak allocated and reserved GiB over the whole row, registration included (with --tiny: the
ledgers' tracked peak in MiB); MiB moved between the devices per step, counted where the runtime moves them
(the layer split's state into each part on another device and back to the main one, by torch device, so
none with --tiny; the row split's input copies to the other device and the partial outputs gathered back,
by its row slices, so --tiny counts them too); the time one copy of that many bytes takes from cuda0 to
cuda1 alone; and the output against the single GPU's: largest |difference| and the relative RMS difference,
a layer split exactly equal, a row split within ROW_TOLERANCE.

Targets (issue 25): a layer split within 1.10x of the single GPU's step plus its copy time; each device's
peak within its budget. Writes multi_gpu_<device>_<time>.log, .json and .png under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux import flux_inputs, full_configs, tiny_configs  # noqa: E402
from memory import random_model_weights  # noqa: E402
from plots import Bars, Panel, draw  # noqa: E402

from engine.devices import GIB, ComputeDevice, list_devices  # noqa: E402
from engine.memory import runtime as runtime_module  # noqa: E402
from engine.memory.layer_split import SPLIT_HEADROOM  # noqa: E402
from engine.memory.ledger import DeviceLedger  # noqa: E402
from engine.memory.row_split import RowShardedLinear  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.models.detect import UNetConfig  # noqa: E402
from engine.models.flux import FluxTransformer  # noqa: E402
from engine.models.t5 import T5Encoder  # noqa: E402
from engine.models.unet import UNetModel, sdxl_unet_config  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1024**2
TWO = ("cuda0", "cuda1")
LAYER_TARGET = 1.10  # a layer split's step / (single GPU step + copy time)
ROW_TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}  # relative RMS difference
T5_TOKENS = 512


@dataclass
class Case:
    """One model to split: how to build it (on the meta device), its weights and a step's inputs."""
    name: str  # flux, sdxl
    title: str
    build: Callable[[], nn.Module]
    weights: dict[str, torch.Tensor]
    inputs: tuple
    dtype: torch.dtype
    budget: int | None  # bytes per device for the split rows, None: no budget
    text_encoder: Callable[[], tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]] | None = None


@dataclass
class Mode:
    label: str
    devices: tuple[str, ...]
    split: str
    budget: int | None = None
    te_device: str | None = None  # T5 registered on this device, the prompt encoded before the steps


@dataclass
class Result:
    model: str
    mode: str
    ms: float
    peak_gib: list[float]  # allocated (GPU) or ledger tracked (--tiny), per device of TWO
    reserved_gib: list[float | None]
    budget_gib: float | None
    moved_mib: float  # between the devices, per step
    copy_ms: float  # one copy of moved_mib from cuda0 to cuda1
    max_abs_difference: float = 0.0
    relative_rms: float = 0.0
    note: str = ""
    checks: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ models


def tiny_unet_config() -> UNetConfig:
    return UNetConfig(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
                      attention_levels=(0, 1), transformer_depth=(1, 2), transformer_depth_middle=1,
                      num_heads=-1, num_head_channels=16, context_dim=64, use_linear_in_transformer=True,
                      adm_in_channels=128, num_classes="sequential", prediction="eps", family="sdxl")


def unet_inputs(config: UNetConfig, side: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """(latent [2, 4, side, side], timesteps, context [2, 77, C], ADM vector [2, A]) as a CFG batch."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, config.in_channels, side, side, generator=generator)
    context = torch.randn(2, 77, config.context_dim, generator=generator)
    y = torch.randn(2, config.adm_in_channels, generator=generator)
    timesteps = torch.tensor([999.0, 10.0])
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() and t.ndim > 1 else t.dtype)
                 for t in (x, timesteps, context, y))


def sdxl_case(tiny: bool, device: torch.device) -> Case:
    config, side, dtype = (tiny_unet_config(), 16, torch.float32) if tiny else (sdxl_unet_config(), 128,
                                                                                 torch.float16)

    def build() -> nn.Module:
        return UNetModel(config, dtype=dtype, device="meta")

    title = ("tiny SDXL-shaped UNet float32, 16x16 latent, batch 2" if tiny
             else "SDXL UNet fp16, 1024x1024, batch 2")
    return Case("sdxl", title, build, random_model_weights(build(), dtype, device),
                unet_inputs(config, side, dtype, device), dtype, None)


def flux_case(tiny: bool, device: torch.device, budget_gib: float | None) -> Case:
    configs = tiny_configs() if tiny else full_configs()
    dtype, side = (torch.float32, 8) if tiny else (torch.bfloat16, 128)

    def build() -> nn.Module:
        return FluxTransformer(configs.flux, dtype=dtype, device="meta")

    weights = random_model_weights(build(), dtype, device)
    total = sum(t.nbytes for t in weights.values())
    if budget_gib is not None:
        budget = int(budget_gib * GIB)
    elif tiny:
        budget = total + 16 * MIB  # split_capacity leaves half of a small budget to compute
    else:
        budget = math.ceil((total / 2 + SPLIT_HEADROOM) / (GIB / 4)) * (GIB // 4)  # in quarter GiB

    def text_encoder() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
        model = T5Encoder(configs.t5, dtype=dtype, device="meta")
        generator = torch.Generator().manual_seed(2)
        tokens = torch.randint(2, configs.t5.vocab_size, (1, T5_TOKENS), generator=generator)
        return model, random_model_weights(model, dtype, device), tokens

    tokens = T5_TOKENS if not tiny else 16
    title = (f"tiny FLUX-shaped transformer float32, {side * 8}x{side * 8}, batch 1" if tiny
             else "FLUX.1-dev transformer bf16, 1024x1024, batch 1")
    return Case("flux", title, build, weights, flux_inputs(configs.flux, side, tokens, dtype, device), dtype,
                budget, text_encoder)


def modes(case: Case) -> list[Mode]:
    rows = [Mode("single GPU (cuda0)", ("cuda0",), "layer"),
            Mode("layer split cuda0&cuda1", TWO, "layer", case.budget),
            Mode("row split cuda0&cuda1", TWO, "row", case.budget)]
    if case.text_encoder is not None:
        rows.append(Mode("layer split, te=cuda1", TWO, "layer", case.budget, te_device="cuda1"))
    return rows


# ------------------------------------------------------------------------------------------------ measuring


def make_runtime(on_gpu: bool, budget: int | None) -> MemoryRuntime:
    """The GPUs with `budget` bytes each (as `--max-vram`), or two device names on the CPU."""
    if on_gpu:
        max_vram = "" if budget is None else ",".join(f"{name}={budget / GIB:.4f}" for name in TWO)
        return MemoryRuntime(MemorySettings(max_vram=max_vram), devices=list_devices())
    bus = EventBus()
    cpu = torch.device("cpu")
    devices = [ComputeDevice(name, cpu, "gpu", "a GPU name on the CPU") for name in TWO]
    ledgers = {d.name: DeviceLedger(d.name, budget or GIB, bus=bus) for d in devices}
    return MemoryRuntime(MemorySettings(), devices=devices, bus=bus, ledgers=ledgers)


def moved_bytes(state: Any, device: torch.device) -> int:
    """Bytes of the tensors in `state` (also inside lists, tuples and dicts) that are not yet on `device`."""
    if isinstance(state, torch.Tensor):
        return 0 if state.device == device else state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(moved_bytes(value, device) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(moved_bytes(value, device) for value in state)
    return 0


class CrossDeviceBytes:
    """Bytes split modules move between their devices: the layer split's state copies at its part boundaries
    (engine.memory.runtime's move_state, by torch device: none between --tiny's two names on the CPU) and
    the row split's input copies and gathered outputs (by the row slices, so --tiny counts them too)."""

    def __init__(self) -> None:
        self.bytes = 0

    @contextmanager
    def counting(self) -> Iterator[None]:
        move, forward = runtime_module.move_state, RowShardedLinear.forward
        counter = self

        def counted_move(state: Any, device: torch.device | str) -> Any:
            counter.bytes += moved_bytes(state, torch.device(device))
            return move(state, device)

        def counted_forward(linear: RowShardedLinear, x: torch.Tensor) -> torch.Tensor:
            rows_elsewhere = sum(stop - start for start, stop in linear.rows[1:])  # slices after the main's
            tokens = x.numel() // linear.in_features
            counter.bytes += (len(linear.rows) - 1) * x.numel() * x.element_size()  # the input, to each other
            counter.bytes += tokens * rows_elsewhere * x.element_size()  # their outputs, gathered
            return forward(linear, x)

        with (mock.patch.object(runtime_module, "move_state", counted_move),
              mock.patch.object(RowShardedLinear, "forward", counted_forward)):
            yield


def synchronize_all(on_gpu: bool) -> None:
    if on_gpu:
        for index in range(len(TWO)):
            torch.cuda.synchronize(index)


def time_step(step: Callable[[], torch.Tensor], on_gpu: bool) -> float:
    """Milliseconds of one step: CUDA events on cuda0 (the output is gathered there), else the wall clock."""
    if not on_gpu:
        began = time.perf_counter()
        step()
        return (time.perf_counter() - began) * 1e3
    synchronize_all(on_gpu)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    synchronize_all(on_gpu)
    return start.elapsed_time(end)


def copy_ms(nbytes: int, on_gpu: bool) -> float:
    """Median ms of one copy of `nbytes` from cuda0 to cuda1 (on the CPU: a copy within RAM)."""
    if nbytes == 0:
        return 0.0
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0" if on_gpu else "cpu")
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1" if on_gpu else "cpu")
    times = [time_step(lambda: target.copy_(source, non_blocking=True), on_gpu) for _ in range(7)]
    return statistics.median(times[2:])


def run_mode(case: Case, mode: Mode, on_gpu: bool, warmup: int, steps: int
             ) -> tuple[Result, torch.Tensor]:
    gc.collect()
    if on_gpu:
        for index in range(len(TWO)):
            with torch.cuda.device(index):
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(index)
    runtime = make_runtime(on_gpu, mode.budget)
    model = case.build()
    name = runtime.register("diffusion", model, "device", mode.devices[0], case.weights.__getitem__,
                            mode.devices, mode.split)
    note = ""
    if mode.te_device is not None:
        encoder, encoder_weights, tokens = case.text_encoder()
        te = runtime.register("te", encoder, "cpu", mode.te_device, encoder_weights.__getitem__)
        tokens = tokens.to(runtime.device(mode.te_device).torch_device)
        with torch.inference_mode():
            began = time.perf_counter()
            runtime.run(te, encoder, encoder.stages(), encoder.initial_state(tokens))
            synchronize_all(on_gpu)
        note = (f"T5 prompt of {tokens.shape[1]} tokens on {mode.te_device}: "
                f"{(time.perf_counter() - began) * 1e3:.0f} ms (its weights copied from pinned RAM included)")
    counter = CrossDeviceBytes()

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return runtime.run(name, model, model.stages(), model.initial_state(*case.inputs))["h"]

    for _ in range(warmup):
        step()
    times = [time_step(step, on_gpu) for _ in range(steps)]
    with counter.counting():
        output = step().float().cpu()
    if on_gpu:
        peaks = [torch.cuda.max_memory_allocated(i) / GIB for i in range(len(TWO))]
        reserved: list[float | None] = [torch.cuda.max_memory_reserved(i) / GIB for i in range(len(TWO))]
    else:
        peaks = [runtime.ledger(device).peak_tracked / GIB for device in TWO]
        reserved = [None] * len(TWO)
    split_devices = len(mode.devices) > 1
    result = Result(case.name, mode.label, statistics.median(times), peaks, reserved,
                    None if mode.budget is None else mode.budget / GIB, counter.bytes / MIB,
                    copy_ms(counter.bytes, on_gpu) if split_devices else 0.0, note=note)
    for module in runtime.modules():
        runtime.unregister(module)
    return result, output


def compare(result: Result, output: torch.Tensor, reference: torch.Tensor) -> None:
    difference = output - reference
    result.max_abs_difference = difference.abs().max().item()
    result.relative_rms = (difference.pow(2).mean().sqrt() / reference.pow(2).mean().sqrt().clamp_min(1e-30)
                           ).item()


def check(results: list[Result], dtype: torch.dtype) -> None:
    """The issue's targets, as a line per row."""
    single = results[0]
    for result in results[1:]:
        if result.mode.startswith("layer split"):
            bound = LAYER_TARGET * (single.ms + result.copy_ms)
            result.checks.append(f"step {result.ms:.1f} ms vs {LAYER_TARGET:.2f} x (single {single.ms:.1f} + "
                                 f"copy {result.copy_ms:.2f}) = {bound:.1f} ms: "
                                 f"{'ok' if result.ms <= bound else 'NO'}")
            result.checks.append(f"output equal to the single GPU's: "
                                 f"{'ok' if result.max_abs_difference == 0 else 'NO'}")
        else:
            tolerance = ROW_TOLERANCE[dtype]
            within = result.relative_rms <= tolerance
            result.checks.append(f"output within relative RMS {tolerance:g} of the single GPU's "
                                 f"({result.relative_rms:.3g}): {'ok' if within else 'NO'}")
        if result.budget_gib is not None:
            fits = all(peak <= result.budget_gib for peak in result.peak_gib)
            peaks = ", ".join(f"{p:.3f}" for p in result.peak_gib)
            result.checks.append(f"peak per device {peaks} GiB within the budget {result.budget_gib:.3f} "
                                 f"GiB: {'ok' if fits else 'NO'}")


# ------------------------------------------------------------------------------------------------ output


def table(title: str, results: list[Result], on_gpu: bool) -> list[str]:
    unit, scale = ("GiB", 1.0) if on_gpu else ("ledger MiB", 1024.0)
    header = ("mode", "ms/step", f"cuda0 peak {unit}", f"cuda1 peak {unit}", "cuda0 reserved",
              "cuda1 reserved", "budget GiB", "moved MiB/step", "copy ms", "max |diff|", "rel. RMS diff")
    rows = [(r.mode, f"{r.ms:.1f}", *(f"{p * scale:.2f}" for p in r.peak_gib),
             *("-" if v is None else f"{v:.2f}" for v in r.reserved_gib),
             "-" if r.budget_gib is None else f"{r.budget_gib:.2f}", f"{r.moved_mib:.3g}", f"{r.copy_ms:.3g}",
             f"{r.max_abs_difference:.3g}", f"{r.relative_rms:.3g}") for r in results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [title, "| " + " | ".join(header) + " |", "| " + " | ".join(
        "---" if i == 0 else "---:" for i in range(len(header))) + " |"]
    lines += ["| " + " | ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                for i, (cell, w) in enumerate(zip(row, widths, strict=True))) + " |"
              for row in rows]
    for result in results:
        for line in ([result.note] if result.note else []) + result.checks:
            lines.append(f"  {result.mode}: {line}")
    return lines


def panels(title: str, results: list[Result], on_gpu: bool) -> list[Panel]:
    modes = [r.mode for r in results]
    note = "moved between the devices per step: " + ", ".join(f"{r.mode.split()[0]} {r.moved_mib:.3g} MiB"
                                                               for r in results[1:])
    steps = Panel(f"{title}: ms per step", "ms / step", categories=modes, note=note,
                  bars=[Bars("step", [r.ms for r in results])])
    unit, scale = ("GiB", 1.0) if on_gpu else ("ledger MiB", 1024.0)
    per_device = [Bars(device, [r.peak_gib[index] * scale for r in results])
                  for index, device in enumerate(TWO)]
    limits = [None if r.budget_gib is None else r.budget_gib * scale for r in results]
    peaks = Panel("peak per device", unit, categories=modes, bars=per_device, limits=limits,
                  limit_label="budget per device")
    return [steps, peaks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on two device names on the CPU")
    parser.add_argument("--models", default="flux,sdxl", help="comma-separated: flux, sdxl")
    parser.add_argument("--budget-gib", type=float, help="FLUX's budget per GPU for the split rows")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    if not chosen or any(m not in ("flux", "sdxl") for m in chosen):
        sys.exit(f"--models {args.models!r}: accepted: flux, sdxl, or both separated by a comma")
    on_gpu = not args.tiny
    if on_gpu and torch.cuda.device_count() < 2:
        sys.exit(f"bench/multi_gpu.py needs 2 CUDA GPUs (found {torch.cuda.device_count()}); "
                 f"--tiny runs on a CPU")
    draw_on = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    machine = f"{torch.cuda.get_device_name(0)} x2" if on_gpu else "two device names on the CPU"
    began = time.perf_counter()
    lines, plotted, measured = [f"bench/multi_gpu.py on {machine}, torch {torch.__version__}"], [], []
    for model in chosen:
        case = (flux_case(args.tiny, draw_on, args.budget_gib) if model == "flux"
                else sdxl_case(args.tiny, draw_on))
        results, reference = [], None
        for mode in modes(case):
            print(f"{case.name}: {mode.label} ...", flush=True)
            result, output = run_mode(case, mode, on_gpu, args.warmup, args.steps)
            reference = output if reference is None else reference
            compare(result, output, reference)
            results.append(result)
        check(results, case.dtype)
        block = table(case.title, results, on_gpu)
        print("\n".join(block), flush=True)
        lines += ["", *block]
        plotted += panels(case.title, results, on_gpu)
        measured += [asdict(r) for r in results]
        del case
        gc.collect()
    lines.append(f"({args.warmup} warm-up + {args.steps} timed steps per row; "
                 f"{time.perf_counter() - began:.0f} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"multi_gpu_{'cuda_x2' if on_gpu else 'tiny_cpu'}_{time.strftime('%Y%m%d_%H%M%S')}"
    stem.with_suffix(".log").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "warmup": args.warmup,
                                                     "steps": args.steps, "rows": measured}, indent=2))
    draw(stem.with_suffix(".png"), plotted, f"one GPU against two, {machine}")
    print(lines[-1])
    print(f"wrote {stem}.log, .json and .png")


if __name__ == "__main__":
    main()

"""Quantised FLUX.1-dev (issue 17): the transformer's step time with bf16, Q8_0 and Q4_K weights resident,
Q4_K streamed under a 4 GiB budget, and the time to quantise the bf16 weights to Q8_0 as they load.

    python3 bench/quant.py          # on a GPU: full-size FLUX-dev shapes, random weights, 1024x1024, batch 1
    python3 bench/quant.py --tiny   # a CPU smoke run of the same program on a tiny FLUX-shaped model
    python3 bench/quant.py --kernels-only   # the dequantisation kernel table alone (about a minute)

Weights are random (speed does not depend on their values): bf16 as bench/memory.py draws them; Q8_0 and Q4_K
made from those by engine.quant's quantisers on the compute device, through the loader's own path
(engine/quant/loading.py: quantise_model over a reader of the bf16 weights, then registration resident),
which is the timed "quantise on load" (the file read itself is left out: the bf16 weights are in pinned
RAM). Which weights are quantised follows stable-diffusion.cpp's rules (engine.quant.quantize's
tensor_type_rules: rows of whole blocks, embedders and norms kept). Every layer dequantises its weight to
bf16 as it runs (engine/quant/modules.py).

`--dequant triton,torch,compile` (the default) runs each quantised resident point once per way of
dequantising (engine.quant.dequant.set_dequant_backend): "triton", the one-kernel path users get on CUDA
(engine/quant/triton_dequant.py); "torch", the PyTorch code eagerly; "compile", the PyTorch code through
torch.compile. The streamed point uses the first. Before the model runs, a kernel table times one FLUX-sized
weight (3072 x 12288) of every quantised type dequantised to bf16 each way (compile: Q8_0 and Q4_K only),
checks each result bit for bit against the eager PyTorch one on the same device, and sweeps the Triton
kernels' program size and warps for the common FLUX types.

Rows as bench/flux.py (bench/memory.py's table): median step (CUDA events), peak allocated and reserved GiB,
GiB copied per step. Then issue 17's targets: Q8_0 resident <= 1.10x and Q4_K resident <= 1.25x the bf16
step, Q4_K at 4 GiB within 1.10x of Q4_K resident, quantising FLUX-dev to Q8_0 on load under 30 s. Results
go to bench/results/quant_<device>_<date>.json, .log and .png (step time and peak memory per row).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memory as bench_memory  # noqa: E402
from flux import flux_inputs  # noqa: E402
from memory import (  # noqa: E402
    GIB,
    RESULTS,
    Row,
    copy_bandwidth,
    format_table,
    random_model_weights,
    release_garbage,
    sluice_run,
    synchronize,
)
from plots import Bars, Panel, draw  # noqa: E402

from engine.devices import device_name  # noqa: E402
from engine.memory.ledger import DeviceLedger  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.models.flux import FluxConfig, FluxTransformer, flux_axes_dim, flux_dev_config  # noqa: E402
from engine.models.formats import CheckpointReader, TensorInfo  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.quant import dequant  # noqa: E402
from engine.quant.loading import WeightTypes, quantise_model  # noqa: E402
from engine.quant.modules import QuantSpec, quantisable_weights, quantise_modules  # noqa: E402
from engine.quant.types import GGML_TYPES, QUANTIZED  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402

BUDGET = 4 * GIB  # the streamed Q4_K point
TARGETS = {"Q8_0": 1.10, "Q4_K": 1.25}  # resident step over the unquantised (bf16) one
STREAMED_TARGET, QUANTISE_TARGET_S = 1.10, 30.0
BACKENDS = ("triton", "torch", "compile")  # --dequant: the ways of dequantising compared
KERNEL_SHAPE = (3072, 12288)  # the kernel table's weight: FLUX-dev's double-block MLP down projection
COMPILED_TYPES = ("Q8_0", "Q4_K")  # the kernel table compiles the model's types only (compiles are slow)
SWEPT_TYPES = ("Q8_0", "Q4_K", "Q6_K")
SWEEP = ((1024, 4), (2048, 4), (4096, 4), (8192, 8))  # (elements per program, warps)


def tiny_config() -> FluxConfig:
    """A FLUX-shaped model wide enough (256) for its matrices to take whole Q4_K blocks."""
    return FluxConfig(in_channels=64, out_channels=64, vec_in_dim=32, context_in_dim=64, hidden_size=256,
                      mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=4, axes_dim=flux_axes_dim(128),
                      guidance_embed=True)


class WeightsReader(CheckpointReader):
    """A checkpoint reader over tensors in memory (the bf16 weights as a file would give them)."""

    format = "memory"

    def __init__(self, tensors: dict[str, torch.Tensor]):
        infos = {k: TensorInfo(tuple(t.shape), str(t.dtype), t.dtype, t.numel() * t.element_size())
                 for k, t in tensors.items()}
        super().__init__(Path("<memory>"), infos, {})
        self.tensors = tensors

    def _load(self, key: str, info: TensorInfo) -> torch.Tensor:
        return self.tensors[key]

    def close(self) -> None:
        self.tensors = {}


def to_home(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Where bench/memory.py keeps source weights: pinned RAM when computing on CUDA."""
    if device.type != "cuda":
        return tensor.cpu()
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


def quantise_on_load(build: Callable[[], FluxTransformer], bf16: dict[str, torch.Tensor],
                     device: torch.device, qtype: str,
                     ) -> tuple[float, dict[str, QuantSpec], dict[str, torch.Tensor]]:
    """(seconds to build, quantise to `qtype` on the device and register resident, the specs, the quantised
    weights read back to where source weights live): the loader's own path."""
    synchronize(device)
    release_garbage(device)
    began = time.perf_counter()
    model = build()
    reader = quantise_model(model, WeightsReader(bf16), lambda name: name, WeightTypes(qtype), device)
    ledger = DeviceLedger(device_name(device), 1 << 50)  # no budget: every weight rests on the device
    runtime = MemoryRuntime(MemorySettings(), bus=EventBus(), ledgers={ledger.device_name: ledger})
    name = runtime.register("diffusion", model, "device", device_name(device), reader.get)
    synchronize(device)
    seconds = time.perf_counter() - began
    specs = {n: QuantSpec(layer.qtype, layer.weight_shape) for n, layer in quantisable_weights(model).items()
             if hasattr(layer, "qtype")}
    state = dict(model.named_parameters())
    weights = {n: to_home(state[n].detach(), device) if n in specs else t for n, t in bf16.items()}
    runtime.unregister(name)
    del model, runtime, state
    release_garbage(device)
    return seconds, specs, weights


def same_values(ours: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal bits, except that a NaN need only be a NaN where `expected` has one (its payload is the
    hardware's)."""
    nan = expected.isnan()
    bits = {torch.float32: torch.int32}.get(expected.dtype, torch.int16)
    return bool(torch.equal(ours.isnan(), nan)
                and not ((ours.view(bits) != expected.view(bits)) & ~nan).any())


def call_ms(device: torch.device, call: Callable[[], object], calls: int = 20) -> float:
    """Mean milliseconds of `call` over `calls` back-to-back calls (after two warm-up calls)."""
    call()
    call()
    synchronize(device)
    began = time.perf_counter()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    for _ in range(calls):
        call()
    return (time.perf_counter() - began) * 1e3 / calls


def kernel_table(device: torch.device, dtype: torch.dtype, backends: list[str], tiny: bool) -> list[dict]:
    """One weight of every quantised type dequantised each way: exactness against eager PyTorch on this
    device, time, and bandwidth (bytes read and written over the time); then the Triton sweep."""
    shape = (64, 512) if tiny else KERNEL_SHAPE
    numel = shape[0] * shape[1]
    generator = torch.Generator(device).manual_seed(0)
    rows = []
    print(f"\ndequantising one {shape[0]}x{shape[1]} weight to {str(dtype).removeprefix('torch.')}: "
          "exact = bit-identical to eager PyTorch here (NaN as NaN)", flush=True)
    print("| type | way | exact | us | GB/s |\n| --- | --- | --- | ---: | ---: |", flush=True)
    for qtype in QUANTIZED:
        t = GGML_TYPES[qtype]
        raw = torch.randint(0, 256, (numel // t.block_size * t.type_size,), dtype=torch.uint8, device=device,
                            generator=generator)  # random bytes: every scale, inf and NaN included
        moved = raw.numel() + numel * dtype.itemsize
        dequant.set_dequant_backend("torch")
        expected = dequant.dequantize(raw, qtype, shape, dtype)
        for backend in backends:
            if backend == "compile" and qtype not in COMPILED_TYPES:
                continue
            dequant.set_dequant_backend(backend)
            try:
                exact = same_values(dequant.dequantize(raw, qtype, shape, dtype), expected)
                ms = call_ms(device, lambda: dequant.dequantize(raw, qtype, shape, dtype))  # noqa: B023
            except Exception as error:  # a way that fails here is reported, not fatal
                failure = f"{type(error).__name__}: {error}"
                print(f"| {qtype} | {backend} | failed: {failure} | - | - |", flush=True)
                rows.append({"type": qtype, "way": backend, "error": failure})
                continue
            finally:
                dequant.set_dequant_backend("auto")
            rows.append({"type": qtype, "way": backend, "exact": exact, "us": ms * 1e3,
                         "gb_per_s": moved / ms / 1e6})
            print(f"| {qtype} | {backend} | {'yes' if exact else 'NO'} | {ms * 1e3:.1f} "
                  f"| {moved / ms / 1e6:.0f} |", flush=True)
    if "triton" in backends and device.type == "cuda":
        rows += triton_sweep(device, dtype, shape, generator)
    return rows


def triton_sweep(device: torch.device, dtype: torch.dtype, shape: tuple[int, int],
                 generator: torch.Generator) -> list[dict]:
    """The Triton kernels' time per (elements per program, warps) for the common FLUX types."""
    from engine.quant.triton_dequant import ELEMENTS_PER_PROGRAM, NUM_WARPS, dequantize_triton

    numel = shape[0] * shape[1]
    rows = []
    print(f"\nTriton sweep (default {ELEMENTS_PER_PROGRAM} elements per program, {NUM_WARPS} warps): us "
          "per weight\n| type | " + " | ".join(f"{e}/{w}" for e, w in SWEEP) + " |\n| --- |"
          + " ---: |" * len(SWEEP), flush=True)
    for qtype in SWEPT_TYPES:
        t = GGML_TYPES[qtype]
        raw = torch.randint(0, 256, (numel // t.block_size * t.type_size,), dtype=torch.uint8, device=device,
                            generator=generator)
        cells = []
        for elements, warps in SWEEP:
            ms = call_ms(device, lambda: dequantize_triton(raw, qtype, shape, dtype, elements, warps))  # noqa: B023
            rows.append({"type": qtype, "way": f"triton {elements}/{warps}", "us": ms * 1e3,
                         "gb_per_s": (raw.numel() + numel * dtype.itemsize) / ms / 1e6})
            cells.append(f"{ms * 1e3:.1f}")
        print(f"| {qtype} | " + " | ".join(cells) + " |", flush=True)
    return rows


def quantised_build(config: FluxConfig, dtype: torch.dtype, specs: dict[str, QuantSpec],
                    ) -> Callable[[], FluxTransformer]:
    def build() -> FluxTransformer:
        model = FluxTransformer(config, dtype=dtype, device="meta")
        quantise_modules(model, specs)
        return model

    return build


def weight_gib(weights: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in weights.values()) / GIB


def run_point(rows: list[Row], name: str, mode: str, build: Callable[[], FluxTransformer],
              weights: dict[str, torch.Tensor], inputs: tuple, device: torch.device, home: str,
              budget: int | None, args: argparse.Namespace) -> Row:
    try:
        ms, peak, reserved, copied, segments, *_ = sluice_run(build, weights, inputs, device, home, budget,
                                                              args.warmup, args.steps)
        row = Row(name, mode, None if budget is None else budget / GIB, ms, peak, copied, segments,
                  reserved_gib=reserved)
    except bench_memory.BudgetExceeded as error:
        print(f"{name}: {mode}: infeasible ({error})", file=sys.stderr)
        row = Row(name, mode, None if budget is None else budget / GIB, None, None, 0.0, None)
    except Exception as error:  # a way of dequantising that fails here (a compile error): reported, not fatal
        print(f"{name}: {mode}: failed ({type(error).__name__}: {error})", file=sys.stderr)
        release_garbage(device)
        row = Row(name, f"{mode}: failed", None if budget is None else budget / GIB, None, None, 0.0, None)
    rows.append(row)
    print(format_table([row], header=False), flush=True)
    return row


def ratio(a: Row, b: Row) -> float | None:
    return None if a.step_ms is None or b.step_ms is None else a.step_ms / b.step_ms


def check_targets(rows: dict[str, Row], backends: list[str], quantise_s: float, tiny: bool) -> list[str]:
    lines = []
    for qtype, target in TARGETS.items():
        for backend in backends:
            r = ratio(rows[f"{qtype} {backend}"], rows["bf16"])
            shown = "-" if r is None else f"{r:.2f}x"
            lines.append(f"{qtype} resident ({backend}) / unquantised resident: {shown} "
                         f"(target <= {target:.2f}x)")
    r = ratio(rows["Q4_K streamed"], rows[f"Q4_K {backends[0]}"])
    lines.append(f"Q4_K at {BUDGET / GIB:.0f} GiB / Q4_K resident ({backends[0]}): "
                 f"{'-' if r is None else f'{r:.2f}x'} "
                 f"(target <= {STREAMED_TARGET:.2f}x)")
    lines.append(f"quantise to Q8_0 on load: {quantise_s:.1f} s (target < {QUANTISE_TARGET_S:.0f} s"
                 f"{', full size only' if tiny else ''})")
    return lines


def kernel_lines(kernels: list[dict]) -> list[str]:
    """The kernel table as text lines for the log."""
    return [f"dequant {k['type']} {k['way']}: " + (k["error"] if "error" in k else
            f"{k['us']:.1f} us, {k['gb_per_s']:.0f} GB/s" + ("" if "exact" not in k else
                                                            f", exact {'yes' if k['exact'] else 'NO'}"))
            for k in kernels]


def plot(rows: list[Row], path: Path, title: str) -> Path:
    """The rows' step time, and their peak allocated and reserved memory against the streamed point's
    budget."""
    modes = [r.mode for r in rows]
    failed = [r.mode for r in rows if r.step_ms is None]
    note = f"no step (infeasible or failed): {', '.join(failed)}" if failed else ""
    steps = Panel("ms per step", "ms / step", categories=modes, note=note,
                  bars=[Bars("step", [r.step_ms for r in rows])])
    peaks = Panel("peak memory", "GiB", categories=modes, limits=[r.budget_gib for r in rows],
                  limit_label="budget", bars=[Bars("peak allocated", [r.peak_gib for r in rows]),
                                              Bars("peak reserved", [r.reserved_gib for r in rows])])
    return draw(path, [steps, peaks], title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny FLUX-shaped model in float32 (CPU smoke)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per point (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--side", type=int, default=128, help="latent side (128 = 1024x1024 pixels)")
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (diffusers' dev default)")
    parser.add_argument("--cuda-graphs", default="auto", choices=("on", "off", "auto"))
    parser.add_argument("--dequant", default=",".join(BACKENDS),
                        help="ways of dequantising to compare, comma-separated, of " + ", ".join(BACKENDS)
                        + " (the first also runs the streamed point; triton needs CUDA)")
    parser.add_argument("--kernels-only", action="store_true", help="the dequantisation kernel table alone")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    backends = [b.strip() for b in args.dequant.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        parser.error(f"--dequant {args.dequant!r}: accepted ways are {', '.join(BACKENDS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bench_memory.GRAPHS[0] = args.cuda_graphs
    tiny = args.tiny or device.type == "cpu"
    if device.type != "cuda" and "triton" in backends:
        print("note: the Triton kernels need CUDA; --dequant triton is left out here", file=sys.stderr)
        backends = [b for b in backends if b != "triton"] or ["torch"]
    if tiny:
        torch.set_num_threads(1)
    config = tiny_config() if tiny else flux_dev_config()
    side, tokens = (16, 32) if tiny else (args.side, args.text_tokens)
    dtype = torch.float32 if tiny else torch.bfloat16
    bandwidth = copy_bandwidth(device)
    name = "FLUX-tiny" if tiny else f"FLUX.1-dev {side * 8}x{side * 8}"
    print(f"device {device}, dtype {dtype}, latent {side}x{side}, {tokens} text tokens, copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s", flush=True)
    kernels = kernel_table(device, dtype, backends, tiny)
    if args.kernels_only:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"quant_kernels_{device.type}_{time.strftime('%Y%m%d_%H%M%S')}.json"
        path.write_text(json.dumps({"device": str(device), "dtype": str(dtype), "kernels": kernels},
                                   indent=2))
        print(f"wrote {path}")
        return 0
    inputs = flux_inputs(config, side, tokens, dtype, device)

    def build() -> FluxTransformer:
        return FluxTransformer(config, dtype=dtype, device="meta")

    bf16 = random_model_weights(build(), dtype, device)
    print(f"random {dtype} weights: {weight_gib(bf16):.2f} GiB", flush=True)
    rows: list[Row] = []
    points: dict[str, Row] = {}
    print(format_table([]), flush=True)
    unquantised = f"{str(dtype).removeprefix('torch.')} resident"
    points["bf16"] = run_point(rows, name, unquantised, build, bf16, inputs, device, "device", None, args)
    quantise_s, q8_specs, q8 = quantise_on_load(build, bf16, device, "Q8_0")
    print(f"quantised {len(q8_specs)} weights to Q8_0 on load in {quantise_s:.2f} s "
          f"({weight_gib(q8):.2f} GiB)", flush=True)
    q8_build = quantised_build(config, dtype, q8_specs)
    for backend in backends:
        dequant.set_dequant_backend(backend)
        mode = f"Q8_0 resident, {backend} ({weight_gib(q8):.2f} GiB)"
        points[f"Q8_0 {backend}"] = run_point(rows, name, mode, q8_build, q8, inputs, device, "device", None,
                                              args)
    dequant.set_dequant_backend("auto")
    del q8
    q4_seconds, q4_specs, q4 = quantise_on_load(build, bf16, device, "Q4_K")
    print(f"quantised {len(q4_specs)} weights to Q4_K on load in {q4_seconds:.2f} s "
          f"({weight_gib(q4):.2f} GiB)", flush=True)
    del bf16
    gc.collect()
    q4_build = quantised_build(config, dtype, q4_specs)
    for backend in backends:
        dequant.set_dequant_backend(backend)
        mode = f"Q4_K resident, {backend} ({weight_gib(q4):.2f} GiB)"
        points[f"Q4_K {backend}"] = run_point(rows, name, mode, q4_build, q4, inputs, device, "device", None,
                                              args)
    budget = BUDGET if not tiny else int(weight_gib(q4) * GIB * 0.6)
    streamed = f"Q4_K pinned RAM, {backends[0]}, budget {budget / GIB:.3f} GiB"
    dequant.set_dequant_backend(backends[0])
    points["Q4_K streamed"] = run_point(rows, name, streamed, q4_build, q4, inputs, device, "cpu", budget,
                                        args)
    dequant.set_dequant_backend("auto")
    synchronize(device)
    print(format_table(rows))
    targets = check_targets(points, backends, quantise_s, tiny)
    print("\n".join(targets))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"quant_{'tiny_' if tiny else ''}{device.type}_{time.strftime('%Y%m%d_%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"device": str(device), "dtype": str(dtype), "copy_bandwidth_bytes_per_s": bandwidth,
         "quantise_q8_0_on_load_s": quantise_s, "quantise_q4_k_on_load_s": q4_seconds,
         "dequant_ways": backends, "kernels": kernels, "rows": [asdict(r) for r in rows], "targets": targets},
        indent=2))
    stem.with_suffix(".log").write_text(format_table(rows) + "\n" + "\n".join(targets) + "\n"
                                        + "".join(f"{k}\n" for k in kernel_lines(kernels)))
    plot(rows, stem.with_suffix(".png"), f"{name} on {device}: quantised weights")
    print(f"wrote {stem}.json, .log and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

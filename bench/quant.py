"""Quantised FLUX.1-dev (issue 17): the transformer's step time with bf16, Q8_0 and Q4_K weights resident,
Q4_K streamed under a 4 GiB budget, and the time to quantise the bf16 weights to Q8_0 as they load.

    python3 bench/quant.py          # on a GPU: full-size FLUX-dev shapes, random weights, 1024x1024, batch 1
    python3 bench/quant.py --tiny   # a CPU smoke run of the same program on a tiny FLUX-shaped model

Weights are random (speed does not depend on their values): bf16 as bench/memory.py draws them; Q8_0 made
from those by engine.quant's quantiser on the compute device, through the loader's own path
(engine/quant/loading.py: quantise_model over a reader of the bf16 weights, then registration resident),
which is the timed "quantise on load" (the file read itself is left out: the bf16 weights are in pinned
RAM); Q4_K as random valid blocks (small fp16 scales, random 6-bit sub-scales and 4-bit values), since
engine.quant writes no K type. Which weights are quantised follows stable-diffusion.cpp's rules
(engine.quant.quantize.tensor_type_rules; Q4_K also needs rows of whole 256-element blocks). Every layer
dequantises its weight to bf16 as it runs (engine/quant/modules.py).

Rows as bench/flux.py (bench/memory.py's table): median step (CUDA events), peak allocated and reserved GiB,
GiB copied per step. Then issue 17's targets: Q8_0 resident <= 1.10x and Q4_K resident <= 1.25x the bf16
step, Q4_K at 4 GiB within 1.10x of Q4_K resident, quantising FLUX-dev to Q8_0 on load under 30 s. Results
go to bench/results/quant_<device>_<date>.json and .log.
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

from engine.devices import device_name  # noqa: E402
from engine.memory.ledger import DeviceLedger  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.models.flux import FluxConfig, FluxTransformer, flux_axes_dim, flux_dev_config  # noqa: E402
from engine.models.formats import CheckpointReader, TensorInfo  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.quant.loading import WeightTypes, quantise_model  # noqa: E402
from engine.quant.modules import QuantSpec, quantisable_weights, quantise_modules, raw_shape  # noqa: E402
from engine.quant.quantize import tensor_type_rules  # noqa: E402
from engine.quant.types import GGML_TYPES  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402

BUDGET = 4 * GIB  # the streamed Q4_K point
TARGETS = {"Q8_0": 1.10, "Q4_K": 1.25}  # resident step over the unquantised (bf16) one
STREAMED_TARGET, QUANTISE_TARGET_S = 1.10, 30.0


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


def quantised_names(model: torch.nn.Module, qtype: str) -> dict[str, QuantSpec]:
    """The weights stable-diffusion.cpp's rules quantise to `qtype` (rows of whole blocks of it)."""
    eligible = tensor_type_rules("Q8_0")
    block = GGML_TYPES[qtype].block_size
    shapes = {name: tuple(layer.weight.shape) for name, layer in quantisable_weights(model).items()}
    return {name: QuantSpec(qtype, shape) for name, shape in shapes.items()
            if eligible(name, shape) and shape[-1] % block == 0}


def random_q4_k(spec: QuantSpec, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Random valid Q4_K blocks of `spec` whose values are of order 1/sqrt(fan in)."""
    rows, row_bytes = raw_shape("Q4_K", spec.shape)
    raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, device=device, generator=generator)
    blocks = raw.view(-1, 144)
    d = 1.0 / (spec.shape[-1] ** 0.5 * 31 * 7.5)  # scale * 6-bit sub-scale * 4-bit value ~ 1/sqrt(fan in)
    blocks[:, 0:2].view(torch.float16).fill_(d)
    blocks[:, 2:4].view(torch.float16).fill_(d * 7.5)  # min: centres the values on zero
    return raw


def to_home(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Where bench/memory.py keeps source weights: pinned RAM when computing on CUDA."""
    if device.type != "cuda":
        return tensor.cpu()
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


def q4_k_weights(build: Callable[[], FluxTransformer], bf16: dict[str, torch.Tensor], device: torch.device,
                 ) -> tuple[dict[str, QuantSpec], dict[str, torch.Tensor]]:
    specs = quantised_names(build(), "Q4_K")
    generator = torch.Generator(device).manual_seed(0)
    weights = {name: to_home(random_q4_k(specs[name], device, generator), device) if name in specs else tensor
               for name, tensor in bf16.items()}
    return specs, weights


def quantise_on_load(build: Callable[[], FluxTransformer], bf16: dict[str, torch.Tensor],
                     device: torch.device) -> tuple[float, dict[str, QuantSpec], dict[str, torch.Tensor]]:
    """(seconds to build, quantise to Q8_0 on the device and register resident, the specs, the Q8_0 weights
    read back to the home weights live in): the loader's own path."""
    synchronize(device)
    release_garbage(device)
    began = time.perf_counter()
    model = build()
    reader = quantise_model(model, WeightsReader(bf16), lambda name: name, WeightTypes("Q8_0"), device)
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
    rows.append(row)
    print(format_table([row], header=False), flush=True)
    return row


def ratio(a: Row, b: Row) -> float | None:
    return None if a.step_ms is None or b.step_ms is None else a.step_ms / b.step_ms


def check_targets(rows: dict[str, Row], quantise_s: float, tiny: bool) -> list[str]:
    lines = []
    for qtype, target in TARGETS.items():
        r = ratio(rows[qtype], rows["bf16"])
        shown = "-" if r is None else f"{r:.2f}x"
        lines.append(f"{qtype} resident / unquantised resident: {shown} (target <= {target:.2f}x)")
    r = ratio(rows["Q4_K streamed"], rows["Q4_K"])
    lines.append(f"Q4_K at {BUDGET / GIB:.0f} GiB / Q4_K resident: {'-' if r is None else f'{r:.2f}x'} "
                 f"(target <= {STREAMED_TARGET:.2f}x)")
    lines.append(f"quantise to Q8_0 on load: {quantise_s:.1f} s (target < {QUANTISE_TARGET_S:.0f} s"
                 f"{', full size only' if tiny else ''})")
    return lines


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
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bench_memory.GRAPHS[0] = args.cuda_graphs
    tiny = args.tiny or device.type == "cpu"
    if tiny:
        torch.set_num_threads(1)
    config = tiny_config() if tiny else flux_dev_config()
    side, tokens = (16, 32) if tiny else (args.side, args.text_tokens)
    dtype = torch.float32 if tiny else torch.bfloat16
    bandwidth = copy_bandwidth(device)
    name = "FLUX-tiny" if tiny else f"FLUX.1-dev {side * 8}x{side * 8}"
    print(f"device {device}, dtype {dtype}, latent {side}x{side}, {tokens} text tokens, copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s", flush=True)
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
    quantise_s, q8_specs, q8 = quantise_on_load(build, bf16, device)
    print(f"quantised {len(q8_specs)} weights to Q8_0 on load in {quantise_s:.2f} s "
          f"({weight_gib(q8):.2f} GiB)", flush=True)
    q8_build = quantised_build(config, dtype, q8_specs)
    points["Q8_0"] = run_point(rows, name, f"Q8_0 resident ({weight_gib(q8):.2f} GiB)", q8_build, q8, inputs,
                               device, "device", None, args)
    del q8
    q4_specs, q4 = q4_k_weights(build, bf16, device)
    del bf16
    gc.collect()
    q4_build = quantised_build(config, dtype, q4_specs)
    points["Q4_K"] = run_point(rows, name, f"Q4_K resident ({weight_gib(q4):.2f} GiB)", q4_build, q4, inputs,
                               device, "device", None, args)
    budget = BUDGET if not tiny else int(weight_gib(q4) * GIB * 0.6)
    streamed = f"Q4_K pinned RAM, budget {budget / GIB:.3f} GiB"
    points["Q4_K streamed"] = run_point(rows, name, streamed, q4_build, q4, inputs, device, "cpu", budget,
                                        args)
    synchronize(device)
    print(format_table(rows))
    targets = check_targets(points, quantise_s, tiny)
    print("\n".join(targets))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"quant_{'tiny_' if tiny else ''}{device.type}_{time.strftime('%Y%m%d_%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"device": str(device), "dtype": str(dtype), "copy_bandwidth_bytes_per_s": bandwidth,
         "quantise_q8_0_on_load_s": quantise_s, "rows": [asdict(r) for r in rows], "targets": targets},
        indent=2))
    stem.with_suffix(".log").write_text(format_table(rows) + "\n" + "\n".join(targets) + "\n")
    print(f"wrote {stem}.json and .log")
    return 0


if __name__ == "__main__":
    sys.exit(main())

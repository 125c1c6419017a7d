"""Step time against peak memory of the memory runtime over a sweep of budgets, beside diffusers' offloading.

    .venv/bin/python bench/memory.py                 # on a GPU: SD1.5 512x512 and SDXL 1024x1024 UNets, fp16
    .venv/bin/python bench/memory.py --tiny          # a few seconds on a CPU: tiny UNets, float32

For each model (random weights, batch 2 = cond + uncond): our runtime with every weight resident, then with
weights in pinned RAM under budgets from the smallest feasible (the largest stage plus its workspace) to
everything resident; in the same run diffusers' UNet resident and with `enable_group_offload` (block_level
and leaf_level, use_stream=True) when diffusers is importable and the device is CUDA. Each row: median step
time (CUDA events) of --steps after --warmup, peak `torch.cuda.max_memory_allocated` (on a CPU the ledger's
tracked peak instead), peak `max_memory_reserved` (both above what the process held before the point, such
as cuBLAS's workspace), and bytes copied per step. The physical line is
max(resident step time, bytes that cannot stay resident / measured pinned copy bandwidth), where the bytes
that cannot stay resident are all weights + workspace - budget (ANCHORS.md "What this says"); "/ physical"
is the step time over it. The floor is the least step time any plan within the budget can reach at that
bandwidth, from the resident run's per-stage times and workspace peaks (engine/memory/stream_model.py,
floor_seconds): above the physical line where the budget cannot hold the bytes that a UNet's heavy middle
must have prefetched during its long full-resolution stages; "/ floor" is the step time over it. Writes a
table, a CSV, a JSON and a PNG (bench/plots.py: matplotlib if available, else Pillow) to bench/results/.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plots import Line, Panel, draw  # noqa: E402

from engine.devices import GIB, device_name  # noqa: E402
from engine.memory import profile_cache, stream_model  # noqa: E402
from engine.memory.copy_flags import CopyFlags  # noqa: E402
from engine.memory.ledger import BudgetExceeded, DeviceLedger, live_free_memory  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.memory.segment_plan import SegmentPlan  # noqa: E402
from engine.memory.segments import StageProfile  # noqa: E402
from engine.memory.stream_model import floor_seconds  # noqa: E402
from engine.models.detect import UNetConfig  # noqa: E402
from engine.models.unet import UNetModel, sd15_unet_config, sdxl_unet_config  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# this benchmark and those that import it measure every probe and stage profile themselves
profile_cache.set_default_cache(profile_cache.ProfileCache(None))
GRAPHS = ["auto"]  # --cuda-graphs of the runs (a list so main() can set it)
MIB = 1024**2


@dataclass
class Row:
    model: str
    mode: str  # "sluice resident", "sluice budget 3.20 GiB", "diffusers resident", ...
    budget_gib: float | None
    step_ms: float | None  # None: infeasible
    peak_gib: float | None
    copied_gib_per_step: float
    segments: int | None
    physical_ms: float | None = None  # max(resident step time, bytes that cannot stay resident / bandwidth)
    reserved_gib: float | None = None  # peak torch.cuda.max_memory_reserved (the caching allocator's pool)
    floor_ms: float | None = None  # the least any plan within the budget takes (stream_model.floor_seconds)

    @property
    def over_physical(self) -> float | None:
        return None if self.step_ms is None or not self.physical_ms else self.step_ms / self.physical_ms

    @property
    def over_floor(self) -> float | None:
        return None if self.step_ms is None or not self.floor_ms else self.step_ms / self.floor_ms


def tiny_config(adm: int | None) -> UNetConfig:
    return UNetConfig(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
                      attention_levels=(0, 1), transformer_depth=(1, 1), transformer_depth_middle=1,
                      num_heads=-1, num_head_channels=16, context_dim=64,
                      use_linear_in_transformer=adm is not None, adm_in_channels=adm,
                      num_classes="sequential" if adm else None, prediction="eps",
                      family="sdxl" if adm else "sd15")


def model_cases(tiny: bool) -> list[tuple[str, UNetConfig, int]]:
    """(name, config, latent side) per benchmarked model."""
    if tiny:
        return [("SD1.5-tiny", tiny_config(None), 16), ("SDXL-tiny", tiny_config(128), 16)]
    return [("SD1.5 UNet 512x512", sd15_unet_config(), 64), ("SDXL UNet 1024x1024", sdxl_unet_config(), 128)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(device: torch.device, step: Callable[[], object]) -> float:
    """Milliseconds of one step: CUDA events on CUDA, the wall clock otherwise."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    began = time.perf_counter()
    step()
    return (time.perf_counter() - began) * 1e3


def measure(device: torch.device, step: Callable[[], object], warmup: int, steps: int, peak_over: int = 0
            ) -> tuple[float, float, float]:
    """(median step ms, peak GiB of live tensors, peak GiB reserved by the allocator) after `warmup` steps.

    The peaks cover the last `peak_over` warm-up steps too: a CUDA graph allocates its call's memory while
    it is captured, and its replays allocate nothing that `max_memory_allocated` would see.
    """
    for _ in range(warmup - peak_over):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(peak_over):
        step()
    times = [time_step(device, step) for _ in range(steps)]
    if device.type != "cuda":
        return statistics.median(times), float("nan"), float("nan")
    peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return statistics.median(times), peak / GIB, reserved / GIB


def random_weights(config: UNetConfig, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Random weights in RAM (pinned once when the compute device is CUDA): matrices and kernels with
    standard deviation 1/sqrt(fan_in), norm scales 1 and biases 0, so activations stay of order one (tiny
    activations would run on denormal floats, which are very slow on a CPU)."""
    return random_model_weights(UNetModel(config, dtype=dtype, device="meta"), dtype, device)


def random_model_weights(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                         ) -> dict[str, torch.Tensor]:
    """`random_weights` for any model built on the meta device."""
    generator = torch.Generator(device).manual_seed(0)  # drawn on the GPU when there is one: seconds
    weights = {}
    for name, parameter in model.named_parameters():
        if parameter.ndim >= 2:
            fan_in = parameter[0].numel()
            drawn = torch.randn(parameter.shape, generator=generator, device=device)
            tensor = (drawn / fan_in**0.5).to(parameter.dtype)  # the model's own (fp8 linears: fp8)
        else:
            tensor = torch.full(parameter.shape, 1.0 if name.endswith(("weight", "scale")) else 0.0,
                                dtype=parameter.dtype)
        if device.type == "cuda":
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            tensor = pinned.copy_(tensor)
        weights[name] = tensor
    return weights


def unet_inputs(config: UNetConfig, side: int, dtype: torch.dtype, device: torch.device) -> tuple:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, side, side, generator=generator)
    context = torch.randn(2, 77, config.context_dim, generator=generator)
    y = torch.randn(2, config.adm_in_channels, generator=generator) if config.adm_in_channels else None
    timesteps = torch.tensor([500.0, 500.0])
    return tuple(None if t is None else t.to(device, dtype if t.is_floating_point() else t.dtype)
                 for t in (x, timesteps, context, y))


def registered_unet(config: UNetConfig, weights: dict, device: torch.device, home: str, budget: int | None,
                    free_memory_fn: Callable[[], int] | None = None, graphs: str = "auto"
                    ) -> tuple[MemoryRuntime, str, UNetModel, DeviceLedger, EventBus]:
    """Our runtime with one ledger of `budget` bytes on `device` (None: no budget), and the UNet of `config`
    registered in it with `weights` at `home`: (runtime, module name, model, ledger, bus)."""
    unet = UNetModel(config, dtype=next(iter(weights.values())).dtype, device="meta")
    return registered_model(unet, weights, device, home, budget, free_memory_fn, graphs)


def registered_model(model: torch.nn.Module, weights: dict, device: torch.device, home: str,
                     budget: int | None, free_memory_fn: Callable[[],
                                                                  int] | None = None, graphs: str = "auto",
                     ) -> tuple[MemoryRuntime, str, torch.nn.Module, DeviceLedger, EventBus]:
    """`registered_unet` for any staged model built on the meta device."""
    bus = EventBus()
    CopyFlags.available(device, wait=True)  # measured calls poll from the first capture (no re-plan after)
    ledger = DeviceLedger(device_name(device), budget, free_memory_fn=free_memory_fn, bus=bus)
    runtime = MemoryRuntime(MemorySettings(cuda_graphs=graphs), bus=bus, ledgers={ledger.device_name: ledger})
    name = runtime.register("diffusion", model, home, ledger.device_name, weights.__getitem__)
    return runtime, name, model, ledger, bus


def sluice_run(config: UNetConfig | Callable[[], torch.nn.Module], weights: dict, inputs: tuple,
               device: torch.device, home: str, budget: int | None, warmup: int, steps: int
               ) -> tuple[float, float, float, float, int, int, StageProfile | None]:
    """(ms, peak GiB, reserved GiB, GiB copied per step, segments, workspace bytes, per-stage times and
    workspace peaks) of our runtime with `home` weights under `budget`; `config` is a UNet's, or a function
    that builds any staged model on the meta device."""
    before = release_garbage(device)
    free = live_free_memory(_compute(device)) if device.type == "cuda" else None
    model = (config() if callable(config)
             else UNetModel(config, dtype=next(iter(weights.values())).dtype, device="meta"))
    runtime, name, unet, ledger, bus = registered_model(
        model, weights, device, home, budget if budget is not None else (None if free else 1 << 50), free,
        GRAPHS[0])
    copied = [0]
    counting = [False]

    def count(event: object) -> None:
        if counting[0] and event.kind == "transfer" and event.get("direction") == "h2d":
            copied[0] += event.get("bytes")

    bus.subscribe(count)

    def step() -> object:
        return runtime.run(name, unet, unet.stages(), unet.initial_state(*inputs))["h"]

    try:
        ms, peak, reserved = measure(device, step, warmup, steps, peak_over=1)  # the last warm-up captures
        counting[0] = True
        step()  # one more, counted: the bytes copied per step
        synchronize(device)
        plan = runtime.snapshot()["modules"][name]["plan"]
        segments = len(plan["segments"])
        streamed = [s for s in plan["segments"] if s["streamed"]]
        profile = runtime.stage_profile(name)
        print(f"  plan: workspace {plan['workspace_bytes'] / MIB:.1f} MiB, "
              f"ring {plan['ring_bytes'] / MIB:.1f} MiB, "
              f"{len(streamed)} of {segments} segments streamed "
              f"({sum(s['weight_bytes'] for s in streamed) / MIB:.1f} MiB)"
              + modelled(runtime.segment_plan(name), profile, device), flush=True)
        if device.type != "cuda":
            peak = ledger.peak_tracked / GIB
        else:
            peak, reserved = peak - before / GIB, reserved - before / GIB
        return ms, peak, reserved, copied[0] / GIB, segments, plan["workspace_bytes"], profile
    finally:
        runtime.unregister(name)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def modelled(plan: SegmentPlan | None, profile: StageProfile | None, device: torch.device) -> str:
    """", modelled X ms": the step the planner's model predicted from its own inputs (the measured stage
    times, the copy rate and per-segment cost of a captured call), to set beside the measured one; "" off
    CUDA or without a profile."""
    bandwidth, gap = stream_model.call_rates(device, GRAPHS[0] != "off")
    if plan is None or profile is None or not bandwidth or GRAPHS[0] == "off":
        return ""
    seconds = stream_model.step_seconds(plan, profile.seconds, bandwidth, gap)
    return f", modelled {seconds * 1e3:.1f} ms"


def release_garbage(device: torch.device) -> int:
    """Free what earlier points left in reference cycles (a runtime and its ledger callbacks, a diffusers
    model and its hooks); returns the bytes still allocated (cuBLAS's workspace and the like), which each
    point's peak is reported above, so that it counts that point's own allocations only."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated(device)
    if left > 64 * MIB:
        print(f"note: {left / MIB:.1f} MiB still allocated before this point", file=sys.stderr)
    return left


def _compute(device: torch.device) -> object:
    from engine.devices import resolve_device

    return resolve_device(device_name(device))


def stage_bytes(config: UNetConfig, dtype: torch.dtype) -> tuple[list[int], int]:
    """(each stage's weight bytes, all weight bytes) of the UNet."""
    unet = UNetModel(config, dtype=dtype, device="meta")
    sizes = [stage.parameter_bytes() for stage in unet.stages()]
    return sizes, sum(p.numel() * p.element_size() for p in unet.parameters())


def floor_ms(sizes: list[int], profile: StageProfile | None, resident_ms: float, budget: int,
             bandwidth: float) -> float | None:
    """The least step time any plan can reach within `budget` (stream_model.floor_seconds), from the stages'
    weight bytes and the resident run's per-stage times (scaled to its step time: the stages were timed
    eagerly) and workspace peaks; None without a profile."""
    if profile is None or sum(profile.seconds) <= 0:
        return None
    scale = resident_ms / 1e3 / sum(profile.seconds)
    seconds = [s * scale for s in profile.seconds]
    return floor_seconds(seconds, sizes, profile.workspace, budget, bandwidth) * 1e3


def copy_bandwidth(device: torch.device, nbytes: int = 256 * MIB) -> float:
    """Bytes per second of pinned host-to-device copies, the best of 5 (on a CPU, of a RAM clone, as a
    stand-in: the median of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if device.type != "cuda":
        times = []
        for _ in range(5):
            began = time.perf_counter()
            host.clone()
            times.append(time.perf_counter() - began)
        return nbytes / statistics.median(times)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return stream_model.pinned_copy_rate(host.pin_memory(), target, repeats=5)


def diffusers_rows(name: str, config: UNetConfig, side: int, dtype: torch.dtype, device: torch.device,
                   warmup: int, steps: int) -> list[Row]:
    """diffusers' UNet resident and, on CUDA, with group offloading (block and leaf level, streamed)."""
    try:
        from diffusers import UNet2DConditionModel
    except ImportError:
        print("diffusers is not importable: its rows are left out", file=sys.stderr)
        return []
    diffusers_config = _diffusers_config(config)
    x, timesteps, context, y = unet_inputs(config, side, dtype, device)
    added = None
    if config.adm_in_channels:
        added = {"text_embeds": y[:, :config.adm_in_channels - 6 * _time_embed_dim(config)],
                 "time_ids": torch.zeros(2, 6, device=device, dtype=dtype)}
    modes = [("resident", None)]
    if device.type == "cuda":
        modes += [("group offload block_level stream", "block_level"),
                  ("group offload leaf_level stream", "leaf_level")]
    rows = []
    for mode, offload in modes:
        before = release_garbage(device)
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it is fast; offloaded models then go back to RAM
            model = UNet2DConditionModel.from_config(diffusers_config).to(dtype).eval()
        if offload is not None:
            model.to("cpu")
            model.enable_group_offload(device, torch.device("cpu"), offload_type=offload,
                                       num_blocks_per_group=1 if offload == "block_level" else None,
                                       use_stream=True)

        def step(model: torch.nn.Module = model) -> object:
            with torch.no_grad():
                return model(x, timesteps, context, added_cond_kwargs=added).sample

        ms, peak, reserved = measure(device, step, warmup, steps)
        peak, reserved = peak - before / GIB, reserved - before / GIB
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        copied = 0.0 if offload is None else weight_bytes / GIB
        rows.append(Row(name, f"diffusers {mode}", None, ms, peak, copied, None, reserved_gib=reserved))
        print(format_table(rows[-1:], header=False), flush=True)
        del model, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _time_embed_dim(config: UNetConfig) -> int:
    """SDXL's size/crop Fourier width: 256 (6 x 256 of the 2816-wide vector); 16 for the tiny model."""
    return 256 if config.adm_in_channels > 6 * 256 else 16


def _diffusers_config(config: UNetConfig) -> dict:
    widths = [config.model_channels * m for m in config.channel_mult]
    attention = [level in config.attention_levels and depth > 0
                 for level, depth in enumerate(config.transformer_depth)]
    heads = [w // config.num_head_channels if config.num_head_channels > 0 else config.num_heads
             for w in widths]
    diffusers = dict(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=config.num_res_blocks,
        block_out_channels=widths, cross_attention_dim=config.context_dim,
        down_block_types=["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        up_block_types=["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention)],
        transformer_layers_per_block=[max(1, d) for d in config.transformer_depth],
        attention_head_dim=heads, use_linear_projection=config.use_linear_in_transformer,
    )
    if config.adm_in_channels:
        diffusers.update(addition_embed_type="text_time", addition_time_embed_dim=_time_embed_dim(config),
                         projection_class_embeddings_input_dim=config.adm_in_channels)
    return diffusers


def budgets(largest_stage: int, total: int, workspace: int, points: int, extra: list[int]) -> list[int]:
    """From the smallest feasible budget (largest stage + workspace) and the smallest that double-buffers
    (two stages + workspace) to everything resident, evenly, plus the `extra` budgets (diffusers' peaks)."""
    low, high = largest_stage + workspace, total + workspace
    sweep = [low, 2 * largest_stage + workspace]
    if points > 1:
        sweep += [int(low + (high - low) * i / (points - 1)) for i in range(1, points)]
    return sorted({b for b in sweep + extra if low <= b <= high})


def bench_model(name: str, config: UNetConfig, side: int, dtype: torch.dtype, device: torch.device,
                args: argparse.Namespace, bandwidth: float) -> list[Row]:
    theirs = [] if args.no_diffusers else diffusers_rows(name, config, side, dtype, device, args.warmup,
                                                         args.steps)
    weights = random_weights(config, dtype, device)
    inputs = unet_inputs(config, side, dtype, device)
    sizes, total = stage_bytes(config, dtype)
    ms, peak, reserved, copied, segments, workspace, profile = sluice_run(config, weights, inputs, device,
                                                                          "device",
                                                                 None, args.warmup, args.steps)
    resident = Row(name, "sluice resident", None, ms, peak, copied, segments, ms, reserved)
    rows = [resident]
    print(format_table(rows), flush=True)
    offloaded = [r for r in theirs if "offload" in r.mode and r.peak_gib == r.peak_gib]
    peaks = {int(r.peak_gib * GIB): r.mode for r in offloaded}
    for budget in budgets(max(sizes), total, workspace, args.budgets, list(peaks)):
        mode = f"sluice pinned RAM, budget {budget / MIB:.1f} MiB"
        if budget in peaks:
            mode += f" (= {peaks[budget].removeprefix('diffusers ')} peak)"
        try:
            ms, peak, reserved, copied, segments, *_ = sluice_run(config, weights, inputs, device, "cpu",
                                                                 budget, args.warmup, args.steps)
        except BudgetExceeded as error:
            print(f"{name}: {mode}: infeasible ({error})", file=sys.stderr)
            rows.append(Row(name, mode, budget / GIB, None, None, 0.0, None))
            continue
        must_stream = max(0, total + workspace - budget)  # what cannot stay resident under the budget
        physical = max(resident.step_ms, must_stream / bandwidth * 1e3)
        floor = floor_ms(sizes, profile, resident.step_ms, budget, bandwidth)
        rows.append(Row(name, mode, budget / GIB, ms, peak, copied, segments, physical, reserved, floor))
        print(format_table(rows[-1:], header=False), flush=True)
    return rows + theirs


def check_targets(rows: list[Row]) -> list[str]:
    """issue 5's targets, one line each: peak <= budget, resident <= 1.0x diffusers, <= 1.15x the physical
    line, >= 2x diffusers leaf-level at its peak memory."""
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model and r.mode.startswith("sluice") and r.step_ms is not None]
        theirs = {r.mode: r for r in rows if r.model == model and r.mode.startswith("diffusers")}
        budgeted = [r for r in mine if r.budget_gib is not None]
        over = [r for r in budgeted if r.peak_gib > r.budget_gib]
        lines.append(f"{model}: peak <= budget at {len(budgeted) - len(over)} of {len(budgeted)} budgets"
                     + "".join(f"; over at {r.budget_gib:.3f} GiB: {r.peak_gib:.3f}" for r in over))
        worst = max(budgeted, key=lambda r: r.over_physical, default=None)
        if worst is not None:
            lines.append(f"{model}: worst step / physical line {worst.over_physical:.2f} (target <= 1.15) at "
                         f"{worst.budget_gib:.3f} GiB")
        floored = [r for r in budgeted if r.over_floor is not None]
        if floored:
            low = max(floored, key=lambda r: r.floor_ms / r.physical_ms)
            far = max(floored, key=lambda r: r.over_floor)
            lines.append(f"{model}: the floor of any plan within the budget lies up to "
                         f"{low.floor_ms / low.physical_ms:.2f}x above the physical line (at "
                         f"{low.budget_gib:.3f} GiB); worst step / floor {far.over_floor:.2f} at "
                         f"{far.budget_gib:.3f} GiB")
        if "diffusers resident" in theirs:
            ratio = mine[0].step_ms / theirs["diffusers resident"].step_ms
            lines.append(f"{model}: resident {mine[0].step_ms:.1f} ms vs diffusers "
                         f"{theirs['diffusers resident'].step_ms:.1f} ms: {ratio:.2f}x (target <= 1.0)")
        leaf = theirs.get("diffusers group offload leaf_level stream")
        at_leaf = [r for r in budgeted if "leaf_level" in r.mode]
        if leaf is not None and at_leaf:
            lines.append(f"{model}: at diffusers leaf-level's peak {leaf.peak_gib:.3f} GiB: "
                         f"{at_leaf[0].step_ms:.1f} ms vs {leaf.step_ms:.1f} ms = "
                         f"{leaf.step_ms / at_leaf[0].step_ms:.2f}x faster (target >= 2)")
    return lines


def format_table(rows: list[Row], header: bool = True) -> str:
    lines = ["| model | mode | ms / step | peak GiB | reserved GiB | GiB copied / step | segments "
             "| physical ms | / physical | floor ms | / floor |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"] if header else []
    for r in rows:
        def cell(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        cells = (cell(r.step_ms, ".1f"), cell(r.peak_gib, ".3f"), cell(r.reserved_gib, ".3f"),
                 f"{r.copied_gib_per_step:.3f}", cell(r.segments, "d"), cell(r.physical_ms, ".1f"),
                 cell(r.over_physical, ".2f"), cell(r.floor_ms, ".1f"), cell(r.over_floor, ".2f"))
        lines.append(f"| {r.model} | {r.mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> Path:
    """Step time against peak memory per model: Sluice's points (resident and every budget) and each diffusers
    mode's, the physical line and the floor of any plan through the sweep (bench/plots.py draws it)."""
    panels = []
    for model in dict.fromkeys(r.model for r in rows):
        points = [r for r in rows if r.model == model and r.step_ms is not None]
        sweep = sorted((r for r in points if r.physical_ms is not None), key=lambda r: r.peak_gib)
        lines = [Line("max(resident, streamed / bandwidth)", [(r.peak_gib, r.physical_ms) for r in sweep],
                      "dashed"),
                 Line("floor of any plan within the budget",
                      [(r.peak_gib, r.floor_ms) for r in sweep if r.floor_ms is not None], "dotted"),
                 Line("sluice (resident, budgets)",
                      [(r.peak_gib, r.step_ms) for r in points if r.mode.startswith("sluice")], "points")]
        lines += [Line(r.mode, [(r.peak_gib, r.step_ms)], "points") for r in points
                  if not r.mode.startswith("sluice")]
        panels.append(Panel(model, "peak memory (GiB)", "ms / step", lines=lines))
    return draw(path, panels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny UNets in float32: a CPU smoke run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per point (median)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (the first measures "
                        "the workspace and stage times, the second runs the plan made with them)")
    parser.add_argument("--budgets", type=int, default=6, help="budget points in the sweep")
    parser.add_argument("--no-diffusers", action="store_true", help="leave diffusers' rows out")
    parser.add_argument("--models", default="", help="comma-separated substrings of the model names to run")
    parser.add_argument("--cuda-graphs", default="auto", choices=("on", "off", "auto"),
                        help="the runtime's --cuda-graphs (default auto: on)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    GRAPHS[0] = args.cuda_graphs
    if args.tiny:
        torch.set_num_threads(1)  # tiny kernels: OpenMP barriers only add noise on a shared CPU
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.tiny or device.type == "cpu" else torch.float16
    if device.type == "cuda":  # clocks up before the first timing
        a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
        for _ in range(50):
            a @ a
        synchronize(device)
        del a
    bandwidth = copy_bandwidth(device)
    print(f"device {device}, dtype {dtype}, copy bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"({'pinned host to device' if device.type == 'cuda' else 'RAM clone, CPU stand-in'})")
    rows: list[Row] = []
    for name, config, side in model_cases(args.tiny):
        if args.models and not any(part.strip().lower() in name.lower() for part in args.models.split(",")):
            continue
        rows += bench_model(name, config, side, dtype, device, args, bandwidth)
    print(format_table(rows))
    print("\n".join(check_targets(rows)))
    write_results(rows, args.out, f"memory_{'tiny_' if args.tiny else ''}{device.type}", device, dtype,
                  bandwidth)
    return 0


def write_results(rows: list[Row], out: Path, prefix: str, device: torch.device, dtype: torch.dtype,
                  bandwidth: float) -> None:
    """The rows as `out/PREFIX_DATE_TIME.csv`, `.json` (with the device, dtype and copy rate) and `.png`."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{prefix}_{time.strftime('%Y%m%d_%H%M%S')}"
    with open(out / f"{stem}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    (out / f"{stem}.json").write_text(json.dumps(
        {"device": str(device), "dtype": str(dtype), "copy_bandwidth_bytes_per_s": bandwidth,
         "rows": [asdict(r) for r in rows]}, indent=2))
    image = plot(rows, out / f"{stem}.png")
    print(f"wrote {out / stem}.csv, .json and {image.name}")


if __name__ == "__main__":
    sys.exit(main())

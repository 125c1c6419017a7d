"""FLUX.1-dev: the transformer's step time against peak memory over a sweep of budgets, beside diffusers
(whole generations: bench/flux_e2e.py).

    python3 bench/flux.py                  # on a GPU: full size, random bf16 weights, 1024x1024, batch 1
    python3 bench/flux.py --tiny           # a CPU smoke run of the same program on a tiny FLUX-shaped model
    python3 bench/flux.py --fp8            # linear weights stored in fp8, cast per layer as they run

Rows as bench/memory.py (whose helpers this uses): our runtime resident, then weights in pinned RAM under
budgets from the smallest feasible (the largest block plus the workspace) to everything resident, plus
diffusers' block-level streaming peak; diffusers' FluxTransformer2DModel resident and with group offloading
(block level, one block per group, streamed), when diffusers is importable. Each point: median step (CUDA
events), peak allocated and reserved GiB, GiB copied per step, the physical line and the floor of any plan
(engine/memory/stream_model.py).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memory as bench_memory  # noqa: E402
from memory import (  # noqa: E402
    GIB,
    MIB,
    RESULTS,
    Row,
    budgets,
    copy_bandwidth,
    floor_ms,
    format_table,
    measure,
    random_model_weights,
    release_garbage,
    sluice_run,
    synchronize,
    write_results,
)

from engine.models.flux import FluxConfig, FluxTransformer, flux_dev_config  # noqa: E402

DIFFUSERS_BLOCK_PEAK = int(1.76 * GIB)  # ANCHORS.md: diffusers' block-level streaming peak on the H200


def tiny_config() -> FluxConfig:
    return FluxConfig(in_channels=64, out_channels=64, vec_in_dim=32, context_in_dim=64, hidden_size=128,
                      mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=4, axes_dim=(16, 24, 24),
                      theta=10000, qkv_bias=True, guidance_embed=True)


def flux_inputs(config: FluxConfig, side: int, text_tokens: int, dtype: torch.dtype, device: torch.device,
                ) -> tuple:
    """(latent [1, 16, side, side], timesteps, T5 context [1, T, C], pooled CLIP-L [1, P], guidance)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, config.in_channels // 4, side, side, generator=generator)
    context = torch.randn(1, text_tokens, config.context_in_dim, generator=generator)
    y = torch.randn(1, config.vec_in_dim, generator=generator)
    timesteps, guidance = torch.tensor([0.5]), torch.tensor([3.5])
    return tuple(t.to(device, dtype) for t in (x, timesteps, context, y, guidance))


def diffusers_config(config: FluxConfig) -> dict:
    return dict(patch_size=1, in_channels=config.in_channels, out_channels=config.out_channels,
                num_layers=config.depth, num_single_layers=config.depth_single_blocks,
                attention_head_dim=config.head_dim, num_attention_heads=config.num_heads,
                joint_attention_dim=config.context_in_dim, pooled_projection_dim=config.vec_in_dim,
                guidance_embeds=config.guidance_embed, axes_dims_rope=tuple(config.axes_dim))


def diffusers_tokens(inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The latent of `inputs` packed as FluxPipeline packs it: (tokens (B, L, C * 4), img_ids (L, 3),
    txt_ids (T, 3))."""
    x, _, context, _, _ = inputs
    b, c, h, w = x.shape
    tokens = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
    img_ids = torch.zeros(h // 2, w // 2, 3, device=x.device)
    img_ids[..., 1] += torch.arange(h // 2, device=x.device)[:, None]
    img_ids[..., 2] += torch.arange(w // 2, device=x.device)[None, :]
    return tokens, img_ids.reshape(-1, 3), torch.zeros(context.shape[1], 3, device=x.device)


def diffusers_rows(name: str, config: FluxConfig, inputs: tuple, device: torch.device, warmup: int,
                   steps: int) -> list[Row]:
    """diffusers' FluxTransformer2DModel resident and, on CUDA, with block-level group offloading."""
    try:
        from diffusers import FluxTransformer2DModel
    except ImportError:
        print("diffusers is not importable: its rows are left out", file=sys.stderr)
        return []
    x, timesteps, context, y, guidance = inputs
    tokens, img_ids, txt_ids = diffusers_tokens(inputs)
    modes = [("resident", None)] + ([("group offload block_level stream", "block_level")]
                                    if device.type == "cuda" else [])
    rows = []
    for mode, offload in modes:
        before = release_garbage(device)
        torch.manual_seed(0)
        with torch.device(device):
            model = FluxTransformer2DModel.from_config(diffusers_config(config)).to(x.dtype).eval()
        if offload is not None:
            model.to("cpu")
            model.enable_group_offload(device, torch.device("cpu"), offload_type=offload,
                                       num_blocks_per_group=1, use_stream=True)

        def step(model: torch.nn.Module = model) -> object:
            with torch.no_grad():
                return model(hidden_states=tokens, encoder_hidden_states=context, pooled_projections=y,
                             timestep=timesteps, img_ids=img_ids, txt_ids=txt_ids,
                             guidance=guidance if config.guidance_embed else None).sample

        ms, peak, reserved = measure(device, step, warmup, steps)
        peak, reserved = peak - before / GIB, reserved - before / GIB
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        copied = 0.0 if offload is None else weight_bytes / GIB
        rows.append(Row(name, f"diffusers {mode}", None, ms, peak, copied, None, reserved_gib=reserved))
        print(format_table(rows[-1:], header=False), flush=True)
        del model, step
        release_garbage(device)
    return rows


def stage_bytes(model: FluxTransformer) -> tuple[list[int], int]:
    return ([stage.parameter_bytes() for stage in model.stages()],
            sum(p.numel() * p.element_size() for p in model.parameters()))


def bench_transformer(name: str, config: FluxConfig, inputs: tuple, dtype: torch.dtype, device: torch.device,
                      args: argparse.Namespace, bandwidth: float) -> list[Row]:
    theirs = [] if args.no_diffusers else diffusers_rows(name, config, inputs, device, args.warmup,
                                                         args.steps)

    def build() -> FluxTransformer:
        return FluxTransformer(config, dtype=dtype, device="meta", weight_dtype=args.weight_dtype)

    began = time.perf_counter()
    weights = random_model_weights(build(), dtype, device)
    print(f"random weights: {sum(t.nbytes for t in weights.values()) / GIB:.2f} GiB in "
          f"{time.perf_counter() - began:.1f} s", flush=True)
    sizes, total = stage_bytes(build())
    ms, peak, reserved, copied, segments, workspace, profile = sluice_run(
        build, weights, inputs, device, "device", None, args.warmup, args.steps)
    resident = Row(name, "sluice resident", None, ms, peak, copied, segments, ms, reserved)
    rows = [resident]
    print(format_table(rows), flush=True)
    extra = [DIFFUSERS_BLOCK_PEAK] if device.type == "cuda" else []
    extra += [int(r.peak_gib * GIB) for r in theirs if "offload" in r.mode and r.peak_gib == r.peak_gib]
    # the lowest point: the largest stage and the resident run's workspace, with room for the few MiB by
    # which a budgeted call's measured workspace varies
    slack = min(8 * MIB, workspace // 8)
    for budget in budgets(max(sizes), total, workspace + slack, args.budgets, extra):
        mode = f"sluice pinned RAM, budget {budget / MIB:.1f} MiB"
        try:
            ms, peak, reserved, copied, segments, *_ = sluice_run(build, weights, inputs, device, "cpu",
                                                                  budget,
                                                                 args.warmup, args.steps)
        except bench_memory.BudgetExceeded as error:
            print(f"{name}: {mode}: infeasible ({error})", file=sys.stderr)
            rows.append(Row(name, mode, budget / GIB, None, None, 0.0, None))
            continue
        must_stream = max(0, total + workspace - budget)
        physical = max(resident.step_ms, must_stream / bandwidth * 1e3)
        floor = floor_ms(sizes, profile, resident.step_ms, budget, bandwidth)
        rows.append(Row(name, mode, budget / GIB, ms, peak, copied, segments, physical, reserved, floor))
        print(format_table(rows[-1:], header=False), flush=True)
    del weights
    gc.collect()
    return rows + theirs


def check_targets(rows: list[Row]) -> list[str]:
    """issue 16's targets: resident <= 0.95x diffusers', peak <= budget, within 1.15x of the floor, faster
    than diffusers' block streaming at its peak."""
    lines = bench_memory.check_targets(rows)
    for model in dict.fromkeys(r.model for r in rows):
        theirs = {r.mode: r for r in rows if r.model == model and r.mode.startswith("diffusers")}
        mine = [r for r in rows if r.model == model and r.mode.startswith("sluice") and r.step_ms is not None]
        block = theirs.get("diffusers group offload block_level stream")
        if block is not None:
            near = [r for r in mine if r.budget_gib is not None and r.budget_gib <= block.peak_gib * 1.05]
            if near:
                best = max(near, key=lambda r: r.budget_gib)
                lines.append(f"{model}: at {best.budget_gib:.3f} GiB (diffusers block-level peak "
                             f"{block.peak_gib:.3f}): {best.step_ms:.1f} ms vs {block.step_ms:.1f} ms")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny FLUX-shaped model in float32 (CPU smoke)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per point (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budgets", type=int, default=5, help="budget points in the sweep")
    parser.add_argument("--side", type=int, default=128, help="latent side (128 = 1024x1024 pixels)")
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (diffusers' dev default)")
    parser.add_argument("--no-diffusers", action="store_true")
    parser.add_argument("--fp8", action="store_true",
                        help="linear weights in float8_e4m3fn, cast per layer (no diffusers rows)")
    parser.add_argument("--cuda-graphs", default="auto", choices=("on", "off", "auto"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bench_memory.GRAPHS[0] = args.cuda_graphs
    tiny = args.tiny or device.type == "cpu"
    if tiny:
        torch.set_num_threads(1)  # tiny kernels: OpenMP barriers only add noise on a shared CPU
    config = tiny_config() if tiny else flux_dev_config()
    side, tokens = (16, 32) if tiny else (args.side, args.text_tokens)
    dtype = torch.float32 if tiny else torch.bfloat16
    bandwidth = copy_bandwidth(device)
    print(f"device {device}, dtype {dtype}, latent {side}x{side}, {tokens} text tokens, copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s", flush=True)
    name = "FLUX-tiny" if tiny else f"FLUX.1-dev {side * 8}x{side * 8}"
    name += " fp8 weights" if args.fp8 else ""
    args.weight_dtype = torch.float8_e4m3fn if args.fp8 else None
    args.no_diffusers = args.no_diffusers or args.fp8
    inputs = flux_inputs(config, side, tokens, dtype, device)
    rows = bench_transformer(name, config, inputs, dtype, device, args, bandwidth)
    synchronize(device)
    print(format_table(rows))
    print("\n".join(check_targets(rows)))
    write_results(rows, args.out, f"flux_{'tiny_' if tiny else ''}{device.type}", device, dtype, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())

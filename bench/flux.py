"""FLUX.1-dev: the transformer's step time against peak memory over a sweep of budgets, or (`--e2e`) one whole
generation, each beside diffusers.

    python3 bench/flux.py                  # on a GPU: full size, random bf16 weights, 1024x1024, batch 1
    python3 bench/flux.py --tiny           # a CPU smoke run of the same program on a tiny FLUX-shaped model
    python3 bench/flux.py --fp8            # linear weights stored in fp8, cast per layer as they run
    python3 bench/flux.py --e2e            # whole generations: on a GPU full size, 1024x1024, 20 steps
    python3 bench/flux.py --e2e --tiny     # a CPU smoke run: tiny FLUX-shaped models, 64x64, 2 steps, fp32

The sweep (rows as bench/memory.py, whose helpers this uses): our runtime resident, then weights in pinned RAM
under budgets from the smallest feasible (the largest block plus the workspace) to everything resident, plus
diffusers' block-level streaming peak; diffusers' FluxTransformer2DModel resident and with group offloading
(block level, one block per group, streamed), when diffusers is importable. Each point: median step (CUDA
events), peak allocated and reserved GiB, GiB copied per step, the physical line and the floor of any plan
(engine/memory/stream_model.py). Writes flux_[tiny_]<device>_<time>.csv, .json, .log and .png.

--e2e, a generation: the prompt encoded with CLIP-L + T5-XXL, `--steps` euler steps (scheduler simple, FLUX's
resolution shift, guidance 3.5 embedded, cfg 1, seed 0) of the transformer at `--side` x `--side` pixels, the
latent decoded by the 16-channel VAE to a uint8 image. Every mode runs it twice: "first" includes what a
first call does once (the runtime's stage timing and CUDA graph capture, diffusers' hooks moving models),
"warm" is the second.

Sluice modes (one MemoryRuntime holds the transformer, CLIP-L + T5-XXL and the VAE; the bundles are built by
engine/models/flux_loader.py's functions and the loader's VAE builder from an in-memory "checkpoint" whose
tensors are random, drawn on the compute device as the weight store reads them):
- sluice-resident: no budget, every weight's home the device;
- sluice-budget: the device ledger's budget is --budget-gib (as `--max-vram`), every weight's home pinned
  RAM; the runtime streams what does not fit.
diffusers modes (FluxPipeline of FluxTransformer2DModel, transformers' T5EncoderModel and CLIPTextModel,
AutoencoderKL, FlowMatchEulerDiscreteScheduler, random bf16 weights; the prompt tokenized by
T5TokenizerFast from resources/t5_tokenizer and a CLIPTokenizer built from our CLIP merges file):
- diffusers-resident: everything on the device;
- diffusers-offload: `enable_model_cpu_offload()` (CUDA only).
diffusers pads T5's prompt to max_sequence_length 512 (its FLUX dev default); ComfyUI and Sluice pad to at
least 256 tokens, so Sluice's T5 and the transformer's text stream are about half as long.

Per row: seconds of text encoding, sampling (and per step), decode (to uint8) and the whole, and
torch.cuda.max_memory_allocated / max_memory_reserved over the generation (reset at its start; what the mode
keeps resident counts). diffusers' phases are cut where its prompt encoding returns and where its VAE
decode begins; with offloading, accelerate moves a model to the GPU (and the one before it back to RAM) at
the model's first call, so the transformer's move counts in sampling and the VAE's in decode.
Writes flux_e2e_[tiny_]<device>_<time>.log, .json and .png under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy
import torch
from torch import nn

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
from plots import Bars, Panel, draw  # noqa: E402

from engine.devices import device_name, resolve_device  # noqa: E402
from engine.memory.ledger import DeviceLedger  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.memory.vae_tiling import TilingConfig  # noqa: E402
from engine.models import loader  # noqa: E402
from engine.models.clip import CLIPTextModel, clip_l_config  # noqa: E402
from engine.models.detect import ComponentStats, ModelInfo, TextEncoderConfig, VAEConfig  # noqa: E402
from engine.models.flux import FluxConfig, FluxTransformer, flux_axes_dim, flux_dev_config  # noqa: E402
from engine.models.flux_loader import build_flux_diffusion, flux_text_encoder  # noqa: E402
from engine.models.formats import CheckpointReader, TensorInfo  # noqa: E402
from engine.models.t5 import T5Config, T5Encoder, t5_xxl_config  # noqa: E402
from engine.models.tokenizer import build_vocab, load_merges  # noqa: E402
from engine.models.vae import AutoencoderKL  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.sampling.model_sampling import FluxFlowMatching, flux_shift_for  # noqa: E402
from engine.sampling.sample import sample  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

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


def sweep_main(argv: list[str]) -> int:
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
    args = parser.parse_args(argv)
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


# ------------------------------------------------------------------------------ --e2e: whole generations

T5_TOKENIZER = ROOT / "resources" / "t5_tokenizer" / "tokenizer.json"
PROMPT = ("A weathered lighthouse keeper in a yellow raincoat holds a brass lantern on a windswept cliff "
          "at dusk, waves crashing on black rocks below, gulls circling overhead, warm light spilling across "
          "wet stones, cinematic photograph, shallow depth of field, highly detailed")  # 41 words
GUIDANCE, CFG, SEED = 3.5, 1.0, 0
SAMPLER, SCHEDULER = "euler", "simple"
DIFFUSERS_T5_TOKENS = 512  # FluxPipeline's max_sequence_length default (dev)
# ComfyUI's all-in-one FLUX checkpoint prefixes: the in-memory checkpoint is laid out as one
PREFIXES = {"diffusion": "model.diffusion_model.", "clip_l": "text_encoders.clip_l.transformer.",
            "t5": "text_encoders.t5xxl.transformer.", "vae": "vae."}
SLUICE_MODES = ("sluice-resident", "sluice-budget")
DIFFUSERS_MODES = ("diffusers-resident", "diffusers-offload")
TINY_BUDGET = 12 * 2**20  # bytes: below the tiny models' weights, so the tiny budget run streams too


@dataclass(frozen=True)
class Configs:
    flux: FluxConfig
    t5: T5Config
    clip_l: TextEncoderConfig  # unprojected, as FLUX reads it
    vae: VAEConfig  # FLUX's: 16 channels, no quant convs, scale 0.3611 and shift 0.1159


@dataclass
class Generation:
    system: str  # sluice or diffusers
    mode: str  # resident, budget 4.0 GiB, model cpu offload
    run: str  # first or warm
    text_s: float | None = None
    sampling_s: float | None = None
    step_s: float | None = None
    decode_s: float | None = None
    total_s: float | None = None
    peak_allocated_gib: float | None = None  # None off CUDA
    peak_reserved_gib: float | None = None
    held_before_gib: float | None = None  # torch.cuda.memory_allocated when the generation began
    copied_gib: float | None = None  # Sluice: bytes the runtime copied host to device in the generation
    error: str | None = None  # the mode failed: why


def full_configs() -> Configs:
    vae = VAEConfig(in_channels=3, out_ch=3, z_channels=16, embed_dim=16, ch=128, ch_mult=(1, 2, 4, 4),
                    num_res_blocks=2, resolution=256, attn_resolutions=(), scale_factor=0.3611,
                    shift_factor=0.1159, use_quant_conv=False)
    clip = dataclasses.replace(clip_l_config(PREFIXES["clip_l"] + "text_model."), projection_dim=None)
    return Configs(flux_dev_config(), t5_xxl_config(), clip, vae)


def tiny_configs() -> Configs:
    """FLUX-shaped and small; the real vocabularies, so the real tokenizers work."""
    width = 32  # T5's d_model and CLIP-L's width, which the transformer reads
    flux = FluxConfig(vec_in_dim=width, context_in_dim=width, hidden_size=64, num_heads=2, depth=1,
                      depth_single_blocks=2, axes_dim=flux_axes_dim(32), guidance_embed=True)
    t5 = T5Config(d_model=width, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    clip = dataclasses.replace(clip_l_config(PREFIXES["clip_l"] + "text_model."), width=width, layers=2,
                               heads=2, intermediate=64)
    vae = dataclasses.replace(full_configs().vae, ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=1)
    return Configs(flux, t5, clip, vae)


# ------------------------------------------------------------------------------------------------ Sluice


class RandomCheckpoint(CheckpointReader):
    """An all-in-one FLUX checkpoint of random weights as flux_loader reads a file: a CheckpointReader whose
    tensors (bf16, as BFL's files) are drawn when read, on the compute device, seeded by their key: matrices
    with standard deviation 1/sqrt(fan_in), norm scales 1, biases 0 (bench/memory.py's random_model_weights).
    The weight store copies each into its own arena (the device, or pinned RAM), which is then the only
    copy."""

    format = "random"

    def __init__(self, parts: dict[str, nn.Module], device: torch.device) -> None:
        tensors = {prefix + name: TensorInfo(tuple(p.shape), "BF16", torch.bfloat16, p.numel() * 2)
                   for prefix, model in parts.items() for name, p in model.named_parameters()}
        # the path is named in messages; there is no such file
        super().__init__(Path("random-flux1-dev-all-in-one.safetensors"), tensors, {})
        self.device = device

    def get(self, key: str, device: str | torch.device | None = None) -> torch.Tensor:
        """The tensor drawn on the compute device (moved to `device` when one is given)."""
        tensor = self._load(key, self.info(key))
        return tensor if device is None else tensor.to(device)

    def _load(self, key: str, info: TensorInfo) -> torch.Tensor:
        if len(info.shape) < 2:
            value = 1.0 if key.endswith(("weight", "scale")) else 0.0
            return torch.full(info.shape, value, device=self.device)
        generator = torch.Generator(self.device).manual_seed(zlib.crc32(key.encode()))
        drawn = torch.randn(info.shape, generator=generator, device=self.device)
        return drawn / math.prod(info.shape[1:]) ** 0.5

    def close(self) -> None:
        """Nothing is open."""


def random_checkpoint(configs: Configs, device: torch.device) -> tuple[RandomCheckpoint, ModelInfo]:
    """The random checkpoint and what detection would say of it (engine/models/detect_flux.py)."""
    parts = {PREFIXES["diffusion"]: FluxTransformer(configs.flux, device="meta"),
             PREFIXES["clip_l"]: CLIPTextModel(configs.clip_l, device="meta"),
             PREFIXES["t5"]: T5Encoder(configs.t5, device="meta"),
             PREFIXES["vae"]: AutoencoderKL(configs.vae, device="meta")}
    info = ModelInfo(family="flux_dev", layout="flux",
                     components={"diffusion": PREFIXES["diffusion"], "vae": PREFIXES["vae"]}, unet=None,
                     vae=configs.vae, text_encoders=[configs.clip_l], stats={}, unassigned=ComponentStats(),
                     unassigned_examples=[], flux=configs.flux, flux_layout="bfl", t5=configs.t5,
                     t5_prefix=PREFIXES["t5"])
    return RandomCheckpoint(parts, device), info


def sluice_runtime(device: torch.device, budget: int | None, bus: EventBus) -> MemoryRuntime:
    """One runtime whose device ledger has `budget` bytes (None: none, live free memory only) as
    `--max-vram` gives it; the CPU (which --max-vram does not budget) gets an explicit ledger."""
    compute = resolve_device(device_name(device))
    if device.type == "cuda":
        ledger = DeviceLedger.for_device(compute, None if budget is None else budget / GIB, bus=bus)
    else:
        ledger = DeviceLedger(compute.name, budget if budget is not None else 1 << 50, bus=bus)
    return MemoryRuntime(MemorySettings(), bus=bus, ledgers={compute.name: ledger})


def sluice_bundles(checkpoint: RandomCheckpoint, info: ModelInfo, runtime: MemoryRuntime,
                   device: torch.device, home: str) -> tuple[Any, Any, Any]:
    """(MODEL, CLIP, VAE) as the loaders build them from a FLUX checkpoint, with the loaders' default dtypes
    (on CUDA: transformer and T5 bf16, CLIP-L fp16, VAE bf16 where supported; on the CPU float32)."""
    compute = resolve_device(device_name(device))
    target = loader._Target(compute, home, runtime)
    model = build_flux_diffusion(checkpoint, info, None, target)
    clip = flux_text_encoder((checkpoint, info.text_encoders[0]), (checkpoint, info.t5, info.t5_prefix), None,
                             target)
    vae = loader._build_vae(checkpoint, info, loader.default_dtype("vae", device, None), target)
    return model, clip, vae


def sluice_generation(model: Any, clip: Any, vae: Any, tiling: TilingConfig, side: int, steps: int,
                      device: torch.device) -> tuple[dict[str, float], torch.Tensor]:
    """CLIPTextEncode + FluxGuidance, EmptySD3LatentImage, KSampler (cfg 1, no negative), VAEDecode (with
    the settings' tiling mode, as the node) and the image as SaveImage makes it uint8: (phase -> seconds,
    uint8 image [H, W, 3])."""
    marks = [time.perf_counter()]
    conditioning = clip.encode(PROMPT)
    conditioning[0][1]["guidance"] = GUIDANCE
    marks.append(_synchronized(device))
    model.model_sampling = FluxFlowMatching(shift=flux_shift_for(side, side))  # ModelSamplingFlux
    cond = model.guidance_conditioning(conditioning, side, side)
    empty = torch.zeros(1, model.latent_channels, side // 8, side // 8, device=model.torch_device)
    samples = sample(model.denoiser(), empty, cond, None, CFG, SAMPLER, SCHEDULER, steps, SEED,
                     family=model.latent_format)
    latent = model.process_out(samples)
    marks.append(_synchronized(device))
    image = (vae.decode(latent, tiling)[0] * 255.0).clamp(0, 255).to(torch.uint8)
    marks.append(_synchronized(device))
    return _phases(marks, steps), image


def sluice_generations(args: argparse.Namespace, configs: Configs, device: torch.device, modes: list[str],
                       setup: list[dict]) -> list[Generation]:
    rows = []
    for mode in modes:
        if mode == "sluice-resident":
            budget, home, label = None, "device", "resident"
        else:
            budget = TINY_BUDGET if args.tiny else int(args.budget_gib * GIB)
            size = f"{budget / GIB:.2f} GiB" if budget >= GIB else f"{budget / 2**20:.0f} MiB"
            home, label = "cpu", f"budget {size}, weights in pinned RAM"
        say(f"\nSluice {label}: building the bundles ...")
        release(device)
        bus, copied = EventBus(), CopyCounter()
        bus.subscribe(copied)
        began = time.perf_counter()
        try:
            runtime = sluice_runtime(device, budget, bus)
            checkpoint, info = random_checkpoint(configs, device)
            model, clip, vae = sluice_bundles(checkpoint, info, runtime, device, home)
            _synchronized(device)
            seconds = time.perf_counter() - began
            setup.append({"system": "sluice", "mode": label, "build_s": seconds})
            say(f"  random weights drawn and registered ({home} home) in {seconds:.1f} s; dtypes: "
                f"transformer {model.dtype}, CLIP-L {_dtype(clip.encoders[0])}, "
                f"T5 {_dtype(clip.encoders[1])}, VAE {_dtype(vae.autoencoder)}")
            for run in ("first", "warm"):
                copied.bytes = 0
                held = _reset_peaks(device)
                tiling = TilingConfig(runtime.settings.vae_tiling)
                phases, image = sluice_generation(model, clip, vae, tiling, args.side, args.steps, device)
                rows.append(Generation("sluice", label, run, **phases, **_peaks(device), held_before_gib=held,
                                copied_gib=copied.bytes / GIB))
                say(generation_table(rows[-1:], header=False)
                    + f"   image {tuple(image.shape)} {image.dtype}, mean {image.float().mean():.1f}")
        except Exception as error:  # noqa: BLE001 - one failed mode must not lose the others' rows
            rows.append(Generation("sluice", label, "-", error=f"{type(error).__name__}: {error}"))
            say(f"  failed: {rows[-1].error}")
        finally:
            model = clip = vae = runtime = checkpoint = None
            release(device)
    return rows


class CopyCounter:
    """Bytes the runtime copies host to device: its "transfer" events of direction h2d."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, event: Any) -> None:
        if event.kind == "transfer" and event.get("direction") == "h2d":
            self.bytes += event.get("bytes")


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


# --------------------------------------------------------------------------------------------- diffusers


def diffusers_flux_pipeline(configs: Configs, dtype: torch.dtype, device: torch.device) -> Any:
    """FluxPipeline of random-weight models built on `device` (fast initialisation), then cast to `dtype`."""
    from diffusers import AutoencoderKL as DiffusersVAE
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
    from transformers import CLIPTextModel as HFCLIPTextModel
    from transformers import T5Config as HFT5Config

    flux, t5, clip, vae = configs.flux, configs.t5, configs.clip_l, configs.vae
    torch.manual_seed(0)
    with torch.device(device):
        transformer = FluxTransformer2DModel.from_config(diffusers_config(flux)).to(dtype).eval()
        text_encoder_2 = T5EncoderModel(HFT5Config(
            vocab_size=t5.vocab_size, d_model=t5.d_model, d_kv=t5.d_kv, d_ff=t5.d_ff,
            num_layers=t5.num_layers, num_heads=t5.num_heads,
            relative_attention_num_buckets=t5.relative_attention_num_buckets,
            relative_attention_max_distance=t5.relative_attention_max_distance,
            feed_forward_proj=t5.feed_forward_proj, layer_norm_epsilon=t5.layer_norm_epsilon,
            tie_word_embeddings=False)).to(dtype).eval()
        text_encoder = HFCLIPTextModel(CLIPTextConfig(  # FLUX's CLIP-L config (openai/clip-vit-large-patch14)
            vocab_size=clip.vocab_size, hidden_size=clip.width, intermediate_size=clip.intermediate,
            num_hidden_layers=clip.layers, num_attention_heads=clip.heads,
            max_position_embeddings=clip.max_positions, hidden_act="quick_gelu", projection_dim=clip.width,
            bos_token_id=0, eos_token_id=2, pad_token_id=1)).to(dtype).eval()
        autoencoder = DiffusersVAE(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(vae.ch_mult),
            up_block_types=("UpDecoderBlock2D",) * len(vae.ch_mult),
            block_out_channels=tuple(vae.ch * m for m in vae.ch_mult), layers_per_block=vae.num_res_blocks,
            latent_channels=vae.z_channels, norm_num_groups=32, sample_size=1024,
            scaling_factor=vae.scale_factor, shift_factor=vae.shift_factor, use_quant_conv=False,
            use_post_quant_conv=False).to(dtype).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler_config.json
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    merges = load_merges()
    tokenizer = CLIPTokenizer(vocab={token: i for i, token in enumerate(build_vocab(merges))},
                              merges=list(merges), model_max_length=clip.max_positions)
    tokenizer_2 = T5TokenizerFast(tokenizer_file=str(T5_TOKENIZER), model_max_length=DIFFUSERS_T5_TOKENS)
    return FluxPipeline(scheduler=scheduler, vae=autoencoder, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


class PhaseMarks:
    """Times (after a device sync) when the pipeline's prompt encoding returns and when its VAE decode begins,
    per generation: wrappers on the instances' methods, which accelerate's offload hooks leave alone."""

    def __init__(self, pipe: Any, device: torch.device) -> None:
        self.device, self.marks = device, {}
        encode_prompt, decode = pipe.encode_prompt, pipe.vae.decode

        def marked_encode_prompt(*args: Any, **kwargs: Any) -> Any:
            encoded = encode_prompt(*args, **kwargs)
            self.mark("sampling")
            return encoded

        def marked_decode(*args: Any, **kwargs: Any) -> Any:
            self.mark("decode")
            return decode(*args, **kwargs)

        pipe.encode_prompt, pipe.vae.decode = marked_encode_prompt, marked_decode

    def mark(self, name: str) -> None:
        if name not in self.marks:
            self.marks[name] = _synchronized(self.device)


def diffusers_generation(pipe: Any, marks: PhaseMarks, side: int, steps: int, device: torch.device,
                         ) -> tuple[dict[str, float], Any]:
    marks.marks = {}
    began = time.perf_counter()
    image = pipe(PROMPT, height=side, width=side, num_inference_steps=steps, guidance_scale=GUIDANCE,
                 max_sequence_length=DIFFUSERS_T5_TOKENS, generator=torch.Generator("cpu").manual_seed(SEED),
                 output_type="pil").images[0]
    end = _synchronized(device)
    return _phases([began, marks.marks["sampling"], marks.marks["decode"], end], steps), image


def diffusers_generations(args: argparse.Namespace, configs: Configs, dtype: torch.dtype,
                          device: torch.device, modes: list[str], setup: list[dict]) -> list[Generation]:
    try:
        import diffusers  # noqa: F401
    except ImportError:
        say("diffusers is not importable: its rows are left out")
        return []
    if "diffusers-offload" in modes and device.type != "cuda":
        say("diffusers-offload: enable_model_cpu_offload needs an accelerator; left out on " + device.type)
        modes = [m for m in modes if m != "diffusers-offload"]
    if not modes:
        return []
    rows = []
    release(device)
    say("\ndiffusers: building FluxPipeline (random weights) ...")
    began = time.perf_counter()
    pipe = diffusers_flux_pipeline(configs, dtype, device)
    pipe.set_progress_bar_config(disable=True)
    marks = PhaseMarks(pipe, device)
    seconds = _synchronized(device) - began
    setup.append({"system": "diffusers", "mode": "build", "build_s": seconds})
    say(f"  built in {seconds:.1f} s")
    for mode in [m for m in DIFFUSERS_MODES if m in modes]:  # resident first: the models are on the device
        label = "resident" if mode == "diffusers-resident" else "model cpu offload"
        try:
            if mode == "diffusers-offload":
                pipe.enable_model_cpu_offload(device=device)
            else:
                pipe.to(device)
            release(device)
            for run in ("first", "warm"):
                held = _reset_peaks(device)
                phases, image = diffusers_generation(pipe, marks, args.side, args.steps, device)
                rows.append(Generation("diffusers", label, run, **phases, **_peaks(device),
                                       held_before_gib=held))
                say(generation_table(rows[-1:], header=False) + f"   image {image.size} {image.mode}, "
                    f"mean {numpy.asarray(image).mean():.1f}")
        except Exception as error:  # noqa: BLE001 - one failed mode must not lose the others' rows
            rows.append(Generation("diffusers", label, "-", error=f"{type(error).__name__}: {error}"))
            say(f"  failed: {rows[-1].error}")
    del pipe, marks
    release(device)
    return rows


# ----------------------------------------------------------------------------------------------- common


def _synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _phases(marks: list[float], steps: int) -> dict[str, float]:
    """(start, text done, sampling done, decode done) -> the Generation's seconds."""
    start, text, sampled, decoded = marks
    return {"text_s": text - start, "sampling_s": sampled - text, "step_s": (sampled - text) / steps,
            "decode_s": decoded - sampled, "total_s": decoded - start}


def _reset_peaks(device: torch.device) -> float | None:
    """Reset the peak counters; the GiB allocated now (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GIB


def _peaks(device: torch.device) -> dict[str, float | None]:
    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}


def release(device: torch.device) -> None:
    """Free what the last mode left: reference cycles, the allocator's cached blocks, and pinned RAM that
    torch's host allocator keeps cached (the next mode or system needs that RAM)."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    left = torch.cuda.memory_allocated(device)
    if left > GIB:
        say(f"note: {left / GIB:.2f} GiB still allocated on {device}")


def generation_table(rows: list[Generation], header: bool = True) -> str:
    lines = ["| system | mode | run | text s | sampling s | s / step | decode s | total s "
             "| peak allocated GiB | peak reserved GiB |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"] if header else []
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.system} | {r.mode} | failed | {r.error} |")
            continue
        cells = [r.text_s, r.sampling_s, r.step_s, r.decode_s, r.total_s, r.peak_allocated_gib,
                 r.peak_reserved_gib]
        text = " | ".join("-" if v is None else f"{v:.3f}" for v in cells)
        lines.append(f"| {r.system} | {r.mode} | {r.run} | {text} |")
    return "\n".join(lines)


def generation_panels(rows: list[Generation], budget_gib: float) -> list[Panel]:
    """The table as panels: seconds per generation (first, warm), the warm one's phases, and the peak memory
    against the budget (CUDA only)."""
    modes = list(dict.fromkeys(f"{r.system} {r.mode}" for r in rows))

    def values(field: str, run: str) -> list[float | None]:
        found = {f"{r.system} {r.mode}": getattr(r, field) for r in rows if r.run == run}
        return [found.get(mode) for mode in modes]

    failed = [mode for mode in modes if mode not in {f"{r.system} {r.mode}" for r in rows if r.error is None}]
    note = f"failed: {', '.join(failed)}" if failed else ""
    panels = [Panel("seconds per generation", "seconds", categories=modes, note=note,
                    bars=[Bars(run, values("total_s", run)) for run in ("first", "warm")]),
              Panel("warm generation by phase", "seconds", categories=modes,
                    bars=[Bars(label, values(field, "warm")) for label, field in (
                        ("text encoding", "text_s"), ("sampling", "sampling_s"), ("decode", "decode_s"))])]
    if any(r.peak_allocated_gib is not None for r in rows):
        limits = [budget_gib if mode.startswith("sluice budget") else None for mode in modes]
        peaks = [Bars("peak allocated", values("peak_allocated_gib", "warm")),
                 Bars("peak reserved", values("peak_reserved_gib", "warm"))]
        panels.append(Panel("peak memory over the warm generation", "GiB", categories=modes, bars=peaks,
                            limits=limits, limit_label="budget"))
    else:
        panels[0].note = "; ".join(filter(None, [note, "peak memory: measured on CUDA only"]))
    return panels


LOG: list[TextIO] = []  # the open .log file while generation_main() runs


def say(text: str) -> None:
    """Print (flushed: a long run shows its progress) and append to the log."""
    print(text, flush=True)
    for log in LOG:
        log.write(text + "\n")
        log.flush()


def generation_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/flux.py --e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny FLUX-shaped models, 64x64, 2 steps, float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default 20; --tiny: 2)")
    parser.add_argument("--side", type=int, default=None,
                        help="image side in pixels (default 1024; --tiny: 64)")
    parser.add_argument("--budget-gib", type=float, default=4.0, help="Sluice's device budget for the budget "
                        "mode (0 = skip that mode; --tiny uses a fixed tiny budget)")
    parser.add_argument("--no-diffusers", action="store_true", help="leave diffusers' modes out")
    parser.add_argument("--modes", default=",".join(SLUICE_MODES + DIFFUSERS_MODES),
                        help="comma list of: " + ", ".join(SLUICE_MODES + DIFFUSERS_MODES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.tiny else 20)
    args.side = args.side or (64 if args.tiny else 1024)
    if args.side % 16:
        parser.error(f"--side {args.side}: accepted: a multiple of 16 (8x VAE, 2x2 patches)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in SLUICE_MODES + DIFFUSERS_MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; accepted: {', '.join(SLUICE_MODES + DIFFUSERS_MODES)}")
    if args.budget_gib <= 0:
        modes = [m for m in modes if m != "sluice-budget"]
    if args.no_diffusers:
        modes = [m for m in modes if m not in DIFFUSERS_MODES]
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.tiny:
        torch.set_num_threads(1)  # tiny kernels: OpenMP barriers only add noise on a shared CPU
    configs = tiny_configs() if args.tiny else full_configs()
    dtype = torch.float32 if args.tiny or device.type == "cpu" else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"flux_e2e_{'tiny_' if args.tiny else ''}{device.type}_{time.strftime('%Y%m%d_%H%M%S')}"
    with open(args.out / f"{stem}.log", "w") as log:
        LOG.append(log)
        say(f"FLUX.1-dev{' (tiny)' if args.tiny else ''} end to end on {device}: {args.side}x{args.side}, "
            f"{args.steps} steps {SAMPLER}/{SCHEDULER}, guidance {GUIDANCE}, cfg {CFG}, seed {SEED}, "
            f"diffusers {dtype}; modes {', '.join(modes)}\nprompt ({len(PROMPT.split())} words): {PROMPT}")
        setup: list[dict] = []
        rows = sluice_generations(args, configs, device, [m for m in SLUICE_MODES if m in modes], setup)
        theirs = [m for m in DIFFUSERS_MODES if m in modes]
        rows += diffusers_generations(args, configs, dtype, device, theirs, setup)
        say("\n" + generation_table(rows))
        say("\nSluice pads T5's prompt to at least 256 tokens (ComfyUI's rule); diffusers to "
            f"max_sequence_length {DIFFUSERS_T5_TOKENS}.")
        LOG.clear()
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"device": str(device), "torch": torch.__version__, "tiny": args.tiny, "side": args.side,
         "steps": args.steps, "budget_gib": args.budget_gib, "diffusers_dtype": str(dtype), "prompt": PROMPT,
         "diffusers_t5_tokens": DIFFUSERS_T5_TOKENS, "setup": setup, "rows": [asdict(r) for r in rows]},
        indent=2))
    budget_gib = (TINY_BUDGET if args.tiny else args.budget_gib * GIB) / GIB
    draw(args.out / f"{stem}.png", generation_panels(rows, budget_gib),
         f"FLUX.1-dev{' (tiny)' if args.tiny else ''} end to end on {device}: {args.side}x{args.side}, "
         f"{args.steps} steps")
    print(f"wrote {args.out / stem}.log, .json and .png", flush=True)
    return 0 if all(r.error is None for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--e2e" in argv:
        return generation_main([a for a in argv if a != "--e2e"])
    return sweep_main(argv)


if __name__ == "__main__":
    sys.exit(main())

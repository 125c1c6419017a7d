"""One whole FLUX.1-dev generation, end to end, through Sluice's engine beside diffusers' FluxPipeline.

    python3 bench/flux_e2e.py                # on a GPU: full size, random bf16 weights, 1024x1024, 20 steps
    python3 bench/flux_e2e.py --tiny         # a CPU smoke run: tiny FLUX-shaped models, 64x64, 2 steps, fp32

A generation: the prompt encoded with CLIP-L + T5-XXL, `--steps` euler steps (scheduler simple, FLUX's
resolution shift, guidance 3.5 embedded, cfg 1, seed 0) of the transformer at `--side` x `--side`, the
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
Writes flux_e2e_[tiny_]<device>_<time>.log and .json under --out.
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
from types import SimpleNamespace
from typing import Any, TextIO

import numpy
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.devices import GIB, device_name, resolve_device  # noqa: E402
from engine.memory.ledger import DeviceLedger  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.memory.vae_tiling import TilingConfig  # noqa: E402
from engine.models import loader  # noqa: E402
from engine.models.clip import CLIPTextModel, clip_l_config  # noqa: E402
from engine.models.detect import ComponentStats, ModelInfo, TextEncoderConfig, VAEConfig  # noqa: E402
from engine.models.flux import FluxConfig, FluxTransformer, flux_axes_dim, flux_dev_config  # noqa: E402
from engine.models.flux_loader import build_flux_diffusion, flux_text_encoder  # noqa: E402
from engine.models.t5 import T5Config, T5Encoder, t5_xxl_config  # noqa: E402
from engine.models.tokenizer import build_vocab, load_merges  # noqa: E402
from engine.models.vae import AutoencoderKL  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.sampling.model_sampling import FluxFlowMatching, flux_shift_for  # noqa: E402
from engine.sampling.sample import sample  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
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
class Row:
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


class RandomCheckpoint:
    """An all-in-one FLUX checkpoint of random weights as flux_loader reads a file (`path`, `keys()`,
    `get(key)`). Each tensor is drawn when read, on the compute device, seeded by its key: matrices with
    standard deviation 1/sqrt(fan_in), norm scales 1, biases 0 (bench/memory.py's random_model_weights). The
    weight store copies it into its own arena (the device, or pinned RAM), which is then the only copy."""

    def __init__(self, parts: dict[str, nn.Module], device: torch.device) -> None:
        self.path = Path("random-flux1-dev-all-in-one.safetensors")  # named in messages; no such file
        self.device = device
        self.shapes = {prefix + name: tuple(p.shape) for prefix, model in parts.items()
                       for name, p in model.named_parameters()}

    def keys(self) -> list[str]:
        return list(self.shapes)

    def info(self, key: str) -> SimpleNamespace:
        """What a reader says of a tensor before reading it: here its dtype (bf16, as BFL's files)."""
        return SimpleNamespace(shape=self.shapes[key], dtype=torch.bfloat16)

    def get(self, key: str) -> torch.Tensor:
        shape = self.shapes[key]  # KeyError for a key the checkpoint lacks, as a file reader
        if len(shape) < 2:
            return torch.full(shape, 1.0 if key.endswith(("weight", "scale")) else 0.0, device=self.device)
        generator = torch.Generator(self.device).manual_seed(zlib.crc32(key.encode()))
        drawn = torch.randn(shape, generator=generator, device=self.device)
        return drawn / math.prod(shape[1:]) ** 0.5


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


def sluice_rows(args: argparse.Namespace, configs: Configs, device: torch.device, modes: list[str],
                setup: list[dict]) -> list[Row]:
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
                rows.append(Row("sluice", label, run, **phases, **_peaks(device), held_before_gib=held,
                                copied_gib=copied.bytes / GIB))
                say(format_table(rows[-1:], header=False) + f"   image {tuple(image.shape)} {image.dtype}, "
                    f"mean {image.float().mean():.1f}")
        except Exception as error:  # noqa: BLE001 - one failed mode must not lose the others' rows
            rows.append(Row("sluice", label, "-", error=f"{type(error).__name__}: {error}"))
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


def diffusers_pipeline(configs: Configs, dtype: torch.dtype, device: torch.device) -> Any:
    """FluxPipeline of random-weight models built on `device` (fast initialisation), then cast to `dtype`."""
    from diffusers import AutoencoderKL as DiffusersVAE
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
    from transformers import CLIPTextModel as HFCLIPTextModel
    from transformers import T5Config as HFT5Config

    flux, t5, clip, vae = configs.flux, configs.t5, configs.clip_l, configs.vae
    torch.manual_seed(0)
    with torch.device(device):
        transformer = FluxTransformer2DModel.from_config(dict(
            patch_size=1, in_channels=flux.in_channels, out_channels=flux.out_channels, num_layers=flux.depth,
            num_single_layers=flux.depth_single_blocks, attention_head_dim=flux.head_dim,
            num_attention_heads=flux.num_heads, joint_attention_dim=flux.context_in_dim,
            pooled_projection_dim=flux.vec_in_dim, guidance_embeds=flux.guidance_embed,
            axes_dims_rope=tuple(flux.axes_dim))).to(dtype).eval()
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


def diffusers_rows(args: argparse.Namespace, configs: Configs, dtype: torch.dtype, device: torch.device,
                   modes: list[str], setup: list[dict]) -> list[Row]:
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
    pipe = diffusers_pipeline(configs, dtype, device)
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
                rows.append(Row("diffusers", label, run, **phases, **_peaks(device), held_before_gib=held))
                say(format_table(rows[-1:], header=False) + f"   image {image.size} {image.mode}, "
                    f"mean {numpy.asarray(image).mean():.1f}")
        except Exception as error:  # noqa: BLE001 - one failed mode must not lose the others' rows
            rows.append(Row("diffusers", label, "-", error=f"{type(error).__name__}: {error}"))
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
    """(start, text done, sampling done, decode done) -> the Row's seconds."""
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


def format_table(rows: list[Row], header: bool = True) -> str:
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


LOG: list[TextIO] = []  # the open .log file while main() runs


def say(text: str) -> None:
    """Print (flushed: a long run shows its progress) and append to the log."""
    print(text, flush=True)
    for log in LOG:
        log.write(text + "\n")
        log.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
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
    args = parser.parse_args()
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
        rows = sluice_rows(args, configs, device, [m for m in SLUICE_MODES if m in modes], setup)
        theirs = [m for m in DIFFUSERS_MODES if m in modes]
        rows += diffusers_rows(args, configs, dtype, device, theirs, setup)
        say("\n" + format_table(rows))
        say("\nSluice pads T5's prompt to at least 256 tokens (ComfyUI's rule); diffusers to "
            f"max_sequence_length {DIFFUSERS_T5_TOKENS}.")
        LOG.clear()
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"device": str(device), "torch": torch.__version__, "tiny": args.tiny, "side": args.side,
         "steps": args.steps, "budget_gib": args.budget_gib, "diffusers_dtype": str(dtype), "prompt": PROMPT,
         "diffusers_t5_tokens": DIFFUSERS_T5_TOKENS, "setup": setup, "rows": [asdict(r) for r in rows]},
        indent=2))
    print(f"wrote {args.out / stem}.log and .json", flush=True)
    return 0 if all(r.error is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

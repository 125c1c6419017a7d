"""Train Sluice's embedded model: a small SD1-family latent diffusion model on the shapes data set.

Phases: the KL VAE first (reconstruction + a small KL term), then the UNet and the CLIP text encoder
together (epsilon prediction on SD's scaled-linear schedule, 10% empty captions for classifier-free
guidance, an EMA of the weights). The models are Sluice's own (engine/models), so the file it writes has
the original single-file key names and loads through the ordinary loader as an "sd_custom" checkpoint.

It writes two files, each under the 16 MiB that resources/ allows:
MODELS/checkpoints/sluice-shapes.safetensors (UNet and VAE) and
MODELS/text_encoders/sluice-shapes-clip.safetensors (the text encoder, in the split-file layout
`text_model.*`). The CLIP vocabulary alone is 49408 x 64 weights, which is why it is a file of its own.

Resumable: `--resume MODELS` continues from the files this program wrote there (weights and phase step
counts are in the files' metadata; optimiser moments start afresh). A resumed run keeps the VAE and its
latent scale factor, so the preview decoder trained for that VAE (tools/train_preview_decoder.py) stays
valid. `--time-budget` stops a run cleanly and saves, so each run fits the GPU machine's 10-minute limit:
the budget counts from the program's start (data rendering included) to the end of training; saving takes
a few seconds more.

Captions come from tools/shapes_dataset.py in its training wordings only (HELD_OUT_TEMPLATES and the HELD_OUT
colour/shape pairs are the judge's). `--high-noise-share` draws that share of each batch's timesteps from
the noisier half of the schedule, where a sample's layout (the shape's position and size) is decided.

    python tools/train_embedded_model.py --out resources/models --vae-steps 3000 --unet-steps 20000 \
        --time-budget 540 [--resume resources/models]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.clip import CLIPTextModel  # noqa: E402
from engine.models.detect import TextEncoderConfig, UNetConfig, VAEConfig  # noqa: E402
from engine.models.tokenizer import CLIPTokenizer  # noqa: E402
from engine.models.unet import UNetModel  # noqa: E402
from engine.models.vae import AutoencoderKL  # noqa: E402
from tools import shapes_dataset  # noqa: E402

SIDE = 128  # image side in pixels; the latent is SIDE / 8
TOKENS = 77
CAPTIONS_PER_SCENE = 8
UNET_PREFIX, VAE_PREFIX = "model.diffusion_model.", "first_stage_model."
TE_PREFIX = ""  # a split text-encoder file: keys "text_model.*", as transformers saves CLIPTextModel
HEAD_CHANNELS = 32  # recorded in the file's metadata (sluice.num_head_channels): shapes do not say it

UNET_CONFIG = UNetConfig(
    in_channels=4,
    out_channels=4,
    model_channels=64,
    channel_mult=(1, 2, 2),
    num_res_blocks=1,
    attention_levels=(0, 1, 2),
    transformer_depth=(1, 1, 1),
    transformer_depth_middle=1,
    num_heads=-1,
    num_head_channels=HEAD_CHANNELS,
    context_dim=64,
    use_linear_in_transformer=False,
    adm_in_channels=None,
    num_classes=None,
    prediction="eps",
    family="sd_custom",
)
VAE_CONFIG = VAEConfig(
    in_channels=3,
    out_ch=3,
    z_channels=4,
    embed_dim=4,
    ch=32,
    ch_mult=(1, 2, 2, 2),
    num_res_blocks=1,
    resolution=SIDE,
    attn_resolutions=(),
    scale_factor=1.0,
)
TE_CONFIG = TextEncoderConfig(
    kind="clip_l",
    vocab_size=49408,
    max_positions=TOKENS,
    width=64,
    layers=4,
    heads=1,
    intermediate=256,
    projection_dim=None,
    activation="quick_gelu",
    key_prefix=TE_PREFIX,
    layout="hf",
)
CHECKPOINT_NAME = "sluice-shapes.safetensors"  # UNet + VAE, under checkpoints/
TEXT_ENCODER_NAME = "sluice-shapes-clip.safetensors"  # CLIP text encoder, under text_encoders/


# ------------------------------------------------------------------------------------------------ data


def _render_scene(index: int) -> tuple[np.ndarray, list[list[int]]]:
    """Image (SIDE, SIDE, 3) uint8 and CAPTIONS_PER_SCENE token rows of one training scene."""
    import random

    image, _, scene = shapes_dataset.sample(index, SIDE)
    tokenizer = _worker_tokenizer()
    rows = []
    for k in range(CAPTIONS_PER_SCENE):
        text = shapes_dataset.caption(scene, random.Random(index * 7919 + k))
        rows.append(tokenize(tokenizer, text))
    return np.asarray(image, dtype=np.uint8), rows


_TOKENIZER: CLIPTokenizer | None = None


def _worker_tokenizer() -> CLIPTokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = CLIPTokenizer(pad_with="eos")
    return _TOKENIZER


def tokenize(tokenizer: CLIPTokenizer, text: str) -> list[int]:
    """BOS, tokens, EOS, EOS padding to 77: the SD1 CLIP-L layout the conditioner uses at inference."""
    ids = tokenizer.encode(text)[: TOKENS - 2]
    return [tokenizer.bos_id, *ids, tokenizer.eos_id] + [tokenizer.eos_id] * (TOKENS - 2 - len(ids))


def build_dataset(count: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 [N, 3, S, S], tokens long [N, CAPTIONS_PER_SCENE, 77]) for scenes 0..count-1."""
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        results = pool.map(_render_scene, range(count), chunksize=256)
    images = torch.from_numpy(np.stack([r[0] for r in results])).permute(0, 3, 1, 2).contiguous()
    tokens = torch.tensor([r[1] for r in results], dtype=torch.long)
    return images, tokens


# ---------------------------------------------------------------------------------------------- models


def zero_init_outputs(unet: UNetModel) -> None:
    """LDM's zero_module: the last conv of each ResBlock, each proj_out and the output conv start at 0."""
    for name, module in unet.named_modules():
        if name.endswith("out_layers.3") or name.endswith("proj_out") or name == "out.2":
            for p in module.parameters():
                torch.nn.init.zeros_(p)


def state_with_prefix(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()}


def load_prefixed(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    own = {k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    module.load_state_dict(own, strict=True)


class EMA:
    """Exponential moving average of a module's parameters (decay per step)."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = list(module.parameters())
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.shadow, self.params, 1 - self.decay)  # one fused launch, not one per tensor

    @torch.no_grad()
    def copy_to(self) -> None:
        torch._foreach_copy_(self.params, self.shadow)


def sd_alphas_cumprod(device: torch.device) -> torch.Tensor:
    """SD's scaled-linear schedule: betas from 0.00085 to 0.012 (in sqrt space) over 1000 steps."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0).float().to(device)


# -------------------------------------------------------------------------------------------- training


def progress(step: int, steps: int, began: float, deadline: float) -> float:
    """How far a phase is, by steps or by time, whichever is further: the LR decays within the budget."""
    return min(1.0, max(step / steps, (time.time() - began) / max(deadline - began, 1e-6)))


def cosine(fraction: float, floor: float) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * fraction))


def train_vae(
    vae: AutoencoderKL,
    images: torch.Tensor,
    steps: int,
    start: int,
    deadline: float,
    device: torch.device,
    log,
) -> int:
    opt = torch.optim.AdamW(vae.parameters(), lr=4e-4, weight_decay=0.0)
    vae.train()
    step, began = start, time.time()
    while step < steps and time.time() < deadline:
        lr = 4e-4 * min(1.0, (step - start + 1) / 200) * cosine(progress(step, steps, began, deadline), 0.1)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = images[torch.randint(0, len(images), (64,), device=images.device)].float() / 127.5 - 1
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            moments = vae.quant_conv(_encode_features(vae, batch))
            mean, logvar = moments.float().chunk(2, dim=1)
            logvar = logvar.clamp(-30, 20)
            z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
            recon = _decode(vae, z)
        recon = recon.float()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).mean()
        loss = F.l1_loss(recon, batch) + F.mse_loss(recon, batch) + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 250 == 0 or step == steps:
            log(f"vae step {step}/{steps} loss {loss.item():.4f} kl {kl.item():.3f} lr {lr:.2e}")
    vae.eval()
    return step


def _encode_features(vae: AutoencoderKL, pixels: torch.Tensor) -> torch.Tensor:
    enc = vae.encoder
    h = enc.conv_in(pixels)
    for level in enc.down:
        h = level(h)
    h = enc.mid(h)
    return enc.conv_out(F.silu(enc.norm_out(h)))


def _decode(vae: AutoencoderKL, z: torch.Tensor) -> torch.Tensor:
    dec = vae.decoder
    h = dec.conv_in(vae.post_quant_conv(z))
    h = dec.mid(h)
    for i in reversed(range(len(dec.up))):
        h = dec.up[i](h)
    return dec.conv_out(F.silu(dec.norm_out(h)))


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Posterior means [N, 4, S/8, S/8] (unscaled) of every image."""
    out = []
    for i in range(0, len(images), 1024):
        batch = images[i : i + 1024].to(device).float() / 127.5 - 1
        moments = vae.quant_conv(_encode_features(vae, batch)).float()
        out.append(moments.chunk(2, dim=1)[0])
    return torch.cat(out)


def compiled_or_eager(unet: UNetModel, sample: torch.Tensor, device: torch.device, log):
    """torch.compile(unet) when it compiles and agrees with eager on a probe batch; else the eager UNet."""
    if device.type != "cuda":
        return unet
    try:
        compiled = torch.compile(unet)
        t = torch.full((len(sample),), 500.0, device=device)
        context = torch.randn(len(sample), TOKENS, UNET_CONFIG.context_dim, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            reference = unet(sample, t, context).float()
            difference = compiled(sample, t, context).float() - reference
        error = (difference.norm() / reference.norm().clamp_min(1e-6)).item()
        log(f"torch.compile UNet: relative difference from eager {error:.2e}")
        return compiled if error < 5e-2 else unet
    except Exception as failure:  # a compiler problem must not cost the run
        log(f"torch.compile failed ({type(failure).__name__}: {failure}); training eager")
        return unet


def train_diffusion(
    unet: UNetModel,
    te: CLIPTextModel,
    latents: torch.Tensor,
    tokens: torch.Tensor,
    empty: torch.Tensor,
    steps: int,
    start: int,
    deadline: float,
    device: torch.device,
    ema_unet: EMA,
    ema_te: EMA,
    log,
    batch_size: int,
    peak_lr: float = 3e-4,
    high_noise_share: float = 0.0,
) -> int:
    params = list(unet.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.01, fused=device.type == "cuda")
    unet_step = compiled_or_eager(unet, latents[:8], device, log)
    alphas = sd_alphas_cumprod(device)
    unet.train()
    te.train()
    step, began = start, time.time()
    while step < steps and time.time() < deadline:
        warm = min(1.0, (step - start + 1) / 300)
        lr = peak_lr * warm * cosine(progress(step, steps, began, deadline), 0.05)
        for group in opt.param_groups:
            group["lr"] = lr
        index = torch.randint(0, len(latents), (batch_size,), device=device)
        x0 = latents[index]
        caption = torch.randint(0, tokens.shape[1], (batch_size,), device=device)
        ids = tokens[index, caption]
        drop = torch.rand(batch_size, device=device) < 0.1
        ids = torch.where(drop[:, None], empty.expand_as(ids), ids)
        t = torch.randint(0, 1000, (batch_size,), device=device)
        noisy = torch.rand(batch_size, device=device) < high_noise_share
        t = torch.where(noisy, 500 + t // 2, t)
        noise = torch.randn_like(x0)
        a = alphas[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            context, _ = te(ids, clip_skip=1, norm_hidden=True)
            pred = unet_step(xt, t.float(), context)
        loss = F.mse_loss(pred.float(), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_unet.update()
        ema_te.update()
        step += 1
        if step % 500 == 0 or step == steps:
            log(f"unet step {step}/{steps} loss {loss.item():.4f} lr {lr:.2e}")
    unet.eval()
    te.eval()
    return step


@torch.no_grad()
def preview_grid(
    unet: UNetModel,
    vae: AutoencoderKL,
    te: CLIPTextModel,
    scale: float,
    path: Path,
    device: torch.device,
    steps: int = 30,
    cfg: float = 5.0,
) -> None:
    """A sanity grid: 8 training-style and 8 held-out prompts, sampled with plain DDIM (eta 0) and CFG."""
    from PIL import Image

    tokenizer = CLIPTokenizer(pad_with="eos")
    prompts = [shapes_dataset.sample(10_000_000 + i, held_out=i >= 8)[1] for i in range(16)]
    ids = torch.tensor([tokenize(tokenizer, p) for p in prompts + [""]], device=device)
    context, _ = te(ids, clip_skip=1, norm_hidden=True)
    cond, uncond = context[:-1], context[-1:].expand(len(prompts), -1, -1)
    alphas = sd_alphas_cumprod(device)
    timesteps = torch.linspace(999, 0, steps, device=device).round().long()
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(len(prompts), 4, SIDE // 8, SIDE // 8, generator=generator).to(device)
    for i, t in enumerate(timesteps):
        eps_c, eps_u = unet(
            torch.cat([x, x]), t.float().repeat(2 * len(prompts)), torch.cat([cond, uncond])
        ).chunk(2)
        eps = eps_u + cfg * (eps_c - eps_u)
        a_t = alphas[t]
        a_prev = alphas[timesteps[i + 1]] if i + 1 < steps else torch.tensor(1.0, device=device)
        x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    pixels = _decode(vae, x / scale).clamp(-1, 1)
    images = ((pixels + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    grid = Image.new("RGB", (SIDE * 8, SIDE * 2))
    for i, image in enumerate(images):
        grid.paste(Image.fromarray(image), ((i % 8) * SIDE, (i // 8) * SIDE))
    grid.save(path)
    path.with_suffix(".txt").write_text("\n".join(prompts) + "\n")


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="models folder to write the two files into")
    parser.add_argument("--resume", type=Path, help="a models folder this program wrote, to continue from")
    parser.add_argument("--scenes", type=int, default=60000, help="distinct training scenes")
    parser.add_argument("--vae-steps", type=int, default=3000)
    parser.add_argument("--unet-steps", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4, help="UNet and text encoder peak learning rate")
    parser.add_argument("--high-noise-share", type=float, default=0.0,
                        help="share of timesteps drawn from the noisier half (500..999) of the schedule")
    parser.add_argument("--vae-share", type=float, default=0.3, help="share of the time budget for the VAE")
    parser.add_argument("--time-budget", type=float, default=540.0, help="seconds; save and stop after")
    parser.add_argument("--workers", type=int, default=max(1, multiprocessing.cpu_count() - 1))
    parser.add_argument("--log", type=Path, help="also append log lines to this file")
    parser.add_argument("--preview", type=Path, help="write a PNG grid of samples here at the end")
    args = parser.parse_args(argv)
    if not 0.0 <= args.high_noise_share <= 1.0:
        parser.error(f"--high-noise-share {args.high_noise_share} is not a share; accepted: 0..1")
    if args.time_budget <= 0:
        parser.error(f"--time-budget {args.time_budget} is not a number of seconds; accepted: > 0")

    started = time.time()
    deadline = started + args.time_budget
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    def log(message: str) -> None:
        line = f"[{time.time() - started:7.1f}s] {message}"
        print(line, flush=True)
        if args.log:
            with args.log.open("a") as f:
                f.write(line + "\n")

    images, tokens = build_dataset(args.scenes, args.workers)  # before CUDA starts: the pool forks
    log(f"rendered {len(images)} scenes at {SIDE}px with {tokens.shape[1]} captions each")
    images = images.to(device)
    unet = UNetModel(UNET_CONFIG, device=device)
    vae = AutoencoderKL(VAE_CONFIG, device=device)
    te = CLIPTextModel(TE_CONFIG, layout="hf", device=device)
    zero_init_outputs(unet)
    torch.nn.init.normal_(te.text_model.embeddings.token_embedding.weight, std=0.02)
    torch.nn.init.normal_(te.text_model.embeddings.position_embedding.weight, std=0.01)
    history: dict = {"vae_steps": 0, "unet_steps": 0, "seconds": 0.0, "runs": []}
    kept_scale = None
    if args.resume:
        checkpoint = args.resume / "checkpoints" / CHECKPOINT_NAME
        tensors = load_file(str(checkpoint))
        load_prefixed(unet, tensors, UNET_PREFIX)
        load_prefixed(vae, tensors, VAE_PREFIX)
        load_prefixed(te, load_file(str(args.resume / "text_encoders" / TEXT_ENCODER_NAME)), TE_PREFIX)
        with safe_open(str(checkpoint), framework="pt") as f:
            history = json.loads(f.metadata()["sluice.training"])
            kept_scale = float(f.metadata()["sluice.vae_scale_factor"])
        log(
            f"resumed from {args.resume}: {history['vae_steps']} VAE, {history['unet_steps']} UNet steps"
        )
    for name, module in (("unet", unet), ("vae", vae), ("te", te)):
        log(f"{name}: {sum(p.numel() for p in module.parameters()):,} parameters")

    run = {"vae_from": history["vae_steps"], "unet_from": history["unet_steps"]}
    if history["unet_steps"] == 0 and history["vae_steps"] < args.vae_steps:  # the UNet fixes the latents
        vae_deadline = time.time() + args.vae_share * (deadline - time.time())
        history["vae_steps"] = train_vae(
            vae, images, args.vae_steps, history["vae_steps"], vae_deadline, device, log
        )
    vae.requires_grad_(False)
    latents = encode_latents(vae, images, device)
    if history["unet_steps"] > 0 and kept_scale is not None:  # the UNet (and preview decoder) know this scale
        scale = kept_scale
        log(f"latent std {latents.std().item():.4f}; scale factor kept at {scale:.6f}")
    else:
        scale = 1.0 / latents.std().item()
        log(f"latent std {latents.std().item():.4f} -> scale factor {scale:.5f}")
    latents = (latents * scale).to(device)

    tokenizer = CLIPTokenizer(pad_with="eos")
    empty = torch.tensor(tokenize(tokenizer, ""), device=device)
    ema_unet, ema_te = EMA(unet, 0.999), EMA(te, 0.999)
    if history["unet_steps"] < args.unet_steps:
        history["unet_steps"] = train_diffusion(
            unet,
            te,
            latents,
            tokens.to(device),
            empty,
            args.unet_steps,
            history["unet_steps"],
            deadline,
            device,
            ema_unet,
            ema_te,
            log,
            args.batch_size,
            args.lr,
            args.high_noise_share,
        )
        ema_unet.copy_to()
        ema_te.copy_to()

    run.update(
        vae_to=history["vae_steps"],
        unet_to=history["unet_steps"],
        seconds=round(time.time() - started),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    )
    history["runs"].append(run)
    history["seconds"] += time.time() - started
    description = (
        "Sluice's embedded shapes model (SD1-family, 128x128), trained by "
        "tools/train_embedded_model.py on tools/shapes_dataset.py"
    )
    files = {
        args.out / "checkpoints" / CHECKPOINT_NAME: (
            {**state_with_prefix(unet, UNET_PREFIX), **state_with_prefix(vae, VAE_PREFIX)},
            {
                "sluice.training": json.dumps(history),
                "sluice.num_head_channels": str(HEAD_CHANNELS),
                "sluice.vae_scale_factor": f"{scale:.6f}",
                "sluice.description": description,
            },
        ),
        args.out / "text_encoders" / TEXT_ENCODER_NAME: (
            state_with_prefix(te, TE_PREFIX),
            {"sluice.training": json.dumps(history), "sluice.description": description},
        ),
    }
    if args.preview:
        args.preview.parent.mkdir(parents=True, exist_ok=True)
        preview_grid(unet, vae, te, scale, args.preview, device)
        log(f"wrote {args.preview}")
    for path, (tensors, metadata) in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=metadata)
        log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    log(
        f"{history['vae_steps']} VAE, {history['unet_steps']} UNet steps, {history['seconds']:.0f} s in all"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

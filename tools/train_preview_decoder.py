"""Train the embedded model's preview decoder: a small TAESD-layout decoder from its VAE's latents to RGB.

Live previews and the TAESDDecode node decode a model-space latent (raw VAE latent * the VAE's scale) to an
image at 8x. SD1's latent-to-RGB factors do not fit the embedded model's own VAE (its previews were pink), so
this program encodes data set images with the shipped VAE and fits a decoder (engine/models/taesd.py,
TAESDDecoder, narrow and with one Block per stage) to map those latents back to the images. It depends on the
VAE only: a UNet retrained with the VAE kept leaves it valid. The file records the VAE's scale in its metadata
(`sluice.vae_scale_factor`) and is found as vae_approx/<checkpoint stem>_taesd_decoder.safetensors.

It trains on the CPU on crops of the latents (the loss only where a crop's padding cannot reach, except at the
image's own border), since full 128 px images cost too much there:

    python tools/train_preview_decoder.py [--images 1500] [--time-budget 540] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.taesd import OWN_DECODER_SUFFIX, SCALE_KEY, TAESDDecoder  # noqa: E402
from engine.models.vae import AutoencoderKL  # noqa: E402
from tools import shapes_dataset  # noqa: E402
from tools.train_embedded_model import (  # noqa: E402
    CHECKPOINT_NAME,
    SIDE,
    VAE_CONFIG,
    VAE_PREFIX,
    encode_latents,
    load_prefixed,
)

MODELS = Path(__file__).resolve().parents[1] / "resources" / "models"
LATENT_SIDE = SIDE // 8
FIRST_INDEX = 20_000_000  # data set indices the UNet's training never renders (it uses 0..scenes-1)


def load_vae(checkpoint: Path) -> tuple[AutoencoderKL, float]:
    """The checkpoint's VAE (float32, eval) and its latent scale factor from the metadata."""
    vae = AutoencoderKL(VAE_CONFIG, device="cpu")
    load_prefixed(vae, load_file(str(checkpoint)), VAE_PREFIX)
    with safe_open(str(checkpoint), framework="pt") as f:
        metadata = f.metadata() or {}
    if SCALE_KEY not in metadata:
        raise ValueError(f"{checkpoint} has no {SCALE_KEY} metadata; accepted: a checkpoint written by "
                         f"tools/train_embedded_model.py")
    return vae.eval(), float(metadata[SCALE_KEY])


def data(vae: AutoencoderKL, scale: float, count: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(model-space latents [N, 4, 16, 16], images in 0..1 [N, 3, 128, 128]) of `count` data set scenes,
    half of them with held-out colour/shape pairs, so every pair's colours are seen."""
    images = np.stack([np.asarray(shapes_dataset.sample(first + i, SIDE, held_out=i % 2 == 1)[0])
                       for i in range(count)])
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()  # (N, 3, S, S) uint8
    with torch.inference_mode():  # in small batches: a whole set's encoder activations take gigabytes
        latents = torch.cat([encode_latents(vae, pixels[i:i + 32], torch.device("cpu"))
                             for i in range(0, len(pixels), 32)]) * scale
    return latents.clone(), pixels.float() / 255


def crops(latents: torch.Tensor, images: torch.Tensor, batch: int, cells: int, margin: int,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of `cells`-square latent crops, their image crops and loss masks (0 within `margin` cells of
    a crop edge that is not the image's edge, where the crop's zero padding differs from the image)."""
    index = torch.randint(0, len(latents), (batch,), generator=generator)
    offsets = torch.randint(0, LATENT_SIDE - cells + 1, (batch, 2), generator=generator)
    z, x, mask = [], [], torch.ones(batch, 1, cells * 8, cells * 8)
    m = margin * 8
    for k in range(batch):
        i, (oy, ox) = int(index[k]), offsets[k].tolist()
        z.append(latents[i, :, oy:oy + cells, ox:ox + cells])
        x.append(images[i, :, oy * 8:(oy + cells) * 8, ox * 8:(ox + cells) * 8])
        if oy > 0:
            mask[k, :, :m] = 0
        if oy + cells < LATENT_SIDE:
            mask[k, :, -m:] = 0
        if ox > 0:
            mask[k, :, :, :m] = 0
        if ox + cells < LATENT_SIDE:
            mask[k, :, :, -m:] = 0
    return torch.stack(z), torch.stack(x), mask


def mean_rgb_distance(decoder: TAESDDecoder, latents: torch.Tensor, images: torch.Tensor) -> float:
    """Mean per-pixel Euclidean RGB distance (0..255 scale) between decoded latents and the images."""
    with torch.no_grad():
        decoded = decoder(latents).clamp(0, 1)
    return float(((decoded - images) * 255).square().sum(dim=1).sqrt().mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=MODELS / "checkpoints" / CHECKPOINT_NAME)
    parser.add_argument("--out", type=Path, help="the decoder file (default: vae_approx/ beside the "
                        "checkpoint's folder, named <checkpoint stem>_taesd_decoder.safetensors)")
    parser.add_argument("--images", type=int, default=1500, help="data set scenes to encode and fit")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--time-budget", type=float, default=540.0, help="seconds of training; then save")
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--crop", type=int, default=8, help="latent cells per crop side")
    parser.add_argument("--width", type=int, default=16, help="decoder channels")
    parser.add_argument("--blocks", type=int, default=1, help="decoder Blocks per stage")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not 2 <= args.crop <= LATENT_SIDE:
        raise ValueError(f"--crop {args.crop} is not a latent crop side; accepted: 2..{LATENT_SIDE}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = args.out or (args.checkpoint.parent.parent / "vae_approx" /
                       f"{args.checkpoint.name.split('.')[0]}{OWN_DECODER_SUFFIX}.safetensors")
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.1f}s] {message}", flush=True)

    vae, scale = load_vae(args.checkpoint)
    latents, images = data(vae, scale, args.images, FIRST_INDEX)
    check_latents, check_images = data(vae, scale, 64, FIRST_INDEX + args.images)
    log(f"encoded {len(latents)} training and {len(check_latents)} check images (scale {scale})")
    decoder = TAESDDecoder(latent_channels=4, width=args.width, blocks=args.blocks, latent_scale=scale)
    log(f"decoder: {sum(p.numel() for p in decoder.parameters()):,} parameters")
    opt = torch.optim.Adam(decoder.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(0)
    margin = 1 if args.crop < LATENT_SIDE else 0
    step, began = 0, time.time()
    deadline = began + args.time_budget
    while step < args.steps and time.time() < deadline:
        fraction = max(step / args.steps, (time.time() - began) / args.time_budget)
        for group in opt.param_groups:
            group["lr"] = 2e-3 * min(1.0, (step + 1) / 100) * (0.05 + 0.475 * (1 + np.cos(np.pi * fraction)))
        z, x, mask = crops(latents, images, args.batch_size, args.crop, margin, generator)
        error = (decoder(z) - x) * mask
        loss = error.abs().mean() + error.square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 200 == 0:
            log(f"step {step} loss {loss.item():.4f}")
    decoder.eval()
    distance = mean_rgb_distance(decoder, check_latents, check_images)
    log(f"{step} steps; mean RGB distance to {len(check_latents)} unseen scenes' images: {distance:.1f}")
    metadata = {
        SCALE_KEY: f"{scale:.6f}",
        "sluice.description": f"preview decoder for {args.checkpoint.name}'s VAE, trained by "
                              "tools/train_preview_decoder.py",
        "sluice.training": json.dumps({"steps": step, "images": args.images, "batch_size": args.batch_size,
                                       "crop": args.crop, "seconds": round(time.time() - started),
                                       "mean_rgb_distance": round(distance, 2)}),
    }
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in decoder.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata=metadata)
    log(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fine-tune the embedded model's VAE decoder alone, its encoder frozen: sharper edges, no stray specks.

The VAE of tools/train_embedded_model.py trained briefly (2,837 steps of 64 images) and decodes blurred edges
with a multicoloured speck beside most shapes; the speck is the decoder's, since an encode-decode round trip
of a rendered scene shows it too. The UNet was trained on the encoder's latents, so retraining the whole
VAE would mean retraining the UNet. This program keeps the encoder (and so every latent, the latent scale
and the UNet) as they are and fits only the decoding path (post_quant_conv and decoder) to map the encoder's
latents, with a little noise for the UNet's imprecision, back to the rendered images. The preview decoder
(tools/train_preview_decoder.py) reads the same latents, so it stays valid too.

    python tools/train_vae_decoder.py --checkpoint resources/models/checkpoints/sluice-shapes.safetensors \
        --out DIR/checkpoints/sluice-shapes.safetensors [--images 2000] [--time-budget 3000] [--threads 1]

The output is the input file with the decoding tensors replaced and the run added to its
`sluice.training` metadata (`decoder_runs`). Before and after, it prints the mean RGB distance of 64 unseen
scenes' round trips to their images and how many of their pixels are off by more than 60 (the specks).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.vae import AutoencoderKL  # noqa: E402
from tools import shapes_dataset  # noqa: E402
from tools.train_embedded_model import SIDE, VAE_CONFIG, VAE_PREFIX, _decode, encode_latents, load_prefixed  # noqa: E402

FIRST_INDEX = 30_000_000  # data set indices no other training program renders
DECODING = ("post_quant_conv.", "decoder.")  # the tensors this program trains, under VAE_PREFIX
OFF = 60  # a pixel further than this from the image in some channel (0..255) counts as wrong


def scenes(count: int, first: int) -> torch.Tensor:
    """[N, 3, S, S] uint8 images of data set scenes, every other one with a held-out colour/shape pair."""
    images = [np.asarray(shapes_dataset.sample(first + i, SIDE, held_out=i % 2 == 1)[0])
              for i in range(count)]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def posterior_means(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():  # in small batches: a whole set's encoder activations take gigabytes
        means = [encode_latents(vae, images[i:i + 32], torch.device("cpu"))
                 for i in range(0, len(images), 32)]
    return torch.cat(means).clone()


def round_trip_errors(vae: AutoencoderKL, latents: torch.Tensor, images: torch.Tensor) -> tuple[float, int]:
    """(mean per-pixel Euclidean RGB distance on 0..255, pixels off by more than OFF in some channel)."""
    with torch.no_grad():
        decoded = torch.cat([_decode(vae, latents[i:i + 16]) for i in range(0, len(latents), 16)])
    decoded = ((decoded.clamp(-1, 1) + 1) * 127.5).round()
    difference = decoded - images.float()
    distance = float(difference.square().sum(dim=1).sqrt().mean())
    return distance, int((difference.abs().amax(dim=1) > OFF).sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a checkpoint written by tools/train_embedded_model.py")
    parser.add_argument("--out", type=Path, required=True, help="where to write the fine-tuned checkpoint")
    parser.add_argument("--images", type=int, default=2000, help="data set scenes to encode and fit")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--latent-noise", type=float, default=0.05,
                        help="Gaussian noise added to the latents, as a share of their standard deviation")
    parser.add_argument("--time-budget", type=float, default=3000.0, help="seconds of training; then save")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.out.resolve() == args.checkpoint.resolve():
        parser.error(f"--out {args.out} is the input checkpoint; accepted: another path")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {message}", flush=True)

    tensors = load_file(str(args.checkpoint))
    with safe_open(str(args.checkpoint), framework="pt") as f:
        metadata = dict(f.metadata() or {})
    vae = AutoencoderKL(VAE_CONFIG, device="cpu")
    load_prefixed(vae, tensors, VAE_PREFIX)
    vae.eval().requires_grad_(False)
    images = scenes(args.images, FIRST_INDEX)
    latents = posterior_means(vae, images)
    check_images = scenes(64, FIRST_INDEX + args.images)
    check_latents = posterior_means(vae, check_images)
    before = round_trip_errors(vae, check_latents, check_images)
    log(f"encoded {len(latents)} training and 64 check scenes; before: mean RGB distance {before[0]:.2f}, "
        f"{before[1]} pixels off by more than {OFF}")

    decoding = [vae.post_quant_conv, vae.decoder]
    params = [p for module in decoding for p in module.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=args.lr)
    noise_std = args.latent_noise * float(latents.std())
    targets = images.float() / 127.5 - 1
    generator = torch.Generator().manual_seed(0)
    step, began = 0, time.time()
    while step < args.steps and time.time() < began + args.time_budget:
        fraction = min(1.0, max(step / args.steps, (time.time() - began) / args.time_budget))
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.45 * (1 + math.cos(math.pi * fraction)))
        for group in opt.param_groups:
            group["lr"] = lr
        index = torch.randint(0, len(latents), (args.batch_size,), generator=generator)
        z = latents[index] + noise_std * torch.randn(latents[index].shape, generator=generator)
        decoded = _decode(vae, z)
        loss = F.l1_loss(decoded, targets[index]) + F.mse_loss(decoded, targets[index])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            log(f"step {step} loss {loss.item():.4f} lr {lr:.2e}")
    vae.eval()
    after = round_trip_errors(vae, check_latents, check_images)
    log(f"{step} steps; after: mean RGB distance {after[0]:.2f}, {after[1]} pixels off by more than {OFF}")

    state = vae.state_dict()
    for name, value in state.items():
        if name.startswith(DECODING):
            tensors[VAE_PREFIX + name] = value.detach().to(torch.float16).contiguous()
    history = json.loads(metadata.get("sluice.training", "{}"))
    history.setdefault("decoder_runs", []).append({
        "steps": step, "images": args.images, "batch_size": args.batch_size, "lr": args.lr,
        "latent_noise": args.latent_noise, "seconds": round(time.time() - started),
        "distance_before": round(before[0], 2), "distance_after": round(after[0], 2),
        "off_before": before[1], "off_after": after[1],
    })
    metadata["sluice.training"] = json.dumps(history)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out), metadata=metadata)
    log(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a resident FLUX.1-dev step spends its GPU time, ours beside diffusers', and what each SDPA backend
takes at FLUX's attention shape.

    python3 bench/flux_profile.py            # on a GPU: full size, random bf16 weights, 1024x1024

Prints: SDPA backends (flash, cuDNN, memory-efficient) at (1, 24, 4608, 128) bf16, median of 10; then, per
model, one eager step under torch.profiler with the kernels' GPU time summed by kind (matrix products,
attention, the rest by name) and the CUDA-event step time with each SDPA backend allowed alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux import diffusers_config, diffusers_tokens, flux_inputs  # noqa: E402
from memory import random_model_weights, time_step  # noqa: E402

from engine.models.flux import FluxTransformer, flux_dev_config  # noqa: E402
from engine.models.weights import bind_weights  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def median_ms(device: torch.device, call: Callable[[], object], repeats: int = 10) -> float:
    for _ in range(3):
        call()
    return statistics.median(time_step(device, call) for _ in range(repeats))


def kind_of(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "matrix products"
    if any(k in lowered for k in ("flash", "fmha", "attention", "cudnn")):
        return "attention"
    if "elementwise" in lowered or "vectorized" in lowered:
        return "elementwise: " + lowered.split("<")[0][-60:]
    return "other: " + lowered.split("(")[0][:60]


def profile(call: Callable[[], object], label: str) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if us <= 0 or event.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
            continue
        kind = kind_of(event.key)
        totals[kind] += us
        counts[kind] += event.count
    print(f"\n{label}: {sum(totals.values()) / 1e3:.1f} ms of kernels")
    for kind, us in sorted(totals.items(), key=lambda item: -item[1])[:25]:
        print(f"  {us / 1e3:8.2f} ms  {counts[kind]:6d} x  {kind}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-diffusers", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    q, k, v = (torch.randn(1, 24, 4608, 128, device=device, dtype=dtype) for _ in range(3))
    print("SDPA at (1, 24, 4608, 128) bf16:")
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                ms = median_ms(device, lambda: F.scaled_dot_product_attention(q, k, v))
            print(f"  {name:10s} {ms:7.3f} ms  ({4 * 4608**2 * 128 * 24 / ms / 1e9:.0f} TFLOP/s)")
        except RuntimeError as error:
            print(f"  {name:10s} unavailable: {str(error)[:80]}")
    config = flux_dev_config()
    inputs = flux_inputs(config, 128, 512, dtype, device)
    model = FluxTransformer(config, dtype=dtype, device="meta")
    weights = random_model_weights(model, dtype, device)
    bind_weights(model, {name: tensor.to(device) for name, tensor in weights.items()})
    del weights

    def ours() -> object:
        with torch.no_grad():
            return model(*inputs)

    print(f"\nours eager: {median_ms(device, ours, 5):.1f} ms")
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                print(f"  only {name}: {median_ms(device, ours, 5):.1f} ms")
        except RuntimeError as error:
            print(f"  only {name}: unavailable: {str(error)[:80]}")
    profile(ours, "ours, one eager step")
    if args.no_diffusers:
        return 0
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        theirs_model = FluxTransformer2DModel.from_config(diffusers_config(config)).to(dtype).eval()
    _, timesteps, context, y, guidance = inputs
    tokens, img_ids, txt_ids = diffusers_tokens(inputs)

    def theirs() -> object:
        with torch.no_grad():
            return theirs_model(hidden_states=tokens, encoder_hidden_states=context, pooled_projections=y,
                                timestep=timesteps, img_ids=img_ids, txt_ids=txt_ids,
                                guidance=guidance).sample

    print(f"\ndiffusers eager: {median_ms(device, theirs, 5):.1f} ms")
    profile(theirs, "diffusers, one eager step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a ControlNet adds to a sampling step: the UNet alone, ControlNet + UNet through the memory runtime
(each its own module: `diffusion`, `controlnet`), and diffusers' ControlNetModel + UNet2DConditionModel.

    python bench/controlnet_step.py              # on a GPU: SD1.5 512x512 and SDXL 1024x1024, fp16, batch 2
    python bench/controlnet_step.py --budget 3   # also both modules under a 3 GiB ledger (streamed from RAM)
    python bench/controlnet_step.py --tiny       # tiny models on the CPU: checks that the program runs

Random weights (speed does not depend on their values); the hint is 8x the latent. Each row: median of
--steps timings after --warmup (CUDA events on a GPU), and the peak of live tensors. A step here is one
model call of the sampler: the ControlNet's residuals, then the UNet given them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import (  # noqa: E402
    _diffusers_config,
    measure,
    model_cases,
    random_model_weights,
    random_weights,
    unet_inputs,
)

from engine.devices import GIB, device_name  # noqa: E402
from engine.memory.ledger import DeviceLedger  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.models.controlnet import ControlNetConfig, ControlNetModel  # noqa: E402
from engine.models.unet import UNetModel  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.telemetry import EventBus  # noqa: E402

HINT_WIDTHS = (16, 16, 32, 32, 96, 96, 256)  # every released ControlNet's hint encoder


def runtime_step(config, unet_weights, control_weights, inputs, device, budget):
    """(UNet-alone step, ControlNet + UNet step) through one runtime whose ledger holds `budget` bytes."""
    dtype = next(iter(unet_weights.values())).dtype
    bus = EventBus()
    ledger = DeviceLedger(device_name(device), 1 << 50 if budget is None else budget, bus=bus)
    runtime = MemoryRuntime(MemorySettings(), bus=bus, ledgers={ledger.device_name: ledger})
    unet = UNetModel(config, dtype=dtype, device="meta")
    controlnet = ControlNetModel(ControlNetConfig(config, 3, HINT_WIDTHS), dtype=dtype, device="meta")
    home = "device" if budget is None else "cpu"
    unet_name = runtime.register("diffusion", unet, home, ledger.device_name, unet_weights.__getitem__)
    control_name = runtime.register("controlnet", controlnet, home, ledger.device_name,
                                    control_weights.__getitem__)
    x, timesteps, context, y, hint = inputs

    def unet_alone():
        return runtime.run(unet_name, unet, unet.stages(), unet.initial_state(x, timesteps, context, y))["h"]

    def controlled():
        state = runtime.run(control_name, controlnet, controlnet.stages(),
                            controlnet.initial_state(x, hint, timesteps, context, y))
        residuals = controlnet.control_outputs(state)
        return runtime.run(unet_name, unet, unet.stages(),
                           unet.initial_state(x, timesteps, context, y, control=residuals))["h"]

    return runtime, unet_alone, controlled


def diffusers_step(config, inputs, device, dtype):
    from diffusers import ControlNetModel as DiffusersControlNet
    from diffusers import UNet2DConditionModel

    with torch.device(device):
        unet = UNet2DConditionModel.from_config(_diffusers_config(config)).to(dtype).eval()
        controlnet = DiffusersControlNet.from_unet(unet).to(dtype).eval()
    x, timesteps, context, y, hint = inputs
    added = None
    if config.adm_in_channels:
        pooled = config.adm_in_channels - 6 * (256 if config.adm_in_channels > 6 * 256 else 16)
        time_ids = torch.zeros(x.shape[0], 6, device=device, dtype=dtype)
        added = {"text_embeds": y[:, :pooled], "time_ids": time_ids}

    def step():
        down, mid = controlnet(x, timesteps, context, hint, added_cond_kwargs=added, return_dict=False)
        return unet(x, timesteps, context, added_cond_kwargs=added, down_block_additional_residuals=down,
                    mid_block_additional_residual=mid).sample

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=None, help="GiB for both modules (streamed rows)")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda", 0)
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    rows = []
    for name, config, side in model_cases(tiny=args.tiny):
        x, timesteps, context, y = unet_inputs(config, side, dtype, device)
        hint = torch.rand(x.shape[0], 3, side * 8, side * 8, generator=torch.Generator().manual_seed(2))
        inputs = (x, timesteps, context, y, hint.to(device, dtype))
        unet_weights = random_weights(config, dtype, device)
        controlnet = ControlNetModel(ControlNetConfig(config, 3, HINT_WIDTHS), dtype=dtype, device="meta")
        control_weights = random_model_weights(controlnet, dtype, device)
        budgets = [None] + ([int(args.budget * GIB)] if args.budget else [])
        with torch.no_grad():
            for budget in budgets:
                where = "resident" if budget is None else f"{budget / GIB:.2f} GiB"
                runtime, unet_alone, controlled = runtime_step(config, unet_weights, control_weights, inputs,
                                                               device, budget)
                for label, step in ((f"UNet alone, runtime {where}", unet_alone),
                                    (f"ControlNet + UNet, runtime {where}", controlled)):
                    ms, peak, _ = measure(device, step, args.warmup, args.steps, peak_over=1)
                    rows.append((name, label, ms, peak))
                    print(f"| {name} | {label} | {ms:.1f} | {peak:.3f} |", flush=True)
                for module in runtime.modules():
                    runtime.unregister(module)
            try:
                step = diffusers_step(config, inputs, device, dtype)
            except ImportError:
                step = None
            if step is not None:
                ms, peak, _ = measure(device, step, args.warmup, args.steps, peak_over=1)
                rows.append((name, "diffusers ControlNet + UNet", ms, peak))
                print(f"| {name} | diffusers ControlNet + UNet | {ms:.1f} | {peak:.3f} |", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("| model | implementation | ms / step | peak GiB |")
    print("| --- | --- | ---: | ---: |")
    for name, label, ms, peak in rows:
        print(f"| {name} | {label} | {ms:.1f} | {peak:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

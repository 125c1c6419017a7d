"""Where a cold process's first checkpoint load spends its seconds (issue 21: the loader node took 4.5 to
5.8 s of SD1.5's 7.3 s cold image on the H200).

    python3 bench/load_profile.py [--family sd1] [--workdir /tmp/sluice_load]

Writes a random fp16 single-file checkpoint of the family's real layout once (std 1/sqrt(fan_in)), then in
this fresh process times CUDA's initialisation and one `load_checkpoint` onto the first device through the
memory runtime (weights resident), under cProfile: prints the phases and the 25 functions of most cumulative
time. On a CPU the same runs on the CPU device.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.devices import resolve_device  # noqa: E402
from engine.memory.runtime import get_runtime  # noqa: E402
from engine.models.loader import load_checkpoint  # noqa: E402
from tests.engine.models.sd_checkpoints import checkpoint_shapes, save_state_dict  # noqa: E402


def write_checkpoint(path: Path, family: str) -> None:
    generator = torch.Generator().manual_seed(0)
    state = {}
    for key, shape in checkpoint_shapes(family, "full").items():
        fan_in = 1
        for d in shape[1:]:
            fan_in *= d
        drawn = (torch.randn(shape, generator=generator) / fan_in**0.5 if len(shape) > 1
                 else torch.zeros(shape))
        state[key] = drawn.to(torch.float16)
    save_state_dict(path, state, "safetensors")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="sd1", choices=("sd1", "sd2", "sdxl"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/sluice_load"))
    parser.add_argument("--node", action="store_true",
                        help="through the CheckpointLoaderSimple node (auto-fit, placement) instead")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / f"{args.family}_full_fp16.safetensors"
    if not path.exists():
        began = time.perf_counter()
        write_checkpoint(path, args.family)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - began:.1f} s")
    path.read_bytes()  # in the page cache, as the issue measures
    device = resolve_device("auto")
    began = time.perf_counter()
    if device.torch_device.type == "cuda":
        torch.zeros(1, device=device.torch_device)
        torch.cuda.synchronize()
    print(f"device {device.name}: initialised in {time.perf_counter() - began:.2f} s", flush=True)
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    if args.node:
        from engine.graph.spec import RunContext
        from engine.settings import load_settings
        from nodes.loaders import CheckpointLoaderSimple

        models = args.workdir / "models"
        (models / "checkpoints").mkdir(parents=True, exist_ok=True)
        link = models / "checkpoints" / path.name
        if not link.exists():
            link.symlink_to(path)
        ctx = RunContext("1", settings=load_settings(models_root=models, output_dir=args.workdir / "out"))
        bundles = CheckpointLoaderSimple().run(ctx, path.name)
        what = "the CheckpointLoaderSimple node"
    else:
        bundles = load_checkpoint(path, device=device.name, params="device", runtime=get_runtime())
        what = "load_checkpoint"
    if device.torch_device.type == "cuda":
        torch.cuda.synchronize()
    profile.disable()
    print(f"{what}: {time.perf_counter() - began:.2f} s for {len(bundles)} components", flush=True)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

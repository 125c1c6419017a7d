"""Per-stage profile of the SD1.5 and SDXL UNets as the memory runtime measures it on its first two calls of
a shape: each stage's weight bytes, GPU milliseconds and workspace at its peak. The sum of the stage times is
set beside the resident step time (a CUDA graph's replay), which it should approach.

    python3 bench/stage_profile.py [--out DIR]

Writes `stage_profile_<device>_<time>.json` (the rows, for offline planning studies) and prints a table of
the stages grouped by UNet level.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory import (  # noqa: E402
    MIB,
    RESULTS,
    copy_bandwidth,
    measure,
    model_cases,
    random_weights,
    registered_unet,
    release_garbage,
    unet_inputs,
)


def profile(name: str, config: object, side: int, dtype: torch.dtype, device: torch.device) -> dict:
    release_garbage(device)
    weights = random_weights(config, dtype, device)
    inputs = unet_inputs(config, side, dtype, device)
    runtime, module, unet, _, _ = registered_unet(config, weights, device, "device", 1 << 50)
    stages = unet.stages()
    sizes = [stage.parameter_bytes() for stage in stages]

    def step() -> object:
        return runtime.run(module, unet, stages, unet.initial_state(*inputs))["h"]

    began = time.perf_counter()
    step()
    measuring_s = time.perf_counter() - began
    step()  # the second call times the stages again (without the first call's kernel loading)
    measured = runtime.stage_profile(module)
    resident_ms, _, _ = measure(device, step, 3, 10)
    runtime.unregister(module)
    rows = [{"stage": stage.name, "weight_bytes": size, "ms": seconds * 1e3, "workspace_bytes": peak}
            for stage, size, seconds, peak in zip(stages, sizes, measured.seconds, measured.workspace,
                                                   strict=True)]
    return {"model": name, "resident_ms": resident_ms, "measuring_call_s": measuring_s, "stages": rows}


def level(stage: str) -> str:
    """input_blocks.4.1.attn1 -> input_blocks.4"""
    parts = stage.split(".")
    return ".".join(parts[:2]) if parts[0].endswith("blocks") else parts[0]


def print_profile(result: dict) -> None:
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in result["stages"]:
        groups[level(row["stage"])].append(row)
    print(f"\n{result['model']}: {len(result['stages'])} stages")
    print("| stages | count | weight MiB | GPU ms | peak workspace MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for key, rows in groups.items():
        print(f"| {key} | {len(rows)} | {sum(r['weight_bytes'] for r in rows) / MIB:.1f} | "
              f"{sum(r['ms'] for r in rows):.2f} | {max(r['workspace_bytes'] for r in rows) / MIB:.1f} |")
    total_ms = sum(r["ms"] for r in result["stages"])
    print(f"sum of stage GPU times {total_ms:.2f} ms; resident step (graph replay) "
          f"{result['resident_ms']:.2f} ms; the measuring call took {result['measuring_call_s']:.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny UNets in float32: a CPU smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if args.tiny else torch.float16
    results = {"device": str(device), "bandwidth": copy_bandwidth(device), "models": []}
    for name, config, side in model_cases(args.tiny):
        result = profile(name, config, side, dtype, device)
        print_profile(result)
        results["models"].append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = ("tiny_" if args.tiny else "") + device.type
    path = args.out / f"stage_profile_{tag}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

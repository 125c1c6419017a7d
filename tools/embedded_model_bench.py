"""Time and judge the embedded model on this machine: seconds per image and accuracy per attribute.

    .venv/bin/python tools/embedded_model_bench.py [--prompts 40] [--steps 20]

Prompts are one-shape scenes, half of them with colour/shape pairs held out of training; the judge
(tools/shapes_judge.py) measures background, shape colour, position and (where the caption names it) size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.settings import load_settings  # noqa: E402
from tools.embedded_generate import EmbeddedGenerator, judge_prompts  # noqa: E402
from tools.shapes_judge import ATTRIBUTES, judge  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        generator = EmbeddedGenerator(load_settings(output_dir=out), steps=args.steps)
        generator.generate("warm-up", seed=0)
        load_seconds = time.perf_counter() - started
        scores: dict[bool, dict[str, list[bool]]] = {False: {}, True: {}}
        times = []
        for i, prompt in enumerate(judge_prompts(args.prompts)):
            began = time.perf_counter()
            image = generator.generate(prompt.caption, seed=i)
            times.append(time.perf_counter() - began)
            for attribute, ok in judge(image, prompt.scene, check_size=prompt.names_size).items():
                scores[prompt.held_out].setdefault(attribute, []).append(ok)
    times.sort()
    print(f"machine: {torch.get_num_threads()} torch threads; load + first image {load_seconds:.2f} s")
    print(f"seconds per 128x128 image, {args.steps} steps dpm++2m karras cfg 5: "
          f"median {times[len(times) // 2]:.2f}, min {times[0]:.2f}, max {times[-1]:.2f}")
    print()
    print(f"| prompts | {' | '.join(ATTRIBUTES)} |")
    print(f"| --- |{' ---: |' * len(ATTRIBUTES)}")
    for held_out in (False, True):
        row = scores[held_out]
        cells = [f"{sum(row[a]) / len(row[a]):.0%} of {len(row[a])}" if row.get(a) else "-"
                 for a in ATTRIBUTES]
        print(f"| {'held-out pairs' if held_out else 'training pairs'} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

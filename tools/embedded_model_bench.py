"""Time and judge the embedded model on this machine: seconds per image and accuracy per attribute and group.

    .venv/bin/python tools/embedded_model_bench.py [--per-group 48] [--steps 20] [--threads 1]

Prompts are one-shape scenes in three groups (tools/embedded_generate.py, GROUPS): colour/shape pairs seen in
training, pairs held out of training, and seen pairs in wordings that training never uses. Their scene and
sampling seeds are used by no test. The judge (tools/shapes_judge.py) measures background, shape colour,
position, size (where the caption names it) and the shape itself; "all right" counts the prompts whose every
judged attribute is right.
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
from tools.embedded_generate import GROUPS, EmbeddedGenerator, judge_prompts  # noqa: E402
from tools.shapes_judge import ATTRIBUTES, judge  # noqa: E402

PROMPT_SEED = 220_000  # scene and caption seeds: judge_prompts(seed=PROMPT_SEED); tests use 1234
SAMPLE_SEED = 50_000  # sampling seed of prompt i: SAMPLE_SEED + i; tests use 0..15


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-group", type=int, default=48, help="prompts in each group")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, default=5.0, help="guidance scale (the default workflow's: 5)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--models", type=Path, help="a models folder whose sluice-shapes files to judge "
                        "instead of resources/models'")
    parser.add_argument("--misses", type=Path, help="write each missed prompt's image and verdict here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out:
        settings = load_settings(models_root=args.models, output_dir=out)  # searched before resources/models
        started = time.perf_counter()
        generator = EmbeddedGenerator(settings, steps=args.steps, cfg=args.cfg)
        generator.generate("warm-up", seed=0)
        load_seconds = time.perf_counter() - started
        scores: dict[str, dict[str, list[bool]]] = {group: {} for group in GROUPS}
        times = []
        for i, prompt in enumerate(judge_prompts(args.per_group * len(GROUPS), PROMPT_SEED, GROUPS)):
            began = time.perf_counter()
            image = generator.generate(prompt.caption, seed=SAMPLE_SEED + i)
            times.append(time.perf_counter() - began)
            verdict = judge(image, prompt.scene, check_size=prompt.names_size)
            for attribute, ok in verdict.items():
                scores[prompt.group].setdefault(attribute, []).append(ok)
            scores[prompt.group].setdefault("all right", []).append(all(verdict.values()))
            if args.misses and not all(verdict.values()):
                args.misses.mkdir(parents=True, exist_ok=True)
                wrong = "-".join(a for a, ok in verdict.items() if not ok)
                image.save(args.misses / f"{i:03d}-{wrong}.png")
                with (args.misses / "misses.txt").open("a") as f:
                    f.write(f"{i:03d} {prompt.group}: {prompt.caption!r} wrong: {wrong}\n")
    times.sort()
    print(f"machine: {torch.get_num_threads()} torch threads; load + first image {load_seconds:.2f} s")
    print(f"seconds per 128x128 image, {args.steps} steps dpm++2m karras cfg {args.cfg:g}: "
          f"median {times[len(times) // 2]:.2f}, min {times[0]:.2f}, max {times[-1]:.2f}")
    print()
    columns = (*ATTRIBUTES, "all right")
    print(f"| prompts | {' | '.join(columns)} |")
    print(f"| --- |{' ---: |' * len(columns)}")
    for group in GROUPS:
        row = scores[group]
        cells = [f"{sum(row[a]) / len(row[a]):.0%} of {len(row[a])}" if row.get(a) else "-" for a in columns]
        print(f"| {group} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

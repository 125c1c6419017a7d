"""The embedded model draws what its prompts ask for, judged automatically (tools/shapes_judge.py).

16 one-shape prompts, half with colour/shape pairs never seen in training. The thresholds sit well above
chance (background 1/8, colour 1/7, position 1/9, size 1/2) and below what tools/embedded_model_bench.py
measured on 40 prompts (background 100%, colour 95-100%, position 70-75%, size 78-85%).
"""

from __future__ import annotations

import pytest

from engine.settings import load_settings
from tools.embedded_generate import EmbeddedGenerator, judge_prompts
from tools.shapes_dataset import Scene, ShapeSpec, render
from tools.shapes_judge import judge, measure


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    generator = EmbeddedGenerator(load_settings(output_dir=tmp_path_factory.mktemp("out")))
    results = []
    for i, prompt in enumerate(judge_prompts(16)):
        image = generator.generate(prompt.caption, seed=i)
        results.append((prompt, judge(image, prompt.scene, check_size=prompt.names_size)))
    return results


def accuracy(verdicts, attribute: str, held_out: bool | None = None) -> float:
    scores = [v[attribute] for p, v in verdicts if attribute in v and held_out in (None, p.held_out)]
    return sum(scores) / len(scores)


def test_the_judge_scores_the_renderers_own_images_perfectly():
    for prompt in judge_prompts(40):
        assert all(judge(render(prompt.scene), prompt.scene).values()), prompt


def test_the_judge_notices_a_wrong_colour_and_a_wrong_position():
    scene = Scene("blue", (ShapeSpec("circle", "red", "large", "top left"),))
    other = Scene("blue", (ShapeSpec("circle", "yellow", "large", "bottom right"),))
    verdict = judge(render(other), scene)
    assert verdict == {"background": True, "color": False, "position": False, "size": True}
    assert measure(render(Scene("white", ()))).color is None


def test_embedded_model_draws_the_prompted_background_and_colour(verdicts):
    assert accuracy(verdicts, "background") >= 0.9
    assert accuracy(verdicts, "color") >= 0.8


def test_embedded_model_places_and_sizes_the_shape(verdicts):
    assert accuracy(verdicts, "position") >= 0.5
    assert accuracy(verdicts, "size") >= 0.65


def test_embedded_model_generalises_to_held_out_colour_shape_pairs(verdicts):
    assert accuracy(verdicts, "background", held_out=True) >= 0.85
    assert accuracy(verdicts, "color", held_out=True) >= 0.75
    assert accuracy(verdicts, "position", held_out=True) >= 0.4


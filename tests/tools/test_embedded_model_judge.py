"""The embedded model draws what its prompts ask for, judged automatically (tools/shapes_judge.py).

16 one-shape prompts in the data set's training wordings, half with colour/shape pairs never seen in
training. The thresholds sit far above chance (background 1/8, colour 1/7, position 1/9, size 1/2, shape
1/6) and two or three prompts below what the shipped model (issue 22's retrain, session 20) scores on these
16 prompts with torch 2.14 on the CPU: background 15/16, colour 15/16, position 15/16, size 13/13, shape
16/16; held-out pairs: background 7/8, colour 7/8, position 8/8 (the same after session 21's run 5 and
decoder fine-tune). The model before the retrain scored
background 13/16, colour 10/16, position 9/16, shape 14/16 (held-out colour 4/8): it fails each of the
three model tests below.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.settings import load_settings
from tools.embedded_generate import GROUPS, EmbeddedGenerator, judge_prompts
from tools.shapes_dataset import POSITIONS, SHAPES, SIZES, Scene, ShapeSpec, render
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
    for prompt in judge_prompts(60, groups=GROUPS):
        assert all(judge(render(prompt.scene), prompt.scene).values()), prompt


def test_the_judge_notices_a_wrong_colour_position_and_shape():
    scene = Scene("blue", (ShapeSpec("circle", "red", "large", "top left"),))
    other = Scene("blue", (ShapeSpec("ring", "yellow", "large", "bottom right"),))
    verdict = judge(render(other), scene)
    assert verdict == {"background": True, "color": False, "position": False, "size": True, "shape": False}
    assert measure(render(Scene("white", ()))).color is None


def test_the_judge_ignores_stray_corner_pixels():
    scene = Scene("white", (ShapeSpec("circle", "purple", "large", "bottom"),))
    pixels = np.array(render(scene))
    pixels[0, 0] = pixels[-1, -1] = (200, 0, 0)  # the VAE's corner specks
    assert all(judge(pixels, scene).values())


@pytest.mark.parametrize("size", SIZES)
def test_the_judge_reads_each_shape_at_every_place(size):
    for shape in SHAPES:
        for position in POSITIONS:
            scene = Scene("black", (ShapeSpec(shape, "white", size, position),))
            assert measure(render(scene)).shape == shape, scene


def test_judge_prompt_groups_hold_out_pairs_and_wordings():
    prompts = judge_prompts(30, seed=7, groups=GROUPS)
    assert [p.group for p in prompts[:3]] == list(GROUPS)
    assert all(p.held_out == (p.group == "held-out pairs") for p in prompts)
    with pytest.raises(ValueError, match="unknown judge prompt group.*'seen'.*accepted: trained pairs"):
        judge_prompts(3, groups=("seen",))


def test_embedded_model_draws_the_prompted_background_and_colour(verdicts):
    assert accuracy(verdicts, "background") >= 0.8
    assert accuracy(verdicts, "color") >= 0.8


def test_embedded_model_places_and_shapes_the_shape(verdicts):
    assert accuracy(verdicts, "position") >= 0.75
    assert accuracy(verdicts, "size") >= 0.8
    assert accuracy(verdicts, "shape") >= 0.8


def test_embedded_model_generalises_to_held_out_colour_shape_pairs(verdicts):
    assert accuracy(verdicts, "background", held_out=True) >= 0.75
    assert accuracy(verdicts, "color", held_out=True) >= 0.75
    assert accuracy(verdicts, "position", held_out=True) >= 0.75


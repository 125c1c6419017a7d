"""calc_cond_batch and the guided denoisers over several conditioning entries, against ComfyUI's rules
computed by hand in the tests: areas (crop, predict, paste, feathered weights), masks with their strengths,
sigma ranges, the mirroring of areas to the other side, batching by shape and control."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampling.guidance import (
    CFGDenoiser,
    Conditioning,
    calc_cond_batch,
    prepare_sides,
)
from engine.sampling.model_sampling import Denoiser, EpsPrediction
from tests.engine.sampling.conditioning_helpers import Recording, prompt, tiny_unet

TOLERANCE = 1e-5  # float32 sums of a few predictions


def comfy_feather(height: int, width: int, area: tuple[int, int, int, int]) -> np.ndarray:
    """ComfyUI's area weights (strength 1) for an area of a height x width latent, row and column loops."""
    h, w, top, left = area
    mult = np.ones((h, w))
    for size, start, full, axis in ((h, top, height, 0), (w, left, width, 1)):
        ramp = min(8, size // 4)
        for t in range(ramp):
            rate = (1.0 / ramp) * (t + 1)
            if start != 0:
                index = [slice(None), slice(None)]
                index[axis] = slice(t, t + 1)
                mult[tuple(index)] *= rate
            if size + start < full:
                index = [slice(None), slice(None)]
                index[axis] = slice(size - 1 - t, size - t)
                mult[tuple(index)] *= rate
    return mult


def test_an_area_conditioned_cfg_step_is_comfyuis_crop_predict_paste_and_weighted_average():
    torch.manual_seed(0)
    model = Denoiser(tiny_unet(), EpsPrediction())
    height, width, area, strength, cfg = 16, 24, (8, 12, 4, 8), 0.7, 6.0  # ramps of 2 and 3 cells
    x, sigma = torch.randn(1, 4, height, width) * 3, torch.tensor([2.5])
    whole, region, negative = prompt(0.3, seed=1), prompt(-0.2, seed=2), prompt(0.0, seed=3)
    guided = CFGDenoiser(model, [Conditioning(whole), Conditioning(region, area=area, strength=strength)],
                         Conditioning(negative), cfg)
    out = guided(x, sigma)

    with torch.no_grad():  # by hand: each prompt predicted on the whole latent or on the area's crop
        h, w, top, left = area
        crop = x[:, :, top:top + h, left:left + w]
        weight = torch.from_numpy(comfy_feather(height, width, area)).float() * strength  # (h, w)
        pasted_weight = torch.zeros(height, width)
        pasted_weight[top:top + h, left:left + w] = weight

        def side(full_prompt: torch.Tensor, area_prompt: torch.Tensor) -> torch.Tensor:
            total = model(x, sigma, context=full_prompt)
            pasted = torch.zeros_like(x)
            in_area = model(crop, sigma, context=area_prompt)
            pasted[:, :, top:top + h, left:left + w] = in_area * weight
            return (total + pasted) / (1e-37 + 1.0 + pasted_weight), total

        cond, cond_whole = side(whole, region)
        uncond, _ = side(negative, negative)  # ComfyUI gives the negative side an entry of the same area
        expected = uncond + cfg * (cond - uncond)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE, atol=TOLERANCE)
    inside = (slice(None), slice(None), slice(top, top + h), slice(left, left + w))
    assert not torch.allclose(cond[inside], cond_whole[inside], atol=1e-3)  # the area's prompt shows
    torch.testing.assert_close(cond[:, :, :top], cond_whole[:, :, :top])  # and only there


def test_feather_ramps_only_inner_edges_over_at_most_a_quarter_of_the_area():
    x = torch.zeros(1, 1, 40, 40)
    for area in [(36, 40, 0, 0), (16, 16, 10, 12), (40, 6, 0, 34), (40, 40, 0, 0)]:
        # an area entry predicting 1 over a whole-latent one predicting 0: out = w / (1 + w) in the area
        entries = [Conditioning(torch.zeros(1, 1, 2), area=area), Conditioning(torch.ones(1, 1, 2))]
        out = calc_cond_batch(_split_model(), [entries], x, torch.tensor([1.0]))[0][0, 0]
        h, w, top, left = area
        inside = out[top:top + h, left:left + w]
        np.testing.assert_allclose((inside / (1 - inside)).numpy(), comfy_feather(40, 40, area), rtol=1e-5)


def _split_model():
    """x0 = 1 for contexts of zeros, 0 for contexts of ones."""
    return lambda x, s, context=None, **k: (1 - context.mean(dim=(1, 2))).reshape(-1, 1, 1, 1).expand_as(x)


def test_mask_weights_each_cell_by_mask_times_mask_strength_times_strength():
    x = torch.zeros(2, 3, 4, 4)
    mask = torch.rand(1, 4, 4, generator=torch.Generator().manual_seed(0))
    entries = [Conditioning(torch.zeros(1, 1, 2), mask=mask, mask_strength=0.5, strength=3.0),
               Conditioning(torch.ones(1, 1, 2))]
    out = calc_cond_batch(_split_model(), [entries], x, torch.tensor([1.0, 1.0]))[0]
    weight = mask[0] * 0.5 * 3.0  # no feathering with a mask
    expected = weight / (1e-37 + weight + 1.0)
    torch.testing.assert_close(out, expected.expand_as(out), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="does not match the latent"):
        calc_cond_batch(_split_model(), [[Conditioning(torch.zeros(1, 1, 2), mask=torch.ones(1, 3, 3))]], x,
                        torch.tensor([1.0, 1.0]))


def test_masked_area_crops_the_mask_and_skips_the_feather():
    x = torch.zeros(1, 1, 8, 8)
    mask = torch.arange(64.0).reshape(1, 8, 8) / 64
    entries = [Conditioning(torch.zeros(1, 1, 2), mask=mask, area=(4, 4, 2, 3)),
               Conditioning(torch.ones(1, 1, 2))]
    out = calc_cond_batch(_split_model(), [entries], x, torch.tensor([1.0]))[0][0, 0]
    weight = torch.zeros(8, 8)
    weight[2:6, 3:7] = mask[0, 2:6, 3:7]
    torch.testing.assert_close(out, weight / (1e-37 + weight + 1.0))


def test_entries_outside_their_sigma_range_are_not_predicted():
    recorder = Recording()
    always = Conditioning(prompt(0.0))
    early = Conditioning(prompt(1.0), sigma_start=20.0, sigma_end=5.0)
    x = torch.zeros(1, 4, 8, 8)
    for sigma, expected_prompts in ((10.0, 2), (25.0, 1), (2.0, 1), (5.0, 2), (20.0, 2)):
        recorder.calls.clear()
        calc_cond_batch(recorder, [[always, early]], x, torch.tensor([sigma]))
        assert recorder.calls[0]["shape"][0] == expected_prompts, sigma


def test_contexts_batch_when_their_lengths_lcm_is_at_most_four_times_the_shorter():
    recorder = Recording()
    x = torch.zeros(1, 4, 8, 8)
    calc_cond_batch(recorder, [[Conditioning(prompt(0, 77))], [Conditioning(prompt(1, 154))]], x,
                    torch.ones(1))
    assert [c["shape"][0] for c in recorder.calls] == [2] and recorder.calls[0]["context"].shape[1] == 154
    recorder.calls.clear()
    calc_cond_batch(recorder, [[Conditioning(prompt(0, 77))], [Conditioning(prompt(1, 385))]], x,
                    torch.ones(1))
    assert [c["shape"][0] for c in recorder.calls] == [1, 1]  # 385 / 77 = 5 > 4: two calls
    recorder.calls.clear()
    calc_cond_batch(recorder, [[Conditioning(prompt(0)), Conditioning(prompt(1), area=(4, 4, 0, 0))]], x,
                    torch.ones(1))
    assert [c["shape"] for c in recorder.calls] == [(1, 4, 8, 8), (1, 4, 4, 4)]


def test_a_side_that_does_not_run_predicts_zeros_and_batch_one_contexts_repeat_over_the_latent_batch():
    recorder = Recording()
    x = torch.randn(3, 4, 8, 8)
    cond, uncond = calc_cond_batch(recorder, [[Conditioning(prompt(0.5))], None], x, torch.ones(3))
    assert torch.equal(uncond, torch.zeros_like(x)) and recorder.calls[0]["context"].shape[0] == 3
    torch.testing.assert_close(cond, Recording()(x, torch.ones(3), context=prompt(0.5).repeat(3, 1, 1)))


def test_areas_are_mirrored_to_the_other_side_with_its_smallest_enclosing_entry():
    big, small = (16, 16, 0, 0), (4, 4, 2, 2)
    positive = [Conditioning(prompt(0)), Conditioning(prompt(1), area=small, strength=0.5, sigma_start=3.0)]
    negative = [Conditioning(prompt(2)), Conditioning(prompt(3), area=big),
                Conditioning(prompt(4), area=(6, 6, 1, 1))]
    cond, uncond = prepare_sides([positive, negative])
    added = uncond[3:]
    assert len(added) == 1 and added[0].area == small and added[0].strength == 0.5
    assert added[0].sigma_start == 3.0 and torch.equal(added[0].context, prompt(4))  # (6, 6) encloses it
    # the negative areas come back to the positive side, with the whole-latent positive prompt
    assert [e.area for e in cond[2:]] == [big, (6, 6, 1, 1)]
    assert all(torch.equal(e.context, prompt(0)) for e in cond[2:])
    again = prepare_sides([[Conditioning(prompt(0), area=small)], [Conditioning(prompt(1), area=small)]])
    assert [len(side) for side in again] == [1, 1]  # an equal area is not added twice


class FakeControl:
    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[tuple] = []

    def get_control(self, x, sigma, inputs, chunks):
        self.seen.append((tuple(x.shape), chunks, inputs["context"].shape[0]))
        return self.name


def test_entries_batch_only_with_their_own_control_which_reaches_the_model_call():
    recorder = Recording()
    first, second = FakeControl("a"), FakeControl("b")
    x = torch.zeros(2, 4, 8, 8)
    sides = [[Conditioning(prompt(0), control=first), Conditioning(prompt(1), control=second)],
             [Conditioning(prompt(2), control=first)]]
    calc_cond_batch(recorder, sides, x, torch.ones(2))
    assert [(c["shape"][0], c.get("control")) for c in recorder.calls] == [(4, "a"), (2, "b")]
    assert first.seen == [((4, 4, 8, 8), 2, 4)]


def test_a_positive_control_marked_for_the_negative_side_is_handed_to_its_entries_without_area():
    control = FakeControl("c")
    positive = [Conditioning(prompt(0), control=control, control_apply_to_uncond=True)]
    negative = [Conditioning(prompt(1)), Conditioning(prompt(2), area=(4, 4, 0, 0))]
    _, uncond = prepare_sides([positive, negative])
    assert uncond[0].control is control and uncond[1].control is None
    _, kept = prepare_sides([positive, [Conditioning(prompt(1), control=FakeControl("own"))]])
    assert kept[0].control.name == "own"


def test_guidance_fills_entries_without_one_and_y_must_be_on_every_entry_or_none():
    cond, uncond = prepare_sides([[Conditioning(prompt(0), guidance=4.0)], [Conditioning(prompt(1))]])
    assert uncond[0].guidance == 4.0
    with pytest.raises(ValueError, match="y"):
        prepare_sides([[Conditioning(prompt(0), y=torch.ones(1, 3))], [Conditioning(prompt(1))]])


def test_inpainting_channels_are_cropped_to_the_area_and_follow_the_scaled_input():
    seen = []

    def unet(x_in, timesteps, context, y=None):
        seen.append(x_in.clone())
        return x_in[:, :4]

    model = Denoiser(unet, EpsPrediction())
    x, concat = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 8, 8)
    entries = [Conditioning(prompt(0), concat=concat),
               Conditioning(prompt(1), concat=concat, area=(4, 4, 2, 3))]
    calc_cond_batch(model, [entries], x, torch.tensor([2.0]))
    assert [tuple(s.shape) for s in seen] == [(1, 9, 8, 8), (1, 9, 4, 4)]
    torch.testing.assert_close(seen[0][:, :4], x / 5 ** 0.5)  # the latent scaled as the model sees it
    torch.testing.assert_close(seen[1][:, 4:], concat[:, :, 2:6, 3:7])

"""engine.models.control: ComfyUI's control semantics written down by hand (broadcast_image_to,
control_merge, the step range), and a T2I-Adapter through the sampler checked against the UNet given the
features directly."""

from __future__ import annotations

import pytest
import torch

from engine.models.bundles import DiffusionModel
from engine.models.control import ControlModel, broadcast_image_to, merge_controls
from engine.models.t2i_adapter import T2IAdapterConfig, T2IAdapterModel
from engine.models.unet import UNetModel
from engine.sampling.guidance import Conditioning
from engine.sampling.model_sampling import EpsPrediction
from engine.sampling.noise import prepare_noise
from engine.sampling.sample import sample
from tests.engine.models.control_checkpoints import init_random_, relative_l2, unet_config


def rows(tensor: torch.Tensor) -> list[int]:
    return tensor[:, 0, 0, 0].int().tolist()


def test_broadcast_image_to_follows_comfyui():
    hints = torch.arange(3.0)[:, None, None, None].expand(3, 1, 2, 2)  # rows 0, 1, 2
    assert rows(broadcast_image_to(hints[:1], 4, 2)) == [0]  # a batch of one broadcasts as it is
    assert rows(broadcast_image_to(hints[:2], 4, 2)) == [0, 1, 0, 1]  # per conditioning, repeated
    assert rows(broadcast_image_to(hints, 4, 2)) == [0, 1, 0, 1]  # cut to the latent batch first
    assert rows(broadcast_image_to(hints[:2], 3, 1)) == [0, 1, 0]  # cycled to a longer batch
    assert rows(broadcast_image_to(hints, 6, 2)) == [0, 1, 2, 0, 1, 2]


def test_merge_scales_then_adds_the_previous_controls_entry_by_entry():
    one, two = torch.ones(1, 1, 2, 2), torch.full((1, 1, 2, 2), 2.0)
    own = {"output": [one, None], "middle": [two]}
    previous = {"input": [one], "middle": [one], "output": [None, two, one]}
    merged = merge_controls(own, previous, 0.5, False, None)
    assert merged["input"] == [one]  # taken over from the previous control
    assert torch.equal(merged["middle"][0], one + two * 0.5)
    assert torch.equal(merged["output"][0], one * 0.5)  # previous None: own kept
    assert torch.equal(merged["output"][1], two)  # own None: previous taken
    assert torch.equal(merged["output"][2], one)  # beyond own's list: appended
    ramp = torch.arange(4.0).reshape(1, 1, 2, 2)
    pooled = merge_controls({"output": [ramp]}, None, 2.0, True, torch.float16)["output"][0]
    assert pooled.dtype == torch.float16
    assert torch.equal(pooled, torch.full((1, 1, 2, 2), 3.0, dtype=torch.float16))


def adapter_setup(strength: float, percent_range=(0.0, 1.0)):
    """A tiny SD1-like UNet (four levels of two ResBlocks) as a MODEL and a full T2I-Adapter control."""
    unet = UNetModel(unet_config(channel_mult=(1, 1, 2, 2), num_res_blocks=2, attention_levels=(0, 1, 2),
                                 transformer_depth=(1, 1, 1, 0)), device="cpu").eval()
    init_random_(unet, seed=1)
    model = DiffusionModel(unet=unet, model_sampling=EpsPrediction(), family="sd1", latent_channels=4,
                           latent_scale=1.0, latent_shift=0.0, compute_device="cpu")
    adapter = T2IAdapterModel(T2IAdapterConfig("full", 1, (32, 32, 64, 64), 2), device="cpu").eval()
    init_random_(adapter, seed=2)
    image = torch.rand(1, 120, 136, 3, generator=torch.Generator().manual_seed(3))  # (B, H, W, C) in 0..1
    control = ControlModel(adapter, "cpu").apply(image, strength, percent_range)
    return model, adapter, control, image


def entries(model: DiffusionModel, control) -> tuple[list[Conditioning], list[Conditioning]]:
    generator = torch.Generator().manual_seed(4)
    positive = [[torch.randn(1, 7, 32, generator=generator), {"control": control}]]
    negative = [[torch.randn(1, 7, 32, generator=generator), {"control": control}]]
    return (model.guidance_conditioning(positive, 128, 128), model.guidance_conditioning(negative, 128, 128))


def test_adapter_features_reach_the_unet_through_the_sampler():
    """One euler step from sigma_max is the guided x0 of the first call: the UNet given the adapter's
    features (hint centre-cropped to the latent's square, nearest-exact, averaged to one channel) times the
    strength."""
    strength, cfg = 0.7, 4.0
    model, adapter, control, image = adapter_setup(strength)
    positive, negative = entries(model, control)
    assert positive[0].control is negative[0].control  # one binding: both sides run in one batched call
    latent = torch.zeros(1, 4, 16, 16)
    got = sample(model.denoiser(), latent, positive, negative, cfg, "euler", "normal", 1, seed=9)
    square = image[:, :, 8:128].movedim(-1, 1)  # (1, 3, 120, 120): the centre of the 136 px width
    hint = torch.nn.functional.interpolate(square, size=(128, 128), mode="nearest-exact")
    hint = hint.mean(1, keepdim=True)  # (1, 1, 128, 128): the adapter takes one channel
    sigma = model.model_sampling.sigma_max
    x = prepare_noise(latent, 9) * (1 + sigma ** 2) ** 0.5
    with torch.no_grad():
        features = adapter(hint)
        scaled = {kind: [None if f is None else f * strength for f in values]
                  for kind, values in features.items()}

        def guided(control) -> torch.Tensor:
            x0 = [x - model.unet(x / (1 + sigma ** 2) ** 0.5, torch.tensor([999.0]), entry[0].context,
                                 control=control) * sigma for entry in (positive, negative)]
            return x0[1] + (x0[0] - x0[1]) * cfg

        expected, without = guided(scaled), guided(None)
    assert relative_l2(got, expected) <= 1e-5  # float32: batched sides, cfg 4 scales the noise
    assert relative_l2(without, expected) > 1e-3


def test_the_step_range_switches_the_control_off_outside_it():
    model, _, control, _ = adapter_setup(1.0, (0.25, 0.5))
    bound = entries(model, control)[0][0].control
    sampling = model.model_sampling
    x = torch.zeros(1, 4, 16, 16)
    inputs = {"context": torch.zeros(1, 7, 32), "y": None}
    for percent, active in ((0.1, False), (0.3, True), (0.45, True), (0.6, False)):
        sigma = torch.tensor([sampling.percent_to_sigma(percent)])
        assert (bound.get_control(x, sigma, inputs, 1) is not None) == active


def test_an_adapter_for_another_unet_is_refused():
    model, _, _, image = adapter_setup(1.0)
    xl = T2IAdapterModel(T2IAdapterConfig("full_xl", 3, (32, 64, 64, 64), 2), device="meta")
    control = ControlModel(xl, "cpu").apply(image, 1.0)
    with pytest.raises(ValueError, match="full_xl T2I-Adapter .* does not fit the sd1 model"):
        entries(model, control)

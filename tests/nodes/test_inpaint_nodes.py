"""Inpainting end to end on tiny random UNets: the noise mask in KSampler, KSamplerAdvanced, SamplerCustom and
SamplerCustomAdvanced (the masked-out latent comes back as it went in), VAEEncodeForInpaint and
InpaintModelConditioning against ComfyUI's pixel and mask handling written down by hand (bilinear mask to
the image, centre crop to whole cells, grey 0.5 under the rounded mask, grow_mask_by's box), and the
channels a 9-channel inpainting UNet receives (ComfyUI's concat_cond: rounded mask, then the masked image's
latent in the model's space); and a latent taken from a batch sampled with the noise it had there."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.graph.spec import RunContext
from engine.models.bundles import DiffusionModel, VAEModel
from engine.models.detect import UNetConfig
from engine.models.unet import UNetModel
from engine.sampling.inpaint import BLANK_INPAINT_LATENT
from engine.sampling.model_sampling import EpsPrediction
from nodes import custom_sampling as cs
from nodes.inpaint import InpaintModelConditioning, VAEEncodeForInpaint
from nodes.latent_ops import LatentFromBatch
from nodes.model_patches import PerpNegGuider
from nodes.sampling import KSampler, KSamplerAdvanced

SCALE = 0.18215
CONTEXT_DIM = 32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_unet(in_channels: int, seed: int = 0) -> UNetModel:
    """An SD1-shaped UNet of a few hundred kB with weights of scale 1/sqrt(fan_in)."""
    config = UNetConfig(in_channels=in_channels, out_channels=4, model_channels=32, channel_mult=(1, 2),
                        num_res_blocks=1, attention_levels=(0, 1), transformer_depth=(1, 1),
                        transformer_depth_middle=1, num_heads=2, num_head_channels=-1,
                        context_dim=CONTEXT_DIM, use_linear_in_transformer=False, adm_in_channels=None,
                        num_classes=None, prediction="eps", family="sd1")
    unet = UNetModel(config, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in unet.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.ndim >= 2:
                parameter.copy_(noise / parameter[0].numel() ** 0.5)
            else:
                parameter.copy_(1.0 * name.endswith("weight") + 0.1 * noise)
    return unet.eval()


@dataclass
class SpyModel(DiffusionModel):
    """A DiffusionModel that records every network input x (B, C_in, h, w)."""

    seen: list = field(default_factory=list)

    def apply(self, x, timesteps, context, y=None, guidance=None):
        self.seen.append(x.clone())
        return super().apply(x, timesteps, context, y, guidance)


def diffusion_model(in_channels: int = 4) -> SpyModel:
    return SpyModel(unet=tiny_unet(in_channels), model_sampling=EpsPrediction(), family="sd1",
                    latent_channels=4, latent_scale=SCALE, latent_shift=0.0, compute_device="cpu")


@pytest.fixture(scope="module")
def plain_model() -> SpyModel:
    return diffusion_model(4)


@pytest.fixture(scope="module")
def inpaint_model() -> SpyModel:
    return diffusion_model(9)


class StubVAE(VAEModel):
    """A VAE whose encoder averages 8 x 8 pixel cells (channels R, G, B and their mean), recording the
    pixels it is given in 0..1 (B, H, W, 3)."""

    def __init__(self) -> None:
        config = SimpleNamespace(ch_mult=(1, 2, 4, 4), embed_dim=4)
        autoencoder = SimpleNamespace(config=config, dtype=torch.float32)
        super().__init__(autoencoder=autoencoder, compute_device="cpu")
        self.encoded: list[torch.Tensor] = []

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        self.encoded.append(((pixels + 1.0) / 2.0).permute(0, 2, 3, 1))
        cells = F.avg_pool2d(pixels, 8)  # (B, 3, h, w)
        return torch.cat([cells, cells.mean(dim=1, keepdim=True)], dim=1)


def stub_latent(pixels: torch.Tensor) -> torch.Tensor:
    """What StubVAE encodes (1, H, W, 3) pixels in 0..1 to."""
    cells = F.avg_pool2d(pixels.permute(0, 3, 1, 2) * 2.0 - 1.0, 8)
    return torch.cat([cells, cells.mean(dim=1, keepdim=True)], dim=1)


def prompt(value: float) -> list:
    return [[torch.full((1, 77, CONTEXT_DIM), value), {"pooled_output": None}]]


def ctx() -> RunContext:
    return RunContext("test", report_progress=lambda value, total: None, report_preview=lambda image: None)


def hole_mask() -> torch.Tensor:
    """(1, 64, 64): 1 in pixels 16..47 (latent cells 2..5), 0 around."""
    mask = torch.zeros(1, 64, 64)
    mask[:, 16:48, 16:48] = 1.0
    return mask


def masked_latent(seed: int = 5) -> dict[str, torch.Tensor]:
    samples = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed)) / SCALE  # raw VAE space
    return {"samples": samples, "noise_mask": hole_mask()[:, None]}


KEEP = torch.ones(8, 8, dtype=torch.bool)
KEEP[2:6, 2:6] = False  # the latent cells outside the hole


def assert_kept_outside_the_hole(out: torch.Tensor, latent: torch.Tensor) -> None:
    outside, inside = (out - latent)[..., KEEP], (out - latent)[..., ~KEEP]
    assert outside.abs().max() < 1e-4 * latent.abs().max()
    assert inside.abs().max() > 0.1


def test_ksampler_keeps_the_latent_outside_the_noise_mask(plain_model):
    latent = masked_latent()
    for sampler in ("euler", "dpmpp_2m", "euler_ancestral", "ddim"):
        (out,) = KSampler().run(ctx(), plain_model, 3, 4, 6.0, sampler, "karras", prompt(0.5), prompt(-0.5),
                                latent, 1.0)
        assert_kept_outside_the_hole(out["samples"], latent["samples"])
        assert torch.equal(out["noise_mask"], latent["noise_mask"])  # the LATENT's other keys stay
    (plain,) = KSampler().run(ctx(), plain_model, 3, 4, 6.0, "euler", "karras", prompt(0.5), prompt(-0.5),
                              {"samples": latent["samples"]}, 1.0)
    assert (plain["samples"] - latent["samples"])[..., KEEP].abs().max() > 0.1  # no mask: all resampled


def test_ksampler_advanced_keeps_it_over_a_range_of_steps_without_added_noise(plain_model):
    latent = masked_latent()
    (out,) = KSamplerAdvanced().run(ctx(), plain_model, "disable", 3, 6, 6.0, "euler", "normal", prompt(0.5),
                                    prompt(-0.5), latent, 2, 10000, "disable")
    assert_kept_outside_the_hole(out["samples"], latent["samples"])


def test_custom_samplers_keep_the_latent_outside_the_noise_mask(plain_model):
    latent = masked_latent()
    (sigmas,) = cs.BasicScheduler().run(None, plain_model, "karras", 4, 1.0)
    (sampler,) = cs.KSamplerSelect().run(None, "dpmpp_2m_sde")
    out, denoised = cs.SamplerCustom().run(ctx(), plain_model, True, 3, 6.0, prompt(0.5), prompt(-0.5),
                                           sampler, sigmas, latent)
    assert_kept_outside_the_hole(out["samples"], latent["samples"])
    assert torch.allclose(denoised["samples"][..., KEEP], latent["samples"][..., KEEP], rtol=1e-5)
    (guider,) = cs.CFGGuider().run(None, plain_model, prompt(0.5), prompt(-0.5), 6.0)
    (noise,) = cs.RandomNoise().run(None, 3)
    out, _ = cs.SamplerCustomAdvanced().run(ctx(), noise, guider, sampler, sigmas, latent)
    assert_kept_outside_the_hole(out["samples"], latent["samples"])


def test_the_custom_sampler_gives_the_ksampler_latent_with_a_mask(plain_model):
    latent = masked_latent()
    (ksampler,) = KSampler().run(ctx(), plain_model, 3, 4, 6.0, "ddim", "karras", prompt(0.5), prompt(-0.5),
                                 latent, 1.0)
    (sigmas,) = cs.BasicScheduler().run(None, plain_model, "karras", 4, 1.0)
    (guider,) = cs.CFGGuider().run(None, plain_model, prompt(0.5), prompt(-0.5), 6.0)
    out, _ = cs.SamplerCustomAdvanced().run(ctx(), cs.RandomNoise().run(None, 3)[0], guider,
                                            cs.KSamplerSelect().run(None, "ddim")[0], sigmas, latent)
    assert torch.equal(out["samples"], ksampler["samples"])


def image(height: int, width: int) -> torch.Tensor:
    """(1, H, W, 3): a distinct value per pixel and channel, in 0..1."""
    values = torch.arange(height * width * 3, dtype=torch.float32).reshape(1, height, width, 3)
    return values / values.max()


def test_vae_encode_for_inpaint_crops_greys_and_grows_as_comfyui():
    pixels = image(20, 18)  # cropped to 16 x 16 from row 2, column 1
    mask = torch.zeros(1, 20, 18)
    mask[0, 7, 6] = 0.6  # rounds to 1: greyed and grown
    mask[0, 12, 12] = 0.4  # rounds to 0: kept
    vae = StubVAE()
    (latent,) = VAEEncodeForInpaint().run(ctx(), pixels, vae, mask, 6)
    greyed = pixels[:, 2:18, 1:17].clone()
    greyed[0, 5, 5] = 0.5  # pixel (7, 6) of the image is (5, 5) of the crop
    assert torch.allclose(vae.encoded[0], greyed)
    grown = torch.zeros(1, 1, 16, 16)
    grown[0, 0, 3:9, 3:9] = 1.0  # a 6 x 6 box, padding 3: rows and columns j - 2 .. j + 3 of pixel j = 5
    assert torch.equal(latent["noise_mask"], grown)
    assert latent["samples"].shape == (1, 4, 2, 2)
    (odd,) = VAEEncodeForInpaint().run(ctx(), pixels, StubVAE(), mask, 3)
    grown = torch.zeros(1, 1, 16, 16)
    grown[0, 0, 4:7, 4:7] = 1.0  # 3 x 3, centred
    assert torch.equal(odd["noise_mask"], grown)
    (none,) = VAEEncodeForInpaint().run(ctx(), pixels, StubVAE(), mask, 0)
    assert none["noise_mask"].sum() == 1 and none["noise_mask"][0, 0, 5, 5] == 1  # the rounded mask itself


def test_vae_encode_for_inpaint_resizes_the_mask_bilinearly_to_the_image():
    mask = torch.zeros(1, 8, 8)
    mask[0, 2:6, 2:6] = 1.0
    vae = StubVAE()
    (latent,) = VAEEncodeForInpaint().run(ctx(), image(16, 16), vae, mask, 0)
    expected = F.interpolate(mask[:, None], size=(16, 16), mode="bilinear").round()
    assert torch.equal(latent["noise_mask"], expected)
    assert torch.equal(vae.encoded[0][0, 5:11, 5:11], torch.full((6, 6, 3), 0.5))  # the resized mask >= .5


def test_inpaint_model_conditioning_is_comfyui():
    pixels = image(20, 18)
    mask = torch.zeros(1, 20, 18)
    mask[0, 2:10, 1:9] = 0.7
    vae = StubVAE()
    positive, negative = prompt(0.5), prompt(-0.5)
    new_positive, new_negative, latent = InpaintModelConditioning().run(ctx(), positive, negative, vae,
                                                                        pixels, mask, True)
    greyed = pixels[:, 2:18, 1:17].clone()
    greyed[0, 0:8, 0:8] = 0.5
    assert torch.allclose(vae.encoded[0], greyed)  # the concat latent: the greyed crop
    assert torch.allclose(vae.encoded[1], pixels[:, 2:18, 1:17])  # the latent: the whole image (VAE crop)
    cut_mask = mask[:, None, 2:18, 1:17]
    for before, after in ((positive, new_positive), (negative, new_negative)):
        assert after[0][0] is before[0][0] and after[0][1] is not before[0][1]
        assert set(before[0][1]) == {"pooled_output"}  # the input is not written to
        assert torch.equal(after[0][1]["concat_mask"], cut_mask)  # unrounded, pixel size
        assert torch.allclose(after[0][1]["concat_latent_image"], stub_latent(greyed))
    assert torch.equal(latent["noise_mask"], cut_mask)
    assert torch.allclose(latent["samples"], stub_latent(pixels[:, 2:18, 1:17]))
    _, _, no_mask = InpaintModelConditioning().run(ctx(), positive, negative, StubVAE(), pixels, mask, False)
    assert "noise_mask" not in no_mask


def left_half_mask() -> torch.Tensor:
    """(1, 64, 64): 1 on the left half (latent columns 0..3)."""
    mask = torch.zeros(1, 64, 64)
    mask[:, :, :32] = 1.0
    return mask


def extra_channels(model: SpyModel) -> torch.Tensor:
    """The 5 extra channels of every recorded network input, checked equal across calls: (B, 5, h, w)."""
    first = model.seen[0][:, 4:]
    assert all(torch.equal(x[:, 4:], first) for x in model.seen)
    return first


def test_an_inpainting_unet_gets_inpaint_model_conditionings_mask_and_masked_image_latent(inpaint_model):
    vae = StubVAE()
    positive, negative, latent = InpaintModelConditioning().run(ctx(), prompt(0.5), prompt(-0.5), vae,
                                                                image(64, 64), left_half_mask(), True)
    inpaint_model.seen.clear()
    (out,) = KSampler().run(ctx(), inpaint_model, 1, 2, 5.0, "euler", "normal", positive, negative, latent,
                            1.0)
    extra = extra_channels(inpaint_model)
    assert extra.shape == (2, 5, 8, 8)  # cond and uncond rows
    mask = torch.zeros(8, 8)
    mask[:, :4] = 1.0
    assert torch.equal(extra[:, 0], mask.expand(2, 8, 8))
    assert torch.allclose(extra[:, 1:], (positive[0][1]["concat_latent_image"] * SCALE).expand(2, 4, 8, 8))
    assert (out["samples"] - latent["samples"])[..., 4:].abs().max() < 1e-4  # the right half is kept


def test_an_inpainting_unet_takes_the_noise_mask_and_latent_without_concat_conditioning(inpaint_model):
    vae = StubVAE()
    (latent,) = VAEEncodeForInpaint().run(ctx(), image(64, 64), vae, left_half_mask(), 0)
    inpaint_model.seen.clear()
    KSampler().run(ctx(), inpaint_model, 1, 2, 5.0, "euler", "normal", prompt(0.5), prompt(-0.5), latent, 1.0)
    extra = extra_channels(inpaint_model)
    mask = torch.zeros(8, 8)
    mask[:, :4] = 1.0
    assert torch.equal(extra[:, 0], mask.expand(2, 8, 8))
    assert torch.allclose(extra[:, 1:], (latent["samples"] * SCALE).expand(2, 4, 8, 8))
    inpaint_model.seen.clear()
    KSampler().run(ctx(), inpaint_model, 1, 2, 5.0, "euler", "normal", prompt(0.5), prompt(-0.5),
                   {"samples": latent["samples"]}, 1.0)
    extra = extra_channels(inpaint_model)  # no mask anywhere: ones and the blank latent
    assert torch.equal(extra[:, 0], torch.ones(2, 8, 8))
    assert torch.equal(extra[:, 1:, 3, 3], torch.tensor(BLANK_INPAINT_LATENT).expand(2, 4))


def test_a_plain_unet_ignores_the_inpainting_conditioning(plain_model):
    positive, negative, latent = InpaintModelConditioning().run(ctx(), prompt(0.5), prompt(-0.5), StubVAE(),
                                                                image(64, 64), left_half_mask(), True)
    plain_model.seen.clear()
    KSampler().run(ctx(), plain_model, 1, 2, 5.0, "euler", "normal", positive, negative, latent, 1.0)
    assert all(x.shape[1] == 4 for x in plain_model.seen)


def test_custom_sampling_feeds_the_inpainting_unet_too(inpaint_model):
    positive, negative, latent = InpaintModelConditioning().run(ctx(), prompt(0.5), prompt(-0.5), StubVAE(),
                                                                image(64, 64), left_half_mask(), True)
    inpaint_model.seen.clear()
    (sigmas,) = cs.BasicScheduler().run(None, inpaint_model, "normal", 2, 1.0)
    (guider,) = cs.CFGGuider().run(None, inpaint_model, positive, negative, 5.0)
    cs.SamplerCustomAdvanced().run(ctx(), cs.RandomNoise().run(None, 1)[0], guider,
                                   cs.KSamplerSelect().run(None, "euler")[0], sigmas, latent)
    assert torch.equal(extra_channels(inpaint_model)[:, 0, :, :4], torch.ones(2, 8, 4))


def test_an_unknown_extra_channel_count_is_refused_clearly():
    model = diffusion_model(8)
    with pytest.raises(ValueError, match="takes 8 input channels; accepted: 4 .* or 9"):
        KSampler().run(ctx(), model, 1, 2, 5.0, "euler", "normal", prompt(0.5), prompt(-0.5),
                       {"samples": torch.zeros(1, 4, 8, 8)}, 1.0)



def test_samplers_give_a_latent_from_a_batch_the_noise_it_had_in_the_batch(plain_model):
    """LatentFromBatch's batch_index, as ComfyUI's prepare_noise with noise_inds: KSampler, SamplerCustom."""
    batch = {"samples": torch.zeros(3, 4, 8, 8)}
    (whole,) = KSampler().run(ctx(), plain_model, 4, 2, 5.0, "euler", "normal", prompt(0.5), prompt(-0.5),
                              batch, 1.0)
    (third,) = LatentFromBatch().run(ctx(), batch, 2, 1)
    (alone,) = KSampler().run(ctx(), plain_model, 4, 2, 5.0, "euler", "normal", prompt(0.5), prompt(-0.5),
                              third, 1.0)
    assert torch.allclose(alone["samples"], whole["samples"][2:], rtol=1e-4, atol=1e-3)
    (sigmas,) = cs.BasicScheduler().run(None, plain_model, "normal", 2, 1.0)
    out, _ = cs.SamplerCustom().run(ctx(), plain_model, True, 4, 5.0, prompt(0.5), prompt(-0.5),
                                    cs.KSamplerSelect().run(None, "euler")[0], sigmas, third)
    assert torch.allclose(out["samples"], whole["samples"][2:], rtol=1e-4, atol=1e-3)
    assert not torch.allclose(whole["samples"][1:2], whole["samples"][2:], rtol=1e-2)


def test_every_guider_feeds_the_inpainting_unet(inpaint_model):
    positive, negative, latent = InpaintModelConditioning().run(ctx(), prompt(0.5), prompt(-0.5), StubVAE(),
                                                                image(64, 64), left_half_mask(), True)
    (sigmas,) = cs.BasicScheduler().run(None, inpaint_model, "normal", 2, 1.0)
    (guider,) = PerpNegGuider().run(None, inpaint_model, positive, negative, prompt(0.0), 5.0, 1.0)
    inpaint_model.seen.clear()
    cs.SamplerCustomAdvanced().run(ctx(), cs.RandomNoise().run(None, 1)[0], guider,
                                   cs.KSamplerSelect().run(None, "euler")[0], sigmas, latent)
    mask = torch.zeros(8, 8)
    mask[:, :4] = 1.0
    for x in inpaint_model.seen:  # the empty prompt has no concat options: the noise mask and the latent
        assert x.shape[1] == 9 and torch.equal(x[:, 4], mask.expand(x.shape[0], 8, 8))

"""The image and mask nodes against values worked out by hand and against numpy re-derivations that follow
ComfyUI's code step by step (loops where ComfyUI loops), not the code under test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from engine.graph.spec import RunContext
from engine.settings import load_settings
from nodes import image_ops as io
from nodes import masks as mk

CTX = RunContext("test")


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def test_invert_batch_crop_and_empty_image_by_hand():
    image = rand(1, 4, 6, 3)
    assert torch.equal(io.ImageInvert().run(CTX, image)[0], 1.0 - image)
    other = rand(2, 4, 6, 3, seed=1)
    batch = io.ImageBatch().run(CTX, image, other)[0]
    assert batch.shape == (3, 4, 6, 3) and torch.equal(batch[1:], other)
    big = rand(1, 8, 12, 3, seed=2)  # same aspect: resized bilinearly, nothing cropped
    expected = F.interpolate(big.permute(0, 3, 1, 2), size=(4, 6), mode="bilinear").permute(0, 2, 3, 1)
    assert torch.allclose(io.ImageBatch().run(CTX, image, big)[0][1:], expected, atol=1e-6)
    crop = io.ImageCrop().run(CTX, image, 3, 2, 1, 1)[0]
    assert torch.equal(crop, image[:, 1:3, 1:4])
    clamped = io.ImageCrop().run(CTX, image, 512, 512, 10, 10)[0]  # x, y beyond: last column and row
    assert torch.equal(clamped, image[:, 3:4, 5:6])
    empty = io.EmptyImage().run(CTX, 5, 3, 2, 0x336699)[0]
    assert empty.shape == (2, 3, 5, 3)
    assert torch.allclose(empty[1, 2, 4], torch.tensor([0x33, 0x66, 0x99]) / 255.0)
    assert io.EmptyImage.inputs[3].default == 0 and io.EmptyImage.inputs[3].max == 0xFFFFFF


def reference_composite(destination: np.ndarray, source: np.ndarray, x: int, y: int,
                        mask: np.ndarray | None) -> np.ndarray:
    """ComfyUI's composite at multiplier 1, pixel by pixel (mask already the source's size)."""
    out = destination.copy()
    for b in range(out.shape[0]):
        src = source[b % source.shape[0]]
        for i in range(src.shape[0]):
            for j in range(src.shape[1]):
                if y + i < out.shape[1] and x + j < out.shape[2]:
                    m = 1.0 if mask is None else mask[min(b, mask.shape[0] - 1), i, j]
                    out[b, y + i, x + j] = m * src[i, j] + (1 - m) * out[b, y + i, x + j]
    return out


def test_image_composite_masked_follows_comfyui():
    destination, source, mask = rand(2, 6, 7, 3), rand(1, 4, 4, 3, seed=1), rand(1, 4, 4, seed=2)
    node = io.ImageCompositeMasked()
    for x, y, m in ((0, 0, None), (2, 1, mask), (5, 4, mask), (7, 6, mask)):
        got = node.run(CTX, destination, source, x, y, False, m)[0]
        expected = reference_composite(destination.numpy(), source.numpy(), x, y,
                                       None if m is None else m.numpy())
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)
    resized = node.run(CTX, destination, source, 0, 0, True)[0]  # the source stretched over the destination
    stretched = F.interpolate(source.permute(0, 3, 1, 2), size=(6, 7), mode="bilinear").permute(0, 2, 3, 1)
    assert torch.allclose(resized, stretched.expand(2, -1, -1, -1), atol=1e-6)
    rgba = torch.cat([source, torch.zeros(1, 4, 4, 1)], dim=-1)
    assert node.run(CTX, destination, rgba, 0, 0, False)[0].shape == (2, 6, 7, 3)  # alpha dropped
    rgba_destination = torch.cat([destination, torch.zeros(2, 6, 7, 1)], dim=-1)
    over_rgba = node.run(CTX, rgba_destination, source, 2, 1, False)[0]  # the source gains an opaque alpha
    assert over_rgba.shape == (2, 6, 7, 4)
    assert bool((over_rgba[:, 1:5, 2:6, 3] == 1).all()) and over_rgba[..., 3].sum() == 2 * 16


def test_scale_to_total_pixels_sizes_by_hand():
    image = rand(1, 32, 64, 3)
    node = io.ImageScaleToTotalPixels()
    # 0.0625 MP = 65536 px over 2048: scale sqrt(32) = 5.6569 -> 362.04 x 181.02
    assert node.run(CTX, image, "nearest-exact", 0.0625)[0].shape == (1, 181, 362, 3)
    assert node.run(CTX, image, "bilinear", 0.0625, 8)[0].shape == (1, 184, 360, 3)  # 45 x 8, 23 x 8
    assert [i.name for i in node.inputs] == ["image", "upscale_method", "megapixels", "resolution_steps"]


def reference_outpaint(image: np.ndarray, left: int, top: int, right: int, bottom: int,
                       feathering: int) -> tuple[np.ndarray, np.ndarray]:
    """ComfyUI's ImagePadForOutpaint with its per-pixel loops."""
    b, h, w, c = image.shape
    new = np.full((b, h + top + bottom, w + left + right, c), 0.5, dtype=np.float32)
    new[:, top:top + h, left:left + w] = image
    mask = np.ones((h + top + bottom, w + left + right), dtype=np.float32)
    t = np.zeros((h, w), dtype=np.float32)
    if feathering > 0 and feathering * 2 < h and feathering * 2 < w:
        for i in range(h):
            for j in range(w):
                d = min(i if top != 0 else h, h - i if bottom != 0 else h,
                        j if left != 0 else w, w - j if right != 0 else w)
                if d < feathering:
                    t[i, j] = ((feathering - d) / feathering) ** 2
    mask[top:top + h, left:left + w] = t
    return new, mask[None]


@pytest.mark.parametrize("pads", [(8, 0, 16, 0, 3), (0, 8, 0, 8, 2), (8, 8, 8, 8, 0), (8, 0, 0, 0, 5)])
def test_pad_for_outpaint_matches_comfyui_loops(pads):
    image = rand(2, 9, 10, 3)
    got_image, got_mask = io.ImagePadForOutpaint().run(CTX, image, *pads)
    ref_image, ref_mask = reference_outpaint(image.numpy(), *pads)
    np.testing.assert_allclose(got_image.numpy(), ref_image)
    np.testing.assert_allclose(got_mask.numpy(), ref_mask, atol=1e-6)
    assert io.ImagePadForOutpaint.inputs[5].default == 40


def test_mask_conversions_solid_and_invert():
    image = rand(2, 3, 4, 3)
    assert torch.equal(mk.ImageToMask().run(CTX, image, "green")[0], image[..., 1])
    with pytest.raises(ValueError, match="3 channels"):
        mk.ImageToMask().run(CTX, image, "alpha")
    mask = rand(2, 3, 4, seed=1)
    as_image = mk.MaskToImage().run(CTX, mask)[0]
    assert as_image.shape == (2, 3, 4, 3) and torch.equal(as_image[..., 2], mask)
    assert mk.MaskToImage().run(CTX, mask[0])[0].shape == (1, 3, 4, 3)  # (H, W) masks are a batch of one
    solid = mk.SolidMask().run(CTX, 0.25, 5, 2)[0]
    assert solid.shape == (1, 2, 5) and bool((solid == 0.25).all())
    assert torch.equal(mk.InvertMask().run(CTX, mask)[0], 1.0 - mask)


@pytest.mark.parametrize("operation", mk.MASK_OPERATIONS)
def test_mask_composite_matches_comfyui(operation):
    destination, source = rand(2, 5, 6), rand(2, 3, 4, seed=1)
    for x, y in ((0, 0), (3, 3), (6, 5)):
        got = mk.MaskComposite().run(CTX, destination, source, x, y, operation)[0]
        out = destination.numpy().copy()
        for b in range(2):
            for i in range(3):
                for j in range(4):
                    if y + i < 5 and x + j < 6:
                        d, s = out[b, y + i, x + j], source.numpy()[b, i, j]
                        out[b, y + i, x + j] = {"multiply": d * s, "add": d + s, "subtract": d - s,
                                                "and": float(round(d) and round(s)),
                                                "or": float(round(d) or round(s)),
                                                "xor": float(bool(round(d)) != bool(round(s)))}[operation]
        np.testing.assert_allclose(got.numpy(), np.clip(out, 0, 1), atol=1e-6)
    with pytest.raises(ValueError, match="source has 2 masks, destination 3"):
        mk.MaskComposite().run(CTX, rand(3, 5, 6), source, 0, 0, operation)


def test_grow_mask_matches_scipy_grey_morphology():
    ndimage = pytest.importorskip("scipy.ndimage")  # what ComfyUI's GrowMask calls
    mask = (rand(2, 9, 11) > 0.8).float() * rand(2, 9, 11, seed=3)
    for expand in (2, -1, 3, 0):
        for tapered in (True, False):
            c = 0 if tapered else 1
            kernel = np.array([[c, 1, c], [1, 1, 1], [c, 1, c]])
            expected = []
            for m in mask.numpy():
                for _ in range(abs(expand)):
                    grow = ndimage.grey_dilation if expand > 0 else ndimage.grey_erosion
                    m = grow(m, footprint=kernel)
                expected.append(m)
            got = mk.GrowMask().run(CTX, mask, expand, tapered)[0]
            np.testing.assert_array_equal(got.numpy(), np.stack(expected))
    one = torch.zeros(1, 5, 5)
    one[0, 2, 2] = 1
    cross = mk.GrowMask().run(CTX, one, 1, True)[0][0]  # by hand: a plus sign
    assert cross.sum() == 5 and cross[1, 2] == cross[2, 1] == 1 and cross[1, 1] == 0


def test_feather_mask_matches_comfyui_including_its_minus_zero_index():
    ones = torch.ones(1, 1, 4)
    assert torch.allclose(mk.FeatherMask().run(CTX, ones, 2, 0, 0, 0)[0], torch.tensor([[[0.5, 1, 1, 1]]]))
    # right = 2: column -0 (= 0) x 1/2, column -1 x 2/2, as ComfyUI indexes it
    assert torch.allclose(mk.FeatherMask().run(CTX, ones, 0, 0, 2, 0)[0], torch.tensor([[[0.5, 1, 1, 1]]]))
    mask = rand(2, 6, 7)
    left, top, right, bottom = 3, 2, 4, 9
    out = mask.numpy().copy()
    bottom_clamped = min(bottom, 6)
    for i in range(left):
        out[:, :, i] *= (i + 1.0) / left
    for i in range(right):
        out[:, :, -i] *= (i + 1) / right
    for i in range(top):
        out[:, i, :] *= (i + 1) / top
    for i in range(bottom_clamped):
        out[:, -i, :] *= (i + 1) / bottom_clamped
    got = mk.FeatherMask().run(CTX, mask, left, top, right, bottom)[0]
    np.testing.assert_allclose(got.numpy(), out, atol=1e-6)


def test_load_image_mask_reads_a_channel_and_inverts_alpha(tmp_path):
    settings = load_settings(output_dir=tmp_path / "output")
    (tmp_path / "input").mkdir()
    pixels = np.zeros((3, 4, 4), dtype=np.uint8)
    pixels[..., 0] = 255  # red everywhere
    pixels[0, 0, 3] = 51  # alpha 0.2 at (0, 0), else transparent
    Image.fromarray(pixels, "RGBA").save(tmp_path / "input" / "m.png")
    ctx = RunContext("test", settings=settings)
    alpha = mk.LoadImageMask().run(ctx, "m.png", "alpha")[0]
    assert alpha.shape == (1, 3, 4) and alpha[0, 0, 0] == pytest.approx(0.8) and alpha[0, 1, 1] == 1.0
    assert bool((mk.LoadImageMask().run(ctx, "m.png", "red")[0] == 1.0).all())
    assert bool((mk.LoadImageMask().run(ctx, "m.png", "blue")[0] == 0.0).all())
    Image.fromarray(pixels[..., :3], "RGB").save(tmp_path / "input" / "rgb.png")
    assert bool((mk.LoadImageMask().run(ctx, "rgb.png", "alpha")[0] == 0.0).all())  # opaque: nothing masked
    with pytest.raises(FileNotFoundError, match="nope.png"):
        mk.LoadImageMask().run(ctx, "nope.png", "alpha")
    assert [i.name for i in mk.LoadImageMask.inputs] == ["image", "channel"]

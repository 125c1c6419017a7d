"""PNG files that carry their workflow, and images read into ComfyUI IMAGE / MASK tensors (checked against
PIL and numpy directly)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.graph.comfy import is_comfy_ui
from engine.graph.document import Workflow
from engine.graph.interchange import load_any
from engine.images import load_image, png_text, save_png, tensor_to_pil, workflow_chunks
from engine.settings import Settings

PROMPT = "a fox \"quoted\", ünïcode"


def _workflow() -> Workflow:
    workflow = Workflow()
    ckpt = workflow.add_node("CheckpointLoaderSimple", {"ckpt_name": "sd15.safetensors"})
    text = workflow.add_node("CLIPTextEncode", {"text": PROMPT}, title="prompt")
    muted = workflow.add_node("PreviewImage", mode="muted")
    workflow.connect(ckpt.id, 1, text.id, "clip", "CLIP")
    workflow.connect(text.id, 0, muted.id, "images", "IMAGE")
    return workflow


def test_saved_png_holds_sluices_document_and_comfyuis_workflow_and_prompt(tmp_path: Path) -> None:
    workflow = _workflow()
    image = torch.rand(10, 14, 3, generator=torch.Generator().manual_seed(0))
    path = save_png(image, tmp_path / "out.png", workflow_chunks(workflow))
    chunks = png_text(path)
    assert Workflow.loads(chunks["sluice-workflow"]).to_dict() == workflow.to_dict()
    comfy_ui = json.loads(chunks["workflow"])  # what ComfyUI's Load reads first: its own UI format
    assert is_comfy_ui(comfy_ui) and comfy_ui["version"] == 0.4
    assert [(node["id"], node["type"], node["mode"]) for node in comfy_ui["nodes"]] == [
        (1, "CheckpointLoaderSimple", 0), (2, "CLIPTextEncode", 0), (3, "PreviewImage", 2)]
    assert json.loads(chunks["prompt"]) == {  # muted nodes are not in a prompt
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd15.safetensors"},
              "_meta": {"title": "CheckpointLoaderSimple"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["1", 1]},
              "_meta": {"title": "prompt"}},
    }
    loaded, warnings = load_any(path, lambda type_name: None)
    assert warnings == [] and loaded.to_dict() == workflow.to_dict()  # Sluice reads its own chunk first
    with Image.open(path) as saved:
        pixels = np.asarray(saved)
    expected = np.clip(255.0 * image.numpy(), 0, 255).astype(np.uint8)  # ComfyUI truncates
    assert np.array_equal(pixels, expected)


def test_saving_never_overwrites(tmp_path: Path) -> None:
    settings = Settings(tmp_path, tmp_path / "output", None)
    image = torch.zeros(4, 4, 3)
    first = save_png(image, settings.output_path("run/img", "png"))
    second = save_png(image, settings.output_path("run/img", "png"))
    assert (first.name, second.name) == ("img_00001_.png", "img_00002_.png")
    with pytest.raises(FileExistsError):
        save_png(torch.ones(4, 4, 3), first)
    with Image.open(first) as kept:
        assert np.asarray(kept).max() == 0
    assert workflow_chunks(None) == {}


def test_alpha_becomes_the_mask_as_one_minus_alpha(tmp_path: Path) -> None:
    rgba = np.zeros((3, 5, 4), dtype=np.uint8)
    rgba[..., 0] = 255
    rgba[..., 3] = [[0, 64, 128, 200, 255]] * 3
    Image.fromarray(rgba, "RGBA").save(tmp_path / "alpha.png")
    image, mask = load_image(tmp_path / "alpha.png")
    assert image.shape == (1, 3, 5, 3) and mask.shape == (1, 3, 5)
    assert torch.equal(image[0], torch.from_numpy(rgba[..., :3].astype(np.float32) / 255))
    assert torch.allclose(mask[0], torch.from_numpy(1 - rgba[..., 3].astype(np.float32) / 255))


def test_images_without_alpha_have_an_empty_mask_and_palette_transparency_counts(tmp_path: Path) -> None:
    Image.new("L", (6, 2), 51).save(tmp_path / "grey.png")
    image, mask = load_image(tmp_path / "grey.png")
    assert torch.allclose(image, torch.full((1, 2, 6, 3), 0.2)) and torch.equal(mask, torch.zeros(1, 2, 6))
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.save(tmp_path / "palette.png", transparency=0)
    _, mask = load_image(tmp_path / "palette.png")
    assert torch.equal(mask, torch.tensor([[[1.0, 0.0]]]))


def test_exif_rotation_and_animation_frames(tmp_path: Path) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    Image.new("RGB", (4, 2), (10, 20, 30)).save(tmp_path / "rotated.jpg", exif=exif)
    image, _ = load_image(tmp_path / "rotated.jpg")
    assert image.shape == (1, 4, 2, 3)
    frames = [Image.new("RGB", (3, 3), color) for color in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    image, mask = load_image(tmp_path / "anim.gif")
    assert image.shape == (2, 3, 3, 3) and mask.shape == (2, 3, 3)
    assert image[0, 0, 0].tolist() == [1.0, 0.0, 0.0] and image[1, 0, 0].tolist() == [0.0, 0.0, 1.0]


def test_bad_image_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ValueError, match="cannot read image .*broken.png"):
        load_image(tmp_path / "broken.png")
    with pytest.raises(FileNotFoundError, match="image file not found: .*absent.png"):
        load_image(tmp_path / "absent.png")
    with pytest.raises(ValueError, match=r"expected one image of shape \(H, W, 3\); got \(2, 2\)"):
        tensor_to_pil(torch.zeros(2, 2))


def test_levels_are_truncated_like_comfyuis_save_image(tmp_path: Path) -> None:
    # ComfyUI: np.clip(255. * x, 0, 255).astype(np.uint8); values written down by hand.
    values = [0.0, 0.999, 0.5, 1 / 255, 0.00392, 0.998, 1.0, 1.5, -0.2]
    expected = [0, 254, 127, 1, 0, 254, 255, 255, 0]  # 255/255 is exactly 1.0 in float32; 0.00392 < 1/255
    image = torch.tensor(values, dtype=torch.float32)[None, :, None].expand(1, len(values), 3)
    assert np.asarray(tensor_to_pil(image))[0, :, 0].tolist() == expected
    path = save_png(image, tmp_path / "levels.png", {})
    assert np.asarray(Image.open(path))[0, :, 1].tolist() == expected

"""The embedded model's live previews show the final image's colours: the sampler's previews come from the
model's own decoder (resources/models/vae_approx/sluice-shapes_taesd_decoder.safetensors, made by
tools/train_preview_decoder.py), not SD1's latent-to-RGB factors, which turned them pink."""

from __future__ import annotations

import numpy as np

from engine.settings import load_settings
from tools.embedded_generate import EmbeddedGenerator

PROMPTS = (
    "a large yellow star in the center on a blue background",
    "white background, a small purple ring at the top left",
    "a red square on the right on a green background",
    "draw a big orange cross at the bottom, the background is black",
)


def test_embedded_model_previews_have_the_final_images_colours(tmp_path):
    generator = EmbeddedGenerator(load_settings(output_dir=tmp_path))
    frames: list[np.ndarray] = []
    generator.bus.subscribe(lambda event: frames.append(event["image"]) if event.kind == "preview" else None)
    for seed, prompt in enumerate(PROMPTS):
        frames.clear()
        image = np.asarray(generator.generate(prompt, seed=300 + seed), dtype=np.float32)
        assert len(frames) == 20  # one per step of the default workflow's sampler
        preview = np.asarray(frames[-1], dtype=np.float32)
        assert preview.shape == image.shape  # a decoder's frame at 8x, not the latent-sized projection
        distance = np.sqrt(((preview - image) ** 2).sum(axis=-1)).mean()
        assert distance < 30, (prompt, distance)

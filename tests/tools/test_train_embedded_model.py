"""tools/train_embedded_model.py end to end on the CPU with tiny step counts: a run resumed from the shipped
model keeps its VAE and latent scale, stops at its time budget, and writes files that the ordinary loaders
(CheckpointLoaderSimple, CLIPLoader in the default workflow) load and generate with."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.settings import Settings, embedded_models_dir
from tools.embedded_generate import EmbeddedGenerator
from tools.train_embedded_model import CHECKPOINT_NAME, TEXT_ENCODER_NAME, VAE_PREFIX, main

SHIPPED = embedded_models_dir()
LIMIT = 16 * 2**20  # bytes a file under resources/ may take


def metadata(path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def run(out, *extra: str) -> None:
    assert main(["--out", str(out), "--resume", str(SHIPPED), "--scenes", "6", "--batch-size", "2",
                 "--workers", "1", *extra]) == 0


@pytest.fixture(scope="module")
def shipped_history() -> dict:
    return json.loads(metadata(SHIPPED / "checkpoints" / CHECKPOINT_NAME)["sluice.training"])


def test_a_resumed_run_keeps_the_vae_and_its_scale_and_its_files_load_and_generate(tmp_path, shipped_history):
    out = tmp_path / "models"
    run(out, "--unet-steps", str(shipped_history["unet_steps"] + 2), "--high-noise-share", "0.5",
        "--time-budget", "600")
    checkpoint = out / "checkpoints" / CHECKPOINT_NAME
    text_encoder = out / "text_encoders" / TEXT_ENCODER_NAME
    assert checkpoint.stat().st_size <= LIMIT and text_encoder.stat().st_size <= LIMIT
    written, shipped = load_file(str(checkpoint)), load_file(str(SHIPPED / "checkpoints" / CHECKPOINT_NAME))
    vae_keys = [key for key in shipped if key.startswith(VAE_PREFIX)]
    assert vae_keys and all(torch.equal(written[key], shipped[key]) for key in vae_keys)
    assert set(written) == set(shipped)
    info = metadata(checkpoint)
    assert info["sluice.vae_scale_factor"] == metadata(SHIPPED / "checkpoints" / CHECKPOINT_NAME)[
        "sluice.vae_scale_factor"]
    assert json.loads(info["sluice.training"])["unet_steps"] == shipped_history["unet_steps"] + 2

    settings = Settings(out, tmp_path / "images", None, embedded_models=False)  # only the new files
    image = np.asarray(EmbeddedGenerator(settings, steps=2).generate("a red circle on a blue background", 0))
    assert image.shape == (128, 128, 3) and image.std() > 0


def test_a_run_out_of_time_still_saves_its_files(tmp_path, shipped_history):
    out = tmp_path / "models"
    run(out, "--unet-steps", str(shipped_history["unet_steps"] + 1000), "--time-budget", "0.001")
    history = json.loads(metadata(out / "checkpoints" / CHECKPOINT_NAME)["sluice.training"])
    assert history["unet_steps"] == shipped_history["unet_steps"]  # the budget was spent before any step
    assert (out / "text_encoders" / TEXT_ENCODER_NAME).stat().st_size <= LIMIT


def test_bad_options_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--high-noise-share", "1.5"])
    assert "--high-noise-share 1.5 is not a share; accepted: 0..1" in capsys.readouterr().err

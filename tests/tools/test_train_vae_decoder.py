"""tools/train_vae_decoder.py on the CPU with a tiny step count: it changes only the decoding tensors (so
the encoder's latents, the scale factor and the UNet stay valid), records the run, and writes a checkpoint
that the default workflow loads and generates with."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.settings import Settings, embedded_models_dir
from tools.embedded_generate import EmbeddedGenerator
from tools.train_embedded_model import CHECKPOINT_NAME, TEXT_ENCODER_NAME, VAE_PREFIX
from tools.train_vae_decoder import main

SHIPPED = embedded_models_dir() / "checkpoints" / CHECKPOINT_NAME


def metadata(path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_only_the_decoding_tensors_change_and_the_checkpoint_still_generates(tmp_path):
    out = tmp_path / "models" / "checkpoints" / CHECKPOINT_NAME
    assert main(["--checkpoint", str(SHIPPED), "--out", str(out), "--images", "4", "--steps", "3",
                 "--batch-size", "2", "--lr", "1e-3"]) == 0
    written, shipped = load_file(str(out)), load_file(str(SHIPPED))
    assert set(written) == set(shipped)
    decoding = {k for k in shipped
                if k.startswith((VAE_PREFIX + "decoder.", VAE_PREFIX + "post_quant_conv."))}
    assert decoding and any(not torch.equal(written[k], shipped[k]) for k in decoding)
    unchanged = set(shipped) - decoding  # the UNet, the encoder and quant_conv
    assert all(torch.equal(written[k], shipped[k]) for k in unchanged)
    info, before = metadata(out), metadata(SHIPPED)
    assert info["sluice.vae_scale_factor"] == before["sluice.vae_scale_factor"]
    runs = json.loads(info["sluice.training"])["decoder_runs"]
    assert len(runs) == len(json.loads(before["sluice.training"]).get("decoder_runs", [])) + 1
    assert runs[-1]["steps"] == 3 and runs[-1]["images"] == 4

    text_encoders = tmp_path / "models" / "text_encoders"
    text_encoders.mkdir()
    shutil.copy(embedded_models_dir() / "text_encoders" / TEXT_ENCODER_NAME, text_encoders)
    settings = Settings(tmp_path / "models", tmp_path / "images", None, embedded_models=False)
    image = np.asarray(EmbeddedGenerator(settings, steps=2).generate("a red circle on a blue background", 0))
    assert image.shape == (128, 128, 3) and image.std() > 0


def test_writing_over_the_input_checkpoint_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(SHIPPED), "--out", str(SHIPPED)])
    assert "is the input checkpoint; accepted: another path" in capsys.readouterr().err

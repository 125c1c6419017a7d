"""TAESDDecode: a fast approximate decode of latents with madebyollin's tiny autoencoder from vae_approx/.

The decoder file's name tells the latent family: taesd_decoder.* for SD1/SD2, taesdxl_decoder.* for SDXL
(the LATENT is in raw VAE space and is scaled into the model's space first, as TAESD expects). A decoder made
for one checkpoint's VAE (<checkpoint stem>_taesd_decoder.*, such as the embedded model's
sluice-shapes_taesd_decoder.safetensors) carries that VAE's scale in its metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.devices import resolve_device
from engine.graph.spec import NodeType, Output, RunContext, combo_input, link_input
from engine.models.taesd import DECODER_NAMES, LATENT_SCALES, OWN_DECODER_SUFFIX, cached_taesd_decoder
from engine.settings import SettingsError
from nodes.latent import latent_samples
from nodes.loaders import current_settings, file_fingerprint, model_path


def taesd_family(taesd_name: str) -> str:
    """The latent family a decoder file serves, from its name (taesdxl_decoder.* -> sdxl)."""
    stem = Path(taesd_name).name.split(".")[0]
    for family, name in DECODER_NAMES.items():
        if stem == name:
            return family
    accepted = ", ".join(f"{name}.* ({family})" for family, name in DECODER_NAMES.items())
    raise ValueError(f"cannot tell the latent family of TAESD file {taesd_name!r}; "
                     f"accepted names: {accepted}, or <checkpoint>{OWN_DECODER_SUFFIX}.* with its scale in "
                     f"the metadata")


def taesd_choices() -> list[str]:
    """The TAESD decoder files of vae_approx/."""
    try:
        models = current_settings().list_models("vae_approx")
    except SettingsError:
        return []
    return [name for name in models if _is_decoder_name(name)]


def _is_decoder_name(name: str) -> bool:
    stem = Path(name).name.split(".")[0]
    return stem in DECODER_NAMES.values() or stem.endswith(OWN_DECODER_SUFFIX)


class TAESDDecode(NodeType):
    display_name = "TAESD Decode"
    category = "latent"
    description = ("Decodes latents approximately and fast with a tiny autoencoder (TAESD) from vae_approx/: "
                   "taesd_decoder for SD1/SD2, taesdxl_decoder for SDXL, <checkpoint>_taesd_decoder for "
                   "that checkpoint's VAE (the embedded model's is sluice-shapes_taesd_decoder).")
    inputs = (link_input("samples", "LATENT"), combo_input("taesd_name", taesd_choices))
    outputs = (Output("IMAGE", "IMAGE"),)

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        return file_fingerprint(model_path(settings, "vae_approx", widgets["taesd_name"]))

    def run(self, ctx: RunContext, samples: Any, taesd_name: str) -> tuple:
        device = resolve_device("auto").torch_device
        decoder = cached_taesd_decoder(model_path(ctx.settings, "vae_approx", taesd_name), device)
        scale = decoder.latent_scale  # a decoder made for one VAE knows its scale; else the family's
        if scale is None:
            scale = LATENT_SCALES[taesd_family(taesd_name)]
        latent = latent_samples(samples).float() * scale  # raw VAE space -> the model's space
        images = torch.cat([decoder.decode(latent[i:i + 1]).cpu() for i in range(latent.shape[0])])
        return (images.movedim(1, -1).contiguous(),)  # (B, 8h, 8w, 3)


NODE_TYPES = (TAESDDecode,)

"""Test helper: tiny FLUX-shaped files in the layouts users have (random weights).

    write_flux_files(folder)   # diffusion_models/, text_encoders/, vae/ as ComfyUI's FLUX templates name them

- the transformer in BFL / ComfyUI keys (bare, or under `model.diffusion_model.`), or diffusers' keys;
- CLIP-L (HF keys, with a text_projection that FLUX must not use), T5 v1.1 (HF keys), the 16-channel VAE
  without quant convs;
- ComfyUI's all-in-one checkpoint (`model.diffusion_model.`, `text_encoders.clip_l.transformer.text_model.`,
  `text_encoders.t5xxl.transformer.`, `vae.`).
The tiny sizes keep the real vocabularies (49408 CLIP tokens, 32128 T5 tokens) so the real tokenizers work.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.flux import FluxConfig, FluxTransformer, flux_axes_dim
from engine.models.t5 import T5Config, T5Encoder
from tests.engine.models.sd_checkpoints import TextSpec, VAESpec, text_shapes, vae_shapes

CLIP_WIDTH, T5_WIDTH = 32, 32
CHECKPOINT_PREFIXES = {"diffusion": "model.diffusion_model.", "clip_l": "text_encoders.clip_l.transformer.",
                       "t5": "text_encoders.t5xxl.transformer.", "vae": "vae."}


def tiny_flux_config(dev: bool = True) -> FluxConfig:
    return FluxConfig(in_channels=64, out_channels=64, vec_in_dim=CLIP_WIDTH, context_in_dim=T5_WIDTH,
                      hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=2,
                      axes_dim=flux_axes_dim(32), guidance_embed=dev)


def tiny_t5_config() -> T5Config:
    return T5Config(vocab_size=32128, d_model=T5_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4)


def _random(shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors of std 1/sqrt(fan_in) for matrices, 1 +- 0.1 for vectors named weight/scale, small
    biases: activations stay of order one through the tiny models."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in shapes.items():
        drawn = torch.randn(shape, generator=generator)
        if len(shape) >= 2:
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            tensor = drawn / fan_in**0.5
        elif key.endswith(("weight", "scale")):
            tensor = 1.0 + 0.1 * drawn
        else:
            tensor = 0.1 * drawn
        out[key] = tensor.to(dtype).contiguous()
    return out


def flux_state(dev: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str,
                                                                                            torch.Tensor]:
    """A tiny transformer's tensors under BFL names (no prefix)."""
    model = FluxTransformer(tiny_flux_config(dev), device="meta")
    return _random({k: tuple(v.shape) for k, v in model.state_dict().items()}, seed, dtype)


def t5_state(seed: int = 1, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    model = T5Encoder(tiny_t5_config(), device="meta")
    return _random({k: tuple(v.shape) for k, v in model.state_dict().items()}, seed, dtype)


def clip_l_state(seed: int = 2, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF CLIPTextModelWithProjection keys (`text_model.*`, `text_projection.weight`): clip_l.safetensors."""
    spec = TextSpec("hf", "text_model.", CLIP_WIDTH, 2, 64, projection_dim=CLIP_WIDTH)
    return _random(text_shapes(spec), seed, dtype)


def vae_state(seed: int = 3, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """FLUX's autoencoder layout (ae.safetensors): 16 latent channels, no quant_conv / post_quant_conv."""
    spec = VAESpec(ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=1, z_channels=16, embed_dim=16)  # 8x
    shapes = vae_shapes(spec, "")
    shapes = {k: v for k, v in shapes.items() if "quant_conv" not in k}
    return _random(shapes, seed, dtype)


def prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}


def checkpoint_state(dev: bool = True) -> dict[str, torch.Tensor]:
    """ComfyUI's all-in-one FLUX checkpoint."""
    return (prefixed(flux_state(dev), CHECKPOINT_PREFIXES["diffusion"])
            | prefixed(clip_l_state(), CHECKPOINT_PREFIXES["clip_l"])
            | prefixed(t5_state(dtype=torch.float16), CHECKPOINT_PREFIXES["t5"]) | prefixed(vae_state(),
                                                                                            CHECKPOINT_PREFIXES["vae"]))


def write_flux_files(root: Path, dev: bool = True) -> dict[str, Path]:
    """A ComfyUI models folder with the tiny FLUX files under the names of ComfyUI's FLUX templates."""
    name = "flux1-dev" if dev else "flux1-schnell"
    files = {"diffusion": root / "diffusion_models" / f"{name}.safetensors",
             "clip_l": root / "text_encoders" / "clip_l.safetensors",
             "t5": root / "text_encoders" / "t5xxl_fp16.safetensors",
             "vae": root / "vae" / "ae.safetensors",
             "checkpoint": root / "checkpoints" / f"{name}-fp8.safetensors"}
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    save_file(flux_state(dev), str(files["diffusion"]))
    save_file(clip_l_state(), str(files["clip_l"]))
    save_file(t5_state(dtype=torch.float16), str(files["t5"]))
    save_file(vae_state(), str(files["vae"]))
    save_file(checkpoint_state(dev), str(files["checkpoint"]))
    return files

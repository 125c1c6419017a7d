"""Load FLUX.1 files into our models: the transformer (BFL or diffusers layout), CLIP-L + T5-XXL, the VAE.

Models are built on `meta` and their parameters bound to tensors read lazily (engine/models/loader.py does
the same for SD files). A diffusers-layout transformer is converted to BFL names one tensor at a time
(engine/models/flux_keys.py), so the weight store and the runtime see one layout. The transformer's linear
layers keep an fp8 file's `float8_e4m3fn` / `float8_e5m2` weights as they are (or store a wider file's in fp8
when the UNETLoader's weight_dtype asks for it), half the bytes of bf16 in memory and on every streamed copy,
and cast each to the compute dtype as it runs; the text encoders upcast fp8 tensors as they are read.
Linear weights a GGUF file stores quantised rest quantised and are dequantised as each layer runs, and
`types` (`--type`) quantises float ones as they load (engine/quant/loading.py); a diffusers-layout
transformer's quantised tensors, which are combined as they are read, load dequantised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from engine.models.bundles import ManagedEncoder
from engine.models.clip import CLIPTextModel, component_prefix
from engine.models.detect import ModelInfo, TextEncoderConfig
from engine.models.flux import FluxConfig, FluxTransformer
from engine.models.flux_bundles import (
    FluxConditioner,
    FluxDiffusionModel,
    FluxTextEncoder,
    ManagedT5,
    plain_t5,
)
from engine.models.flux_keys import diffusers_flux_getter
from engine.models.formats import CheckpointReader
from engine.models.loader import adopt_lifetime, default_dtype, module_memory
from engine.models.t5 import T5Config, T5Encoder, t5_key_map
from engine.models.weights import bind_weights
from engine.quant.loading import WeightTypes, quantise_model, reopen
from engine.sampling.model_sampling import FlowMatching, FluxFlowMatching

FLUX_DEV_SHIFT = 1.15  # ComfyUI's sampling_settings for FLUX dev (ModelSamplingFlux)
FLUX_SCHNELL_SHIFT = 1.0  # and for schnell (ModelSamplingDiscreteFlow, multiplier 1)
Getter = Callable[[str], torch.Tensor]


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def flux_dtype(device: torch.device, requested: torch.dtype | None) -> torch.dtype:
    """The compute dtype: the requested one unless it is a storage-only fp8; else float32 on the CPU, bf16
    on GPUs that have it (FLUX and T5 overflow in fp16), else fp16."""
    if requested is not None and requested not in FP8:
        return requested
    if device.type == "cpu":
        return torch.float32
    bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float16


def flux_weight_dtype(requested: torch.dtype | None, stored: torch.dtype | None, compute: torch.dtype,
                      ) -> torch.dtype:
    """The linear layers' stored dtype: fp8 when asked for (ComfyUI's weight_dtype fp8_e4m3fn / fp8_e5m2) or,
    by default, when the file stores fp8 (kept as it is, cast per layer as it runs); else the compute one."""
    if requested in FP8:
        return requested
    if requested is None and stored in FP8:
        return stored
    return compute


def _bind_from(model: torch.nn.Module, get: Getter, target, kind: str, what: str, path: Path,
               reopen: Callable[[], Getter]) -> str | None:
    """Bind `model`'s parameters (named as it names them) to `get(name)`, each cast to its parameter's
    dtype: read now and bound (plain), or registered in the runtime under the target's home (disk: re-read
    through `reopen()`'s getter)."""
    if target.runtime is None:
        device = target.device.torch_device
        tensors = {name: get(name).to(device, parameter.dtype)
                   for name, parameter in model.named_parameters()}
        try:
            bind_weights(model, tensors)
        except ValueError as error:
            raise ValueError(f"{path}: the {what} does not match its detected configuration: "
                             f"{error}") from None
        return None
    source = reopen() if target.home == "disk" else get
    return target.runtime.register(kind, model, target.home, target.device.name, source,
                                   target.devices or None, target.split_mode)


def _checked(get: Getter, path: Path, what: str) -> Getter:
    def read(name: str) -> torch.Tensor:
        try:
            return get(name)
        except KeyError:
            raise ValueError(f"{path}: the {what} lacks tensor '{name}'; the file is incomplete") from None

    return read


def _flux_getter(reader: CheckpointReader, info: ModelInfo) -> Getter:
    prefix = info.components["diffusion"]
    keys = [k[len(prefix):] for k in reader.keys() if k.startswith(prefix)]

    def raw(name: str) -> torch.Tensor:
        return reader.get(prefix + name)

    get = diffusers_flux_getter(raw, keys) if info.flux_layout == "diffusers" else raw
    return _checked(get, reader.path, "FLUX transformer")


def build_flux_diffusion(reader: CheckpointReader, info: ModelInfo, dtype: torch.dtype | None,
                         target, types: WeightTypes | None = None) -> FluxDiffusionModel:
    """The FLUX transformer of `reader` as a MODEL bundle, bound or registered per `target`."""
    config: FluxConfig = info.flux
    compute = flux_dtype(target.device.torch_device, dtype)
    prefix = info.components["diffusion"]
    stored = reader.info(prefix + _first_matrix(info)).dtype
    model = FluxTransformer(config, dtype=compute, device="meta",
                            weight_dtype=flux_weight_dtype(dtype, stored, compute))
    bfl = info.flux_layout != "diffusers"
    reader = quantise_model(model, reader, lambda name: prefix + name if bfl else None, types,
                            target.device.torch_device)
    name = _bind_from(model, _flux_getter(reader, info), target, "diffusion", "FLUX transformer", reader.path,
                      lambda: _flux_getter(reopen(reader), info))
    sampling = (FluxFlowMatching(shift=FLUX_DEV_SHIFT) if config.guidance_embed
                else FlowMatching(shift=FLUX_SCHNELL_SHIFT, multiplier=1.0))
    memory = module_memory(target, "diffusion", [name], [model])
    vae = info.vae
    scale, shift = (vae.scale_factor, vae.shift_factor) if vae is not None else (0.3611, 0.1159)
    return adopt_lifetime(FluxDiffusionModel(unet=model, model_sampling=sampling, family=info.family,
                                     latent_channels=config.in_channels // (config.patch_size ** 2),
                                     latent_scale=scale, latent_shift=shift,
                                     compute_device=target.device.name,
                                     params_location=target.home, source=reader.path, memory=memory), memory)


def _first_matrix(info: ModelInfo) -> str:
    """The file key (under the diffusion prefix) of a block matrix, whose dtype is the file's storage one."""
    return ("transformer_blocks.0.attn.to_q.weight" if info.flux_layout == "diffusers"
            else "double_blocks.0.img_attn.qkv.weight")


def _t5_getter(reader: CheckpointReader, prefix: str) -> Getter:
    keys = [k[len(prefix):] for k in reader.keys() if k.startswith(prefix)]
    mapping = t5_key_map(keys)

    def get(name: str) -> torch.Tensor:
        return reader.get(prefix + mapping.get(name, name))

    return _checked(get, reader.path, "T5 encoder")


def _build_t5(reader: CheckpointReader, config: T5Config, prefix: str, dtype: torch.dtype | None,
              target, types: WeightTypes | None = None) -> tuple[T5Encoder, str | None]:
    dtype = flux_dtype(target.device.torch_device, dtype)
    model = T5Encoder(config, dtype=dtype, device="meta")
    mapping = t5_key_map([k[len(prefix):] for k in reader.keys() if k.startswith(prefix)])
    reader = quantise_model(model, reader, lambda name: prefix + mapping.get(name, name), types,
                            target.device.torch_device)
    name = _bind_from(model, _t5_getter(reader, prefix), target, "te", "T5 text encoder", reader.path,
                      lambda: _t5_getter(reopen(reader), prefix))
    return model, name


def _build_clip_l(reader: CheckpointReader, config: TextEncoderConfig, dtype: torch.dtype | None,
                  target, types: WeightTypes | None = None) -> tuple[CLIPTextModel, str | None]:
    """CLIP-L without its projection: FLUX reads the unprojected pooled feature."""
    config = dataclasses.replace(config, kind="clip_l", activation="quick_gelu", projection_dim=None)
    prefix = component_prefix(config)
    dtype = dtype or default_dtype("te", target.device.torch_device, None)
    model = CLIPTextModel(config, dtype=dtype, device="meta")
    reader = quantise_model(model, reader, lambda name: prefix + name, types, target.device.torch_device)

    def getter(source: CheckpointReader) -> Getter:
        return _checked(lambda name: source.get(prefix + name), source.path, "CLIP-L text encoder")

    name = _bind_from(model, getter(reader), target, "te", "CLIP-L text encoder", reader.path,
                      lambda: getter(reopen(reader)))
    return model, name


def flux_text_encoder(clip_l: tuple[CheckpointReader, TextEncoderConfig],
                      t5: tuple[CheckpointReader, T5Config, str], dtype: torch.dtype | None,
                      target, types: WeightTypes | None = None) -> FluxTextEncoder:
    """ComfyUI's CLIP of type flux from CLIP-L's and T5's sources (one file or two)."""
    clip_model, clip_name = _build_clip_l(*clip_l, dtype, target, types)
    t5_model, t5_name = _build_t5(*t5, dtype, target, types)
    memory = module_memory(target, "te", [clip_name, t5_name], [clip_model, t5_model])
    if memory is None:
        conditioner = FluxConditioner(clip_model, plain_t5(t5_model))
    else:
        conditioner = FluxConditioner(ManagedEncoder(clip_model, memory, 0), ManagedT5(t5_model, memory, 1))
    paths = tuple(dict.fromkeys((clip_l[0].path, t5[0].path)))
    return adopt_lifetime(FluxTextEncoder(family="flux", encoders=(clip_model, t5_model),
                                          conditioner=conditioner,
                                  compute_device=target.device.name, params_location=target.home,
                                  sources=paths, memory=memory), memory)

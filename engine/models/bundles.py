"""The model objects that flow on node links: ComfyUI's MODEL, CLIP and VAE types.

Conventions are ComfyUI's, so that ComfyUI-style nodes compose:

- LATENT is `{"samples": [B, 4, h, w]}` in the VAE's raw latent space (not multiplied by the scale factor);
  a `DiffusionModel` scales latents into its own space (`process_in`) and back (`process_out`).
- IMAGE is `[B, H, W, 3]` float32 in 0..1 on the CPU; MASK is `[B, H, W]`.
- CONDITIONING is a list of `[context [1, T, C], {"pooled_output": [1, P] | None, ...}]` pairs; SDXL entries
  may carry width, height, crop_w, crop_h, target_width, target_height for the size conditioning, and any
  entry the area, mask, strength and timestep-range options of engine/models/conditioning.py.
- A MODEL's `options` hold its patches: "sampler_cfg_function" (a guidance.CfgFunction replacing the CFG mix)
  and "output_block_patches" (UNet output-block patches, `(h, skip) -> (h, skip)`, unet.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.memory.runtime import ModuleMemory, torch_device
from engine.memory.vae_tiling import TilingConfig, code_with_fallback
from engine.models.clip import CLIPTextModel
from engine.models.conditioning import (
    SD1Conditioner,
    SD2Conditioner,
    SDXLConditioner,
    SDXLRefinerConditioner,
    sampler_entries,
    sdxl_adm,
    sdxl_refiner_adm,
)
from engine.models.control import Control
from engine.models.staged import Stage
from engine.models.tokenizer import CLIPTokenizer
from engine.models.unclip import SD21_MERGE, SDXL_MERGE, SDXL_POOLED, unclip_adm
from engine.models.unet import UNetModel
from engine.models.vae import AutoencoderKL
from engine.sampling import guidance
from engine.sampling.model_sampling import Denoiser, EpsPrediction, VPrediction

# One embedding file's tensors by name; an encoder takes the one named after it ("clip_l", "clip_g") or the
# only one whose width matches its own.
EmbeddingLookup = Callable[[str], Mapping[str, torch.Tensor] | None]
ConditioningList = list[list[Any]]  # [[context, {"pooled_output": ..., ...}], ...]

TEXT_FAMILIES = ("sd1", "sd2", "sdxl", "sdxl_refiner")
EMBEDDING_KEYS = {"clip_l": ("clip_l",), "openclip_g": ("clip_g",), "openclip_h": ("clip_h",)}
SAMPLER_STATE_LATENTS = 16  # float32 latent-sized tensors a sampler and its CFG batch keep on the device
REFINER_AESTHETIC_SCORE = 6.0  # sgm's default for the refiner's positive prompt


class MissingComponentError(ValueError):
    """A model component (diffusion model, text encoder, VAE) that a file or a link does not provide."""


@dataclass(frozen=True)
class MissingComponent:
    """Stands on an output link where a checkpoint lacks a component; using it raises `message`."""

    kind: str  # "MODEL", "CLIP" or "VAE"
    message: str


def require(value: Any, kind: str, expected: type) -> Any:
    """`value` when it is an `expected` bundle; a clear MissingComponentError otherwise."""
    if isinstance(value, expected):
        return value
    if isinstance(value, MissingComponent):
        raise MissingComponentError(value.message)
    raise MissingComponentError(f"expected a {kind} input, got {type(value).__name__}")


@dataclass
class DiffusionModel:
    """A UNet with its noise schedule and latent format (ComfyUI's MODEL)."""

    unet: UNetModel
    model_sampling: EpsPrediction | VPrediction
    family: str  # canonical layout: sd1, sd2, sdxl, sdxl_refiner
    latent_channels: int
    latent_scale: float  # raw VAE latent * latent_scale = the latent the UNet samples
    latent_shift: float
    compute_device: str  # Sluice device name, e.g. "cpu", "cuda0"
    params_location: str = "device"  # where the weights live: "device", "cpu" (pinned RAM) or "disk"
    source: Path | None = None
    options: dict[str, Any] = field(default_factory=dict)  # per-clone settings: LoRAs, model patches
    memory: ModuleMemory | None = None  # set when the memory runtime holds the weights

    @property
    def dtype(self) -> torch.dtype:
        return self.unet.dtype

    @property
    def torch_device(self) -> torch.device:
        return torch_device(self.compute_device)

    @property
    def latent_format(self) -> str:
        """The preview factors' key (engine/sampling/preview.py)."""
        return "sdxl" if self.family in ("sdxl", "sdxl_refiner") else "sd1"

    def clone(self) -> DiffusionModel:
        """A copy that shares the weights but not the options."""
        return dataclasses.replace(self, options=dict(self.options))

    def process_in(self, latent: torch.Tensor) -> torch.Tensor:
        return (latent - self.latent_shift) * self.latent_scale

    def process_out(self, latent: torch.Tensor) -> torch.Tensor:
        return latent / self.latent_scale + self.latent_shift

    @torch.no_grad()
    def apply(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
              y: torch.Tensor | None = None, guidance: torch.Tensor | None = None,
              control: Mapping[str, list] | None = None, middle_patch: Any = None) -> torch.Tensor:
        """The UNet's prediction for x [B, C, h, w] on the model's device, returned like x.

        `guidance` (FluxGuidance's strength) is ignored: the SD UNets have no guidance input (as in ComfyUI).
        The model's output-block patches (FreeU) run inside the UNet, and so do `control`'s residuals
        (ControlNet, T2I-Adapter: engine/models/control.py), and `middle_patch` (GLIGEN's fusers,
        engine/models/gligen.py).
        """
        patches = tuple(self.options.get("output_block_patches", ()))
        options: dict[str, Any] = {"output_block_patches": patches} if patches else {}
        if control is not None:
            options["control"] = control
        if middle_patch is not None:
            options["middle_patch"] = middle_patch
        return self.run_network(x, timesteps, context, y, **options)

    def run_network(self, x: torch.Tensor, *inputs: torch.Tensor | None, **options: Any) -> torch.Tensor:
        """The network's output for (x, *inputs, **options), moved to its device, through the memory runtime
        when that holds the weights; returned on x's device and in x's dtype."""
        device = self.torch_device
        on_device = [t if t is None else t.to(device) for t in (x, *inputs)]
        if _managed(self.memory, self.unet):
            state = self.unet.initial_state(*on_device, **options)
            out = self.memory.run(0, self.unet, self.unet.stages(), state)["h"]
        else:
            out = self.unet(*on_device, **options)
        return out.to(device=x.device, dtype=x.dtype)

    def denoiser(self) -> Denoiser:
        """The k-diffusion denoiser (x, sigma) -> x0 that the samplers call, with the model's cfg function."""
        return Denoiser(self.apply, self.model_sampling, resolve=self.guidance_conditioning,
                        cfg_function=self.options.get("sampler_cfg_function"))

    @contextlib.contextmanager
    def holding_sampler_state(self, samples: torch.Tensor, *conditionings: Any) -> Iterator[None]:
        """Track the sampler's own device tensors in the memory runtime while it samples `samples`: its
        latents (SAMPLER_STATE_LATENTS float32 copies of them: x, denoised, noise, derivatives, a multistep
        sampler's history, the CFG batch in and out) and each conditioning twice (as given and batched for
        CFG). Untracked, they took SDXL 2 to 4 MiB over its budget (bench/e2e.py, session 16)."""
        if self.memory is None or not self.memory.holds(0, self.unet):
            yield
            return
        text = sum(t.numel() * t.element_size() for c in conditionings if isinstance(c, list)
                   for entry in c for t in (entry[0], *entry[1].values()) if isinstance(t, torch.Tensor))
        nbytes = SAMPLER_STATE_LATENTS * samples.numel() * 4 + 2 * samples.shape[0] * text
        with self.memory.holding("sampler state", nbytes):
            yield

    def guidance_conditioning(self, conditioning: ConditioningList, width: int, height: int, seed: int = 0,
                              ) -> list[guidance.Conditioning]:
        """ComfyUI CONDITIONING -> the sampler's entries for a width x height pixel image (also the SDXL size
        defaults): per entry its context, y, guidance (FluxGuidance's, None without) and where and when it
        applies (engine/models/conditioning.py, sampler_entries). `seed` (the sampler's) seeds the noise
        augmentation of unCLIP image embeddings (engine/models/unclip.py)."""
        entries = sampler_entries(conditioning, height // 8, width // 8, self.model_sampling,
                                  lambda context, extras: self._model_inputs(context, extras, width, height,
                                                                             seed))
        return [dataclasses.replace(entry, control=entry.control.bound(self.model_sampling, self.unet))
                if isinstance(entry.control, Control) else entry for entry in entries]

    def _model_inputs(self, context: torch.Tensor, extras: Mapping[str, Any], width: int, height: int,
                      seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
        if context.shape[-1] != self.unet.config.context_dim:
            raise ValueError(f"conditioning width {context.shape[-1]} does not suit this {self.family} model "
                             f"(context_dim {self.unet.config.context_dim}); use the text encoder of the "
                             f"same model family")
        return context, self._adm(extras, width, height, seed), extras.get("guidance")

    def _adm(self, extras: Mapping[str, Any], width: int, height: int, seed: int = 0) -> torch.Tensor | None:
        """The vector condition y (ComfyUI encode_adm): SDXL's from the pooled text feature (or an unCLIP
        image embedding: revision) and the size fields; SD2.1 unCLIP's from the image embedding alone."""
        adm_channels = self.unet.config.adm_in_channels
        if adm_channels is None:
            return None
        unclip = extras.get("unclip_conditioning")
        if self.family == "sd2":  # SD2.1 unCLIP: y is the noise-augmented image embedding, zeros without one
            if unclip is None:
                return torch.zeros(1, adm_channels)
            return unclip_adm(unclip, seed, SD21_MERGE, adm_channels // 2)
        pooled = extras.get("pooled_output")
        if unclip is not None:
            pooled = unclip_adm(unclip, seed, SDXL_MERGE, SDXL_POOLED)[:, :SDXL_POOLED]
        if pooled is None:
            raise ValueError(f"this {self.family} model needs a pooled text feature; encode the prompt with "
                             f"the model's own (SDXL) text encoder")
        width, height = extras.get("width", width), extras.get("height", height)
        crop_w, crop_h = extras.get("crop_w", 0), extras.get("crop_h", 0)
        if self.family == "sdxl_refiner":
            score = extras.get("aesthetic_score", REFINER_AESTHETIC_SCORE)
            y = sdxl_refiner_adm(pooled, width, height, crop_w, crop_h, score)
        else:
            y = sdxl_adm(pooled, width, height, crop_w, crop_h, extras.get("target_width", width),
                         extras.get("target_height", height))
        if y.shape[-1] != self.unet.config.adm_in_channels:
            raise ValueError(f"the pooled text feature ({pooled.shape[-1]} wide) does not suit this model's "
                             f"vector condition ({self.unet.config.adm_in_channels} wide)")
        return y


@functools.cache
def _tokenizer_for(kind: str) -> CLIPTokenizer:
    """One shared tokenizer per encoder kind: CLIP-L pads with end-of-text, OpenCLIP with zeros."""
    return CLIPTokenizer(pad_with="eos" if kind == "clip_l" else "zero")


def build_conditioner(family: str, encoders: Sequence[CLIPTextModel]) -> Any:
    """The family's conditioner over its encoders (CLIP-L first for SDXL)."""
    builders = {"sd1": SD1Conditioner, "sd2": SD2Conditioner, "sdxl": SDXLConditioner,
                "sdxl_refiner": SDXLRefinerConditioner}
    if family not in builders:
        raise ValueError(f"unknown text encoder family {family!r}; accepted: {', '.join(builders)}")
    return builders[family](*encoders)


def _managed(memory: ModuleMemory | None, model: torch.nn.Module, index: int = 0) -> bool:
    """Whether `model` runs through the memory runtime. A copy made from it (a LoRA patch) runs as a plain
    module; that needs its weights on the device, so a copy of offloaded weights is refused clearly."""
    if memory is None:
        return False
    if memory.holds(index, model):
        return True
    if memory.params != "device":
        raise ValueError(f"a patched copy of the {memory.kind} model cannot run with its weights at "
                         f"{memory.params!r}; load it with params_backend device")
    return False


class ManagedEncoder:
    """Stands in for a CLIPTextModel inside a conditioner: the same calls, run through the memory runtime."""

    def __init__(self, model: CLIPTextModel, memory: ModuleMemory, index: int) -> None:
        self.model = model
        self.memory = memory
        self.index = index
        self.config = model.config
        self._device_marker = torch.empty(0, device=torch_device(memory.compute))

    def parameters(self) -> Any:
        """Only the device is read from it (`next(model.parameters()).device`)."""
        return iter((self._device_marker,))

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding vectors of `tokens` [B, T] -> [B, T, W], with the embedding weights staged in."""
        embeddings = self.model.stages()[0]
        stage = Stage("token_embeddings", embeddings.modules,
                      lambda state: {"embeds": self.model.token_embeddings(state["tokens"])})
        return self.memory.run(self.index, self.model, [stage], {"tokens": tokens})["embeds"]

    def __call__(self, tokens: torch.Tensor, clip_skip: int = 1, return_pooled: bool = False,
                 norm_hidden: bool = True, token_embeds: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """CLIPTextModel.forward through the runtime: (hidden [B, T, W], pooled or None)."""
        state = self.model.initial_state(tokens, clip_skip, return_pooled, norm_hidden, token_embeds)
        state = self.memory.run(self.index, self.model, self.model.stages(), state)
        return state["hidden"], state["pooled"]


@dataclass
class TextEncoder:
    """A family's CLIP encoder(s) with tokenizers and the chosen layer (ComfyUI's CLIP)."""

    family: str  # sd1, sd2, sdxl, sdxl_refiner
    encoders: tuple[CLIPTextModel, ...]  # in the conditioner's order (SDXL: CLIP-L, then bigG)
    conditioner: Any  # SD1Conditioner | SD2Conditioner | SDXLConditioner | SDXLRefinerConditioner
    compute_device: str
    clip_skip: int | None = None  # None: the family's default layer; n: the n-th layer from the end
    params_location: str = "device"
    sources: tuple[Path, ...] = ()
    memory: ModuleMemory | None = None  # set when the memory runtime holds the weights

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(encoder.config.kind for encoder in self.encoders)

    def clone_with_clip_skip(self, stop_at_clip_layer: int) -> TextEncoder:
        """ComfyUI's CLIPSetLastLayer: -1 = last layer, -2 = penultimate, ..."""
        layers = min(encoder.config.layers for encoder in self.encoders)
        if not -layers <= stop_at_clip_layer <= -1:
            raise ValueError(f"stop_at_clip_layer {stop_at_clip_layer} is out of range for this text encoder "
                             f"({layers} layers); accepted: -1 to {-layers}")
        return dataclasses.replace(self, clip_skip=-stop_at_clip_layer)

    def tokenize(self, text: str, embedding_lookup: EmbeddingLookup | None = None) -> dict[str, list]:
        """Weighted 77-token chunks of `text` per encoder kind."""
        return {encoder.config.kind: _tokenizer_for(encoder.config.kind).tokenize_weighted(
            text, _lookup_for(encoder, embedding_lookup)) for encoder in self.encoders}

    @torch.no_grad()
    def encode(self, text: str, embedding_lookup: EmbeddingLookup | None = None) -> ConditioningList:
        """CLIPTextEncode: `text` (with emphasis and `embedding:name`) -> ComfyUI CONDITIONING."""
        return self.encode_tokens(self.tokenize(text, embedding_lookup))

    @torch.no_grad()
    def encode_sdxl(self, text_g: str, text_l: str, embedding_lookup: EmbeddingLookup | None = None,
                    **size_fields: int) -> ConditioningList:
        """CLIPTextEncodeSDXL: `text_g` for bigG, `text_l` for CLIP-L, plus the SDXL size fields."""
        if self.family != "sdxl":
            raise ValueError(f"CLIPTextEncodeSDXL needs an SDXL text encoder (CLIP-L + bigG); this one is "
                             f"{self.family}")
        chunks = self.tokenize(text_g, embedding_lookup)
        chunks["clip_l"] = self.tokenize(text_l, embedding_lookup)["clip_l"]
        for kind, other in (("clip_l", "openclip_g"), ("openclip_g", "clip_l")):
            empty = _tokenizer_for(kind).tokenize_weighted("")[0]
            chunks[kind] = chunks[kind] + [empty] * (len(chunks[other]) - len(chunks[kind]))
        conditioning = self.encode_tokens(chunks)
        conditioning[0][1].update(size_fields)
        return conditioning

    def encode_tokens(self, chunks: Mapping[str, list]) -> ConditioningList:
        per_encoder = dict(chunks) if self.family == "sdxl" else chunks[self.kinds[0]]
        encoded = self.conditioner.encode(per_encoder, self.clip_skip)
        pooled = encoded.pooled.cpu() if encoded.pooled is not None else None
        return [[encoded.context.cpu(), {"pooled_output": pooled}]]


def _lookup_for(encoder: CLIPTextModel, embedding_lookup: EmbeddingLookup | None,
                ) -> Callable[[str], torch.Tensor | None] | None:
    """The tokenizer's name -> tensor lookup for one encoder, picking its tensor from an embedding file."""
    if embedding_lookup is None:
        return None
    config = encoder.config

    def lookup(name: str) -> torch.Tensor | None:
        tensors = embedding_lookup(name)
        if not tensors:
            return None
        for key in EMBEDDING_KEYS.get(config.kind, ()):
            if key in tensors:
                return tensors[key]
        fitting = [t for t in tensors.values() if t.ndim in (1, 2) and t.shape[-1] == config.width]
        if len(fitting) != 1:
            widths = sorted({int(t.shape[-1]) for t in tensors.values()})
            raise ValueError(f"embedding {name!r} has no single vector set of width {config.width} for the "
                             f"{config.kind} encoder; its widths: {widths}")
        return fitting[0]

    return lookup


@dataclass
class VAEModel:
    """The KL autoencoder in ComfyUI's raw latent space (ComfyUI's VAE)."""

    autoencoder: AutoencoderKL  # built with scale_factor 1 and shift 0: the DiffusionModel scales
    compute_device: str
    params_location: str = "device"
    source: Path | None = None
    memory: ModuleMemory | None = None  # set when the memory runtime holds the weights

    @property
    def torch_device(self) -> torch.device:
        return torch_device(self.compute_device)

    @property
    def latent_channels(self) -> int:
        return self.autoencoder.config.embed_dim

    @property
    def downscale(self) -> int:
        """Pixels per latent cell along each side (8 for SD's KL-f8)."""
        return 2 ** (len(self.autoencoder.config.ch_mult) - 1)

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, tiling: TilingConfig | None = None) -> torch.Tensor:
        """Raw latent [B, C, h, w] -> IMAGE [B, 8h, 8w, 3] float32 in 0..1 on the CPU.

        `tiling` (default off) decodes in tiles; a decode that runs out of memory retries tiled regardless.
        """
        tiling = tiling or TilingConfig("off")
        if latent.ndim != 4 or latent.shape[1] != self.latent_channels:
            raise ValueError(f"VAE decode needs a latent of shape (B, {self.latent_channels}, h, w); got "
                             f"{tuple(latent.shape)}")
        images = []
        for item in latent.split(1):  # one image at a time bounds the decoder's activations
            pixels = code_with_fallback(self.decode_pixels, item.to(self.torch_device), tiling,
                                        self.downscale)  # (1, 3, H, W) in about [-1, 1]
            images.append(((pixels.float() + 1.0) / 2.0).clamp(0, 1).permute(0, 2, 3, 1).cpu())
        return torch.cat(images)

    @torch.no_grad()
    def encode(self, image: torch.Tensor, tiling: TilingConfig | None = None) -> torch.Tensor:
        """IMAGE [B, H, W, C>=3] in 0..1 -> raw latent [B, C, H/8, W/8] (centre-cropped to multiples of 8).

        `tiling` as for `decode`, its absolute sizes in latent cells."""
        if image.ndim != 4 or image.shape[-1] < 3:
            raise ValueError(f"VAE encode needs an IMAGE of shape (B, H, W, 3); got {tuple(image.shape)}")
        factor = self.downscale
        height, width = (image.shape[1] // factor) * factor, (image.shape[2] // factor) * factor
        if not height or not width:
            raise ValueError(f"image of {image.shape[2]}x{image.shape[1]} pixels is too small to encode; "
                             f"accepted: at least {factor}x{factor}")
        top, left = (image.shape[1] % factor) // 2, (image.shape[2] % factor) // 2
        image = image[:, top:top + height, left:left + width, :3]
        tiling = tiling or TilingConfig("off")
        tile_pixels = None if tiling.tile_size is None else tiling.tile_size * factor
        in_pixels = dataclasses.replace(tiling, min_tile=tiling.min_tile * factor, tile_size=tile_pixels)
        latents = []
        for item in image.split(1):
            pixels = item.permute(0, 3, 1, 2).to(self.torch_device, torch.float32) * 2.0 - 1.0  # (1, 3, H, W)
            latent = code_with_fallback(self.encode_pixels, pixels.to(self.autoencoder.dtype), in_pixels,
                                        1 / factor, align=factor, what="encode")
            latents.append(latent.cpu())
        return torch.cat(latents)

    def decode_pixels(self, latent: torch.Tensor) -> torch.Tensor:
        """Raw latent [B, C, h, w] on the compute device -> float32 pixels [B, 3, 8h, 8w] in about [-1, 1]."""
        if not _managed(self.memory, self.autoencoder):
            return self.autoencoder.decode(latent)
        ae = self.autoencoder
        return self.memory.run(0, ae, ae.decoder_stages(), {"latent": latent})["pixels"].float()

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels [B, 3, H, W] in [-1, 1] on the compute device -> the posterior mean [B, C, H/8, W/8]."""
        if not _managed(self.memory, self.autoencoder):
            return self.autoencoder.encode(pixels)
        ae = self.autoencoder
        moments = self.memory.run(0, ae, ae.encoder_stages(), {"pixels": pixels})["moments"].float()
        mean = moments.chunk(2, dim=1)[0]  # (B, embed_dim, h, w); the log-variance half is unused
        return (mean - ae.config.shift_factor) * ae.config.scale_factor

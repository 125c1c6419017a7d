"""Control models on links and in conditioning, with ComfyUI's semantics (comfy/controlnet.py).

- `ControlModel` is ComfyUI's CONTROL_NET: a loaded ControlNet or T2I-Adapter network on its compute device,
  run through the memory runtime as module `controlnet` when that holds its weights.
- `Control` is what ControlNetApply puts under "control" in a conditioning entry's options: the model with
  a hint image, a strength, a step range (start and end percent of sampling) and the control it was chained
  onto (`previous`, the entry's earlier "control"). It stays unchanged while sampling; what it caches (the
  resized hint, an adapter's features) depends only on its inputs.
- `Control.bound(model_sampling, unet)` is the control for one diffusion model (ComfyUI's pre_run), checked
  against that UNet; the same object for every call, so that entries sharing a control batch together. Its
  `get_control(x, sigma, inputs, chunks)` is what the sampler calls per batched model call
  (engine/sampling/guidance.py's Control protocol).
- `Control.residuals(...)` is ComfyUI's get_control: the previous controls' residuals, then its own (None
  outside its step range), scaled by the strength and summed entry by entry. The result is the UNet's
  `control` dict (lists under "input", "middle", "output"; engine/models/unet.py says how the UNet adds them).

A ControlNet sees what the UNet sees: the sampler's x scaled by the model sampling's calculate_input, its
timestep, the cross-attention context and (SDXL) the vector condition y; its hint is the image resized to
8x the latent (nearest-exact, centre crop) and repeated to the batch (ComfyUI's broadcast_image_to). A
T2I-Adapter sees only the hint (its size rounded up to the adapter's unshuffle factor, averaged to one
channel for a one-channel adapter) and is run once per hint size and batch. "Shuffle" ControlNets (file names
ending in `_shuffle`) average each residual over its pixels (global_average_pooling).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.memory.runtime import ModuleMemory, torch_device
from engine.models.controlnet import ControlNetModel
from engine.models.t2i_adapter import T2IAdapterModel
from engine.models.unet import UNetEncoder
from engine.resize import resize

MEMORY_MODULE = "controlnet"
HINT_METHOD, HINT_CROP = "nearest-exact", "center"  # ComfyUI's upscale_algorithm and crop for hints
CONTROL_KINDS = ("input", "middle", "output")
ControlDict = dict[str, list[torch.Tensor | None]]


@dataclass
class ControlModel:
    """A loaded ControlNet or T2I-Adapter (ComfyUI's CONTROL_NET), before a hint is applied."""

    network: ControlNetModel | T2IAdapterModel
    compute_device: str  # Sluice device name, e.g. "cpu", "cuda0"
    params_location: str = "device"  # where the weights live: "device", "cpu" (pinned RAM) or "disk"
    source: Path | None = None
    global_average_pooling: bool = False  # shuffle ControlNets: residuals averaged over the pixels
    memory: ModuleMemory | None = None  # set when the memory runtime holds the weights

    @property
    def kind(self) -> str:
        return "t2i_adapter" if isinstance(self.network, T2IAdapterModel) else "controlnet"

    @property
    def dtype(self) -> torch.dtype:
        return self.network.dtype

    def apply(self, image: torch.Tensor, strength: float, percent_range: tuple[float, float] = (0.0, 1.0),
              previous: Control | None = None) -> Control:
        """The control of this model with hint `image` (IMAGE [B, H, W, C] in 0..1): ComfyUI's
        `control_net.copy().set_cond_hint(hint, strength, range)` then `set_previous_controlnet(previous)`."""
        if not isinstance(image, torch.Tensor) or image.ndim != 4:
            shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise ValueError(f"a control hint must be an IMAGE of shape (B, H, W, C); got {shape}")
        start, end = percent_range
        if not 0.0 <= start <= 1.0 or not 0.0 <= end <= 1.0:
            raise ValueError(f"start_percent {start} and end_percent {end} must lie in [0, 1]")
        return Control(self, image.movedim(-1, 1), float(strength), (float(start), float(end)), previous)

    @torch.no_grad()
    def run_network(self, *inputs: torch.Tensor | None) -> ControlDict:
        """The network's control dict for its inputs (ControlNet: x, hint, timesteps, context, y; adapter:
        hint), moved to its device, through the memory runtime when that holds the weights."""
        device = torch_device(self.compute_device)
        on_device = [t if t is None else t.to(device) for t in inputs]
        network = self.network
        if self.memory is not None and self.memory.holds(0, network):
            state = self.memory.run(0, network, network.stages(), network.initial_state(*on_device))
            return network.control_outputs(state)
        return network(*on_device)


@dataclass(eq=False)  # compared by identity: conditioning entries that share one Control batch together
class Control:
    """A control model with its hint, strength and step range, chained onto `previous` (ComfyUI's ControlBase
    after set_cond_hint and set_previous_controlnet)."""

    model: ControlModel
    hint: torch.Tensor  # (B, C, H, W) in 0..1, on the CPU
    strength: float
    percent_range: tuple[float, float]  # (start, end): the fraction of sampling during which it acts
    previous: Control | None = None
    _cache: dict[tuple, Any] = field(default_factory=dict, repr=False)  # hint size -> resized hint / features
    _bound: tuple[weakref.ref, BoundControl] | None = field(default=None, repr=False)  # (UNet, binding)

    def bound(self, model_sampling: Any, unet: UNetEncoder) -> BoundControl:
        """This control for the diffusion model of `model_sampling` and `unet` (the same object on every call
        for that model); ValueError when a control of the chain does not fit that UNet."""
        if self._bound is not None:
            unet_ref, binding = self._bound
            if unet_ref() is unet and binding.model_sampling is model_sampling:
                return binding
        for model in self.models():
            check_fits(model, unet)
        binding = BoundControl(self, model_sampling)
        self._bound = (weakref.ref(unet), binding)
        return binding

    def get_control(self, x: torch.Tensor, sigma: torch.Tensor, inputs: Any, chunks: int) -> ControlDict:
        raise ValueError("a ControlNet or T2I-Adapter applies to SD1.x, SD2.x and SDXL models only; this "
                         "model's conditioning does not take its control")

    def models(self) -> list[ControlModel]:
        """The control models of this control and those it is chained onto, earliest first."""
        earlier = self.previous.models() if self.previous is not None else []
        return [*earlier, self.model]

    def active(self, sigma: float, model_sampling: Any) -> bool:
        """Whether `sigma` lies in the step range (ComfyUI: not above start's sigma, not below end's)."""
        start, end = self.percent_range
        high = torch.tensor(model_sampling.percent_to_sigma(start), dtype=torch.float32)
        low = torch.tensor(model_sampling.percent_to_sigma(end), dtype=torch.float32)
        value = torch.tensor(sigma, dtype=torch.float32)
        return not bool(value > high or value < low)

    def residuals(self, x: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor, y: torch.Tensor | None,
                  batched_number: int, model_sampling: Any) -> ControlDict | None:
        """The UNet's control dict for one model call on x (B, C, h, w) at sigma (B,): this control's scaled
        residuals summed with the previous controls'; None when no control of the chain acts at sigma.

        `context` and `y` are the call's batched conditioning; `batched_number` is how many conditionings
        the batch holds (2 for positive and negative), which ComfyUI's hint broadcast divides by."""
        previous = None
        if self.previous is not None:
            previous = self.previous.residuals(x, sigma, context, y, batched_number, model_sampling)
        if not self.active(float(sigma[0]), model_sampling):
            return previous
        if self.model.kind == "t2i_adapter":
            own = self._adapter_features(x, batched_number)
            return merge_controls(own, previous, self.strength, False, x.dtype)
        hint = self._controlnet_hint(x, batched_number)
        x_in = model_sampling.calculate_input(sigma, x)
        timesteps = model_sampling.timestep(sigma.cpu()).to(x.device)
        own = self.model.run_network(x_in.to(self.model.dtype), hint, timesteps.float(),
                                     context.to(self.model.dtype),
                                     None if y is None else y.to(self.model.dtype))
        own = {kind: [r.to(x.device) for r in values] for kind, values in own.items()}
        return merge_controls(own, previous, self.strength, self.model.global_average_pooling, None)

    def _controlnet_hint(self, x: torch.Tensor, batched_number: int) -> torch.Tensor:
        factor = self.model.network.hint_downscale
        size = (x.shape[2] * factor, x.shape[3] * factor)
        key = ("controlnet", size)
        if key not in self._cache:
            self._cache.clear()
            self._cache[key] = resize(self.hint.float(), size[1], size[0], HINT_METHOD, HINT_CROP)
        return broadcast_image_to(self._cache[key], x.shape[0], batched_number).to(self.model.dtype)

    def _adapter_features(self, x: torch.Tensor, batched_number: int) -> ControlDict:
        network = self.model.network
        unshuffle = network.config.unshuffle
        height, width = (math.ceil(side * network.hint_downscale / unshuffle) * unshuffle
                         for side in x.shape[2:])
        key = ("t2i_adapter", height, width, x.shape[0], batched_number)
        if key not in self._cache:
            self._cache.clear()
            hint = resize(self.hint.float(), width, height, HINT_METHOD, HINT_CROP)
            if network.config.in_channels == 1 and hint.shape[1] > 1:
                hint = hint.mean(dim=1, keepdim=True)  # (B, 1, H, W)
            hint = broadcast_image_to(hint, x.shape[0], batched_number)
            features = self.model.run_network(hint)
            self._cache[key] = {kind: [None if f is None else f.cpu() for f in values]
                                for kind, values in features.items()}
        return {kind: [None if f is None else f.to(x.device) for f in values]
                for kind, values in self._cache[key].items()}


@dataclass(eq=False)
class BoundControl:
    """A control for one diffusion model: what the sampler's entries carry (guidance.Control)."""

    control: Control
    model_sampling: Any  # the diffusion model's (calculate_input, timestep, percent_to_sigma)

    def get_control(self, x: torch.Tensor, sigma: torch.Tensor, inputs: Mapping[str, torch.Tensor | None],
                    chunks: int) -> ControlDict | None:
        """The UNet's control dict for one model call of `chunks` conditionings batched on x (B, C, h, w)."""
        return self.control.residuals(x, sigma, inputs["context"], inputs.get("y"), chunks,
                                      self.model_sampling)


def check_fits(model: ControlModel, unet: UNetEncoder) -> None:
    """ValueError unless the control model's residuals fit the UNet: a ControlNet's copy of the encoder must
    have the UNet's widths, context width and vector condition; an adapter's levels the UNet's widths where
    ComfyUI adds them."""
    network, config = model.network, unet.config
    if isinstance(network, ControlNetModel):
        ours = network.config
        if (network.skip_channels, ours.context_dim, ours.adm_in_channels) != (
                unet.skip_channels, config.context_dim, config.adm_in_channels):
            raise ValueError(f"this ControlNet ({ours.family}, block widths {list(network.skip_channels)}, "
                             f"context {ours.context_dim}) does not fit the {config.family} model (block "
                             f"widths {list(unet.skip_channels)}, context {config.context_dim}); use a "
                             f"ControlNet made for the model's family")
        return
    widths = {**dict(enumerate(unet.skip_channels)), "middle": unet.channels}
    placement = network.feature_blocks()
    if any(widths.get(block) != channels for block, channels in placement):
        raise ValueError(f"this {network.config.kind} T2I-Adapter (features {[c for _, c in placement]} at "
                         f"UNet blocks {[b for b, _ in placement]}) does not fit the {config.family} model; "
                         f"use an adapter made for the model's family")


def broadcast_image_to(hint: torch.Tensor, batch: int, batched_number: int) -> torch.Tensor:
    """The hint repeated to `batch` rows as ComfyUI's broadcast_image_to: a batch of one broadcasts as it is;
    otherwise its first batch / batched_number rows are cycled, then repeated once per conditioning."""
    if hint.shape[0] == 1:
        return hint
    per_batch = batch // batched_number
    hint = hint[:per_batch]
    if per_batch > hint.shape[0]:
        repeats = [hint] * (per_batch // hint.shape[0]) + [hint[:per_batch % hint.shape[0]]]
        hint = torch.cat(repeats)
    return hint if hint.shape[0] == batch else torch.cat([hint] * batched_number)


def merge_controls(own: ControlDict, previous: ControlDict | None, strength: float, average_pooling: bool,
                   dtype: torch.dtype | None) -> ControlDict:
    """ComfyUI's control_merge: each residual (averaged over H, W for shuffle ControlNets) times the strength
    (in `dtype` when given), then the previous controls' residuals added entry by entry."""
    out: ControlDict = {kind: [] for kind in CONTROL_KINDS}
    for kind, residuals in own.items():
        for residual in residuals:
            if residual is not None:
                if average_pooling:
                    residual = residual.mean(dim=(2, 3), keepdim=True).expand_as(residual)
                residual = residual * strength
                if dtype is not None:
                    residual = residual.to(dtype)
            out[kind].append(residual)
    if previous is not None:
        for kind in CONTROL_KINDS:
            merged = out[kind]
            for index, earlier in enumerate(previous.get(kind, [])):
                if index >= len(merged):
                    merged.append(earlier)
                elif earlier is not None:
                    merged[index] = earlier if merged[index] is None else earlier + merged[index]
    return out


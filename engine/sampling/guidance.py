"""Classifier-free guidance (Ho & Salimans 2022) around a k-diffusion denoiser.

`CFGDenoiser` evaluates the positive and negative conditioning in ONE batched model call and mixes
`uncond + cfg * (cond - uncond)`; at cfg == 1 the negative pass is skipped entirely.

CFG++ samplers (Chung et al. 2024) need the unconditional prediction as well as the guided one. The
mechanism: a sampler sets `model.keep_uncond = True` before its loop; the CFG denoiser then always runs
the negative pass (even at cfg == 1) and stores it in `model.last_uncond_denoised` after every call. A
denoiser without guidance has no such attribute; for it the unconditional prediction is the prediction.

Inpainting UNets (9 input channels) take a `concat` per conditioning side (mask and masked-image latent,
ComfyUI's c_concat), batched like y.

Guidance-distilled models (FLUX dev) take the guidance strength as an input instead: a `Conditioning` may
carry `guidance`, which the model call receives as a (B,) tensor `guidance=` (cond rows then uncond rows, like
y). The model bundle fills its own default (FLUX: 3.5, as ComfyUI); where only one side carries a value, the
other side takes it, so the batched call always has one value per row.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Conditioning:
    """Text conditioning: cross-attention context (B, T, C), the optional SDXL ADM vector y (B, D), the
    optional guidance strength of guidance-distilled models (FLUX) and the optional extra input channels of
    inpainting models."""

    context: torch.Tensor
    y: torch.Tensor | None = None
    guidance: float | None = None  # FluxGuidance's value; None: the model takes no guidance input
    concat: torch.Tensor | None = None  # (B, C', h, w) channels after the latent's (inpainting UNets)

    def __post_init__(self) -> None:
        if self.context.ndim != 3:
            raise ValueError(f"conditioning context must be (batch, tokens, channels); got shape "
                             f"{tuple(self.context.shape)}")
        if self.y is not None and self.y.ndim != 2:
            raise ValueError(f"conditioning y must be (batch, features); got shape {tuple(self.y.shape)}")
        if self.concat is not None and self.concat.ndim != 4:
            raise ValueError(f"conditioning concat must be (batch, channels, height, width); got shape "
                             f"{tuple(self.concat.shape)}")


def repeat_to_batch(t: torch.Tensor, batch: int) -> torch.Tensor:
    """Broadcast a batch-1 (or batch-dividing) tensor to `batch` rows: (b, ...) -> (batch, ...)."""
    if t.shape[0] == batch:
        return t
    if batch % t.shape[0] != 0:
        raise ValueError(f"conditioning batch {t.shape[0]} does not divide the latent batch {batch}")
    return t.repeat(batch // t.shape[0], *([1] * (t.ndim - 1)))


def match_token_lengths(contexts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Repeat each context along tokens to the LCM of their lengths, as ComfyUI's CONDCrossAttn.concat.

    Valid for CLIP contexts made of independent 77-token chunks: repeating a prompt's chunks leaves the
    attention output unchanged, since softmax attention over a repeated key set is the same average.
    """
    length = math.lcm(*(c.shape[1] for c in contexts))
    return [c.repeat(1, length // c.shape[1], 1) for c in contexts]  # (B, length, C)


def guidance_rows(values: list[float | None], batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """`{"guidance": (len(values) * batch,)}` for the model call, one value per side; {} when no side has one.

    A side without a value takes the first value given (the model bundle supplies its default per side).
    """
    given = [v for v in values if v is not None]
    if not given:
        return {}
    rows = [torch.full((batch,), float(given[0] if v is None else v), device=device) for v in values]
    return {"guidance": torch.cat(rows)}  # (sides * B,)


def concat_rows(sides: list[Conditioning], batch: int) -> dict[str, torch.Tensor]:
    """`{"concat": (len(sides) * batch, C', h, w)}` for the model call (cond rows, then uncond); {} when no
    side has one. Sides must all have one or none."""
    concats = [side.concat for side in sides]
    if all(c is None for c in concats):
        return {}
    if any(c is None for c in concats):
        raise ValueError("positive and negative conditioning must both carry the inpainting model's extra "
                         "channels (concat) or neither")
    return {"concat": torch.cat([repeat_to_batch(c, batch) for c in concats])}


def cfg_mix(cond: torch.Tensor, uncond: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """uncond + cfg * (cond - uncond)."""
    return uncond + (cond - uncond) * cfg_scale


class CFGDenoiser:
    """A k-diffusion denoiser with classifier-free guidance: (x, sigma) -> guided x0."""

    def __init__(self, model, cond: Conditioning, uncond: Conditioning | None, cfg_scale: float,
                 check_interrupt: Callable[[], None] | None = None):
        if uncond is None and cfg_scale != 1.0:
            raise ValueError(f"cfg {cfg_scale} needs a negative conditioning (give one, or use cfg 1.0)")
        self.model, self.cond, self.uncond, self.cfg_scale = model, cond, uncond, float(cfg_scale)
        self.check_interrupt = check_interrupt  # called before every model evaluation; raise to abort
        self.model_sampling = getattr(model, "model_sampling", None)
        self.keep_uncond = False
        self.last_uncond_denoised: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra_args: object) -> torch.Tensor:
        if self.check_interrupt is not None:
            self.check_interrupt()
        batch = x.shape[0]
        sigma = torch.as_tensor(sigma, device=x.device).expand(batch)  # (B,)
        run_uncond = self.uncond is not None and (self.cfg_scale != 1.0 or self.keep_uncond)
        if not run_uncond:
            cond = self.model(x, sigma, context=repeat_to_batch(self.cond.context, batch),
                              y=None if self.cond.y is None else repeat_to_batch(self.cond.y, batch),
                              **guidance_rows([self.cond.guidance], batch, x.device),
                              **concat_rows([self.cond], batch), **extra_args)
            self.last_uncond_denoised = cond
            return cond
        contexts = match_token_lengths([repeat_to_batch(c.context, batch) for c in (self.cond, self.uncond)])
        ys = [c.y for c in (self.cond, self.uncond)]
        if (ys[0] is None) != (ys[1] is None):
            raise ValueError("positive and negative conditioning must both have a y (SDXL) vector or neither")
        y = None if ys[0] is None else torch.cat([repeat_to_batch(v, batch) for v in ys])  # (2B, D)
        guidance = guidance_rows([self.cond.guidance, self.uncond.guidance], batch, x.device)
        concat = concat_rows([self.cond, self.uncond], batch)
        out = self.model(torch.cat([x, x]), torch.cat([sigma, sigma]), context=torch.cat(contexts), y=y,
                         **guidance, **concat, **extra_args)  # (2B, ...)
        cond, uncond = out[:batch], out[batch:]
        self.last_uncond_denoised = uncond
        return cfg_mix(cond, uncond, self.cfg_scale)

"""Classifier-free guidance (Ho & Salimans 2022) over ComfyUI's conditioning entries.

A side of the guidance (the positive prompt, the negative one, PerpNeg's empty prompt, DualCFG's middle
prompt) is a list of `Conditioning` entries, as a ComfyUI CONDITIONING is a list of [cond, {options}]. An
entry carries what the model call needs (context, the vector y, the guidance strength of distilled models,
the extra input channels of inpainting models) and where and when it applies: an area of the latent, a mask
and its strength, a weight (strength), a sigma range, and a control (ControlNet) computed in its model call.

`calc_cond_batch` predicts x0 for every side as ComfyUI's calc_cond_batch (comfy/samplers.py): each entry's
crop of x (its area) is predicted, added to its side's output times the entry's multiplier (mask * mask
strength * strength; without a mask, an area's inner edges ramp up over FEATHER cells), the multipliers are
summed, and the output divided by the sum (which starts at COUNT_FLOOR, so a cell no entry covers predicts 0).
Entries whose crops have one shape, whose contexts can be repeated to one length (at most MAX_TOKEN_REPEAT
times the shorter), whose y and guidance agree and whose control is the same object run in one batched call;
an entry with a middle patch (GLIGEN's grounding, run inside the UNet's transformers) runs alone.

Before sampling, `prepare_sides` gives every side an entry for each area another side has (ComfyUI's
create_cond_with_same_area_if_none: the area's own options with the model inputs of the smallest entry of
that side enclosing it), and hands a positive control marked `control_apply_to_uncond` to the other sides'
entries without area or control (apply_empty_x_to_equal_area).

`CFGDenoiser` mixes `uncond + cfg * (cond - uncond)`; at cfg == 1 the negative side is not run. A model may
replace that mix with its `cfg_function` (RescaleCFG, PerpNeg: `CfgInputs` -> guided x0). `PerpNegDenoiser`
and `DualCFGDenoiser` are ComfyUI's PerpNegGuider and DualCFGGuider.

CFG++ samplers (Chung et al. 2024) need the unconditional prediction as well as the guided one: a sampler sets
`model.keep_uncond = True` before its loop; the denoiser then always runs the negative side (even at cfg 1)
and stores its prediction in `model.last_uncond_denoised` after every call. A denoiser without guidance has no
such attribute; for it the unconditional prediction is the prediction.

Guidance-distilled models (FLUX dev) take the guidance strength as an input: an entry may carry `guidance`,
which the model call receives as a (B,) tensor `guidance=`. Entries without one take the first value any
entry of the job gives (the model bundle fills its own default, FLUX: 3.5, as ComfyUI).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

COUNT_FLOOR = 1e-37  # the starting weight sum of every cell (ComfyUI's)
FEATHER = 8  # cells over which an area's weight ramps up from each inner edge (at most a quarter of its size)
MAX_TOKEN_REPEAT = 4  # contexts batch together when the LCM of their lengths is at most 4x the shorter one


class MiddlePatchSource(Protocol):
    """What an entry's `middle_patch` offers: the model call's `middle_patch=` input for a call on x
    (B, C, h, w) (ComfyUI's gligen patch, made per cond per call: such entries never batch with others)."""

    def middle_patch(self, x: torch.Tensor) -> Any: ...


class Control(Protocol):
    """What an entry's `control` offers: the model call's `control=` input for a batch of entries (ComfyUI's
    ControlBase.get_control). `inputs` holds the batch's "context" (B, T, C), "y" and "guidance" (or None)."""

    def get_control(self, x: torch.Tensor, sigma: torch.Tensor, inputs: Mapping[str, torch.Tensor | None],
                    chunks: int) -> Any: ...


@dataclass
class Conditioning:
    """One conditioning entry: the model's inputs and where and when they apply (ComfyUI's [cond, {options}]).

    An entry with every option at its default applies to the whole latent at every step with weight 1.
    """

    context: torch.Tensor  # (B, T, C): cross-attention context (B = 1 repeats over the latent batch)
    y: torch.Tensor | None = None  # (B, D): the vector condition (SDXL's ADM, FLUX's pooled CLIP-L)
    guidance: float | None = None  # FluxGuidance's value; None: the model takes no guidance input
    concat: torch.Tensor | None = None  # (B, C', H, W) at the latent's size: channels an inpainting UNet
    # takes after the latent's (ComfyUI's c_concat), cropped to the area as the latent is
    area: tuple[int, int, int, int] | None = None  # (height, width, top, left) in latent cells; None: all
    mask: torch.Tensor | None = None  # (B or 1, h, w) at the latent's size: the entry's weight per cell
    mask_strength: float = 1.0  # multiplies the mask
    strength: float = 1.0  # multiplies the entry's weight everywhere
    sigma_start: float | None = None  # not applied at sigma above it (ComfyUI's timestep_start)
    sigma_end: float | None = None  # not applied at sigma below it (ComfyUI's timestep_end)
    control: Control | None = None  # adds its control to the model call (ControlNet)
    control_apply_to_uncond: bool = False  # a positive entry's control also serves the other sides
    middle_patch: MiddlePatchSource | None = None  # GLIGEN's grounding (runs inside the UNet's transformers)

    def __post_init__(self) -> None:
        if self.context.ndim != 3:
            raise ValueError(f"conditioning context must be (batch, tokens, channels); got shape "
                             f"{tuple(self.context.shape)}")
        if self.y is not None and self.y.ndim != 2:
            raise ValueError(f"conditioning y must be (batch, features); got shape {tuple(self.y.shape)}")
        if self.area is not None and (len(self.area) != 4 or min(self.area) < 0 or min(self.area[:2]) < 1):
            raise ValueError(f"conditioning area must be (height, width, top, left) in latent cells, size at "
                             f"least 1 and offsets at least 0; got {self.area}")
        if self.concat is not None and self.concat.ndim != 4:
            raise ValueError(f"conditioning concat must be (batch, channels, height, width); got shape "
                             f"{tuple(self.concat.shape)}")
        if self.mask is not None and self.mask.ndim != 3:
            raise ValueError(f"conditioning mask must be (batch, height, width); got shape "
                             f"{tuple(self.mask.shape)}")


Side = Sequence[Conditioning]


@dataclass(frozen=True)
class CfgInputs:
    """What a model's cfg function (ComfyUI's sampler_cfg_function) is given; it returns the guided x0."""

    cond_denoised: torch.Tensor  # (B, C, H, W): the positive side's x0
    uncond_denoised: torch.Tensor  # the negative side's x0 (zeros where the negative side did not run)
    cond_scale: float
    x: torch.Tensor  # the noisy input
    sigma: torch.Tensor  # (B,)
    model: Any  # the denoiser the guidance calls, for functions that need further predictions


CfgFunction = Callable[[CfgInputs], torch.Tensor]


def repeat_to_batch(t: torch.Tensor, batch: int) -> torch.Tensor:
    """`batch` rows of t: its first ones, repeated as often as needed (ComfyUI's repeat_to_batch_size)."""
    if t.shape[0] > batch:
        return t[:batch]
    if t.shape[0] < batch:
        return t.repeat(math.ceil(batch / t.shape[0]), *([1] * (t.ndim - 1)))[:batch]
    return t


def match_token_lengths(contexts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Repeat each context along tokens to the LCM of their lengths, as ComfyUI's CONDCrossAttn.concat.

    Valid for CLIP contexts made of independent 77-token chunks: repeating a prompt's chunks leaves the
    attention output unchanged, since softmax attention over a repeated key set is the same average.
    """
    length = math.lcm(*(c.shape[1] for c in contexts))
    # (B, length, C) each
    return [c if c.shape[1] == length else c.repeat(1, length // c.shape[1], 1) for c in contexts]


def cfg_mix(cond: torch.Tensor, uncond: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """uncond + cfg * (cond - uncond)."""
    return uncond + (cond - uncond) * cfg_scale


# ---------------------------------------------------------------------------------------------- preparing


def _as_side(side: Conditioning | Side | None) -> list[Conditioning] | None:
    if side is None:
        return None
    return [side] if isinstance(side, Conditioning) else list(side)


def _inside(inner: tuple[int, ...], outer: tuple[int, ...]) -> bool:
    """Whether area `inner` lies within area `outer` (both (height, width, top, left))."""
    return (inner[2] >= outer[2] and inner[3] >= outer[3] and inner[0] + inner[2] <= outer[0] + outer[2]
            and inner[1] + inner[3] <= outer[1] + outer[3])


def _add_same_area(side: list[Conditioning], entry: Conditioning) -> None:
    """ComfyUI's create_cond_with_same_area_if_none: unless `side` has an entry of `entry`'s area, add one
    with `entry`'s options and the model inputs of the smallest entry of `side` enclosing it (or of its first
    entry without area when none does)."""
    if entry.area is None:
        return
    smallest = None
    for other in side:
        if other.area is None:
            smallest = other if smallest is None else smallest
        elif _inside(entry.area, other.area) and (
                smallest is None or smallest.area is None
                or smallest.area[0] * smallest.area[1] > other.area[0] * other.area[1]):
            smallest = other
    if smallest is None or (smallest.area is not None and tuple(smallest.area) == tuple(entry.area)):
        return
    side.append(dataclasses.replace(entry, context=smallest.context, y=smallest.y,
                                    guidance=smallest.guidance))


def _share_controls(positive: list[Conditioning], side: list[Conditioning]) -> None:
    """ComfyUI's apply_empty_x_to_equal_area for controls: each positive control marked to apply to the
    unconditional side goes, in turn, to an entry of `side` without area and control, unless `side` has a
    control of its own."""
    controls = [e.control for e in positive if e.control_apply_to_uncond and e.area is None
                and e.control is not None]
    if not controls or any(e.area is None and e.control is not None for e in side):
        return
    free = [(index, entry) for index, entry in enumerate(side) if entry.area is None]
    for turn, control in enumerate(controls):
        if free:
            index, entry = free[turn % len(free)]
            side[index] = dataclasses.replace(entry, control=control)


def prepare_sides(sides: Sequence[Conditioning | Side | None]) -> list[list[Conditioning] | None]:
    """The sides (the positive one first) as ComfyUI's process_conds leaves them: areas mirrored across sides,
    shared controls handed on, and the job's guidance given to the entries without one."""
    prepared = [_as_side(side) for side in sides]
    present = [side for side in prepared if side is not None]
    for index, side in enumerate(present):
        for entry in list(side):
            for other_index, other in enumerate(present):
                if other_index != index:
                    _add_same_area(other, entry)
    for side in present[1:]:
        _share_controls(present[0], side)
    entries = [entry for side in present for entry in side]
    if len({entry.y is None for entry in entries}) > 1:
        raise ValueError("positive and negative conditioning must both have a y (SDXL) vector or neither")
    given = next((entry.guidance for entry in entries if entry.guidance is not None), None)
    if given is not None:
        for side in present:
            side[:] = [e if e.guidance is not None else dataclasses.replace(e, guidance=given) for e in side]
    return prepared


# ---------------------------------------------------------------------------------------------- predicting


@dataclass
class _Piece:
    """One entry at one step (ComfyUI's cond_obj): its crop of x, its multiplier and its resolved area."""

    x: torch.Tensor  # (B, C, h, w)
    mult: torch.Tensor  # (B, C, h, w)
    entry: Conditioning
    area: tuple[int, int, int, int] | None
    side: int


def _feather(mult: torch.Tensor, area: tuple[int, int, int, int], full: tuple[int, int]) -> None:
    """Ramp `mult` (B, C, h, w) up from each edge of the area that lies inside the latent (in place)."""
    for dim in range(2):
        size, start = area[dim], area[2 + dim]
        ramp = min(FEATHER, mult.shape[2 + dim] // 4)
        if start != 0:
            for t in range(ramp):
                mult.narrow(2 + dim, t, 1).mul_((1.0 / ramp) * (t + 1))
        if size + start < full[dim]:
            for t in range(ramp):
                mult.narrow(2 + dim, size - 1 - t, 1).mul_((1.0 / ramp) * (t + 1))


def _piece(entry: Conditioning, side: int, x: torch.Tensor, sigma: torch.Tensor) -> _Piece | None:
    """The entry's crop and multiplier at this sigma; None when its sigma range excludes the step."""
    if entry.sigma_start is not None or entry.sigma_end is not None:
        now = float(sigma[0])  # read only when needed: on a GPU it waits for the work queued before it
        if (entry.sigma_start is not None and now > entry.sigma_start) or (
                entry.sigma_end is not None and now < entry.sigma_end):
            return None
    height, width = x.shape[-2:]
    area, crop = None, x
    if entry.area is not None:
        h, w, top, left = entry.area
        area = (min(height - top, h), min(width - left, w), top, left)
        if area[0] < 1 or area[1] < 1:
            raise ValueError(f"conditioning area {entry.area} (height, width, top, left) lies outside the "
                             f"latent of {height} x {width} cells")
        crop = x[:, :, top:top + area[0], left:left + area[1]]
    if entry.mask is None:
        mult = torch.ones_like(crop) * entry.strength
        if area is not None:
            _feather(mult, area, (height, width))
        return _Piece(crop, mult, entry, area, side)
    mask = entry.mask.to(x.device)
    if tuple(mask.shape[-2:]) != (height, width):
        raise ValueError(f"conditioning mask of {tuple(mask.shape[-2:])} cells does not match the latent's "
                         f"{height} x {width}; resize it to the latent first")
    mask = mask[:x.shape[0]]
    if area is not None:
        mask = mask[:, area[2]:area[2] + area[0], area[3]:area[3] + area[1]]
    if crop.shape[0] % mask.shape[0]:
        raise ValueError(f"a batch of {mask.shape[0]} conditioning masks does not divide the latent batch of "
                         f"{crop.shape[0]}")
    mask = (mask * entry.mask_strength).unsqueeze(1)  # (b, 1, h, w)
    mask = mask.repeat(crop.shape[0] // mask.shape[0], crop.shape[1], 1, 1)  # (B, C, h, w)
    return _Piece(crop, mask * entry.strength, entry, area, side)


def _contexts_batch(a: torch.Tensor, b: torch.Tensor) -> bool:
    """ComfyUI's CONDCrossAttn.can_concat (once both are repeated to the latent batch): one width, and lengths
    whose LCM is at most MAX_TOKEN_REPEAT times the shorter one."""
    (length_a, width_a), (length_b, width_b) = a.shape[1:], b.shape[1:]
    if width_a != width_b:
        return False
    return math.lcm(length_a, length_b) // min(length_a, length_b) <= MAX_TOKEN_REPEAT


def _batches_with(piece: _Piece, first: _Piece) -> bool:
    """ComfyUI's can_concat_cond: whether `piece` can run in the model call of `first`."""
    a, b = piece.entry, first.entry
    if piece.x.shape != first.x.shape or a.control is not b.control:
        return False
    if (a.middle_patch is not None or b.middle_patch is not None) and piece is not first:
        return False
    if (a.y is None) != (b.y is None) or (a.y is not None and a.y.shape[1:] != b.y.shape[1:]):
        return False
    if (a.guidance is None) != (b.guidance is None) or (a.concat is None) != (b.concat is None):
        return False
    if a.concat is not None and a.concat.shape[:2] != b.concat.shape[:2]:
        return False
    return _contexts_batch(a.context, b.context)


def _crop(t: torch.Tensor, area: tuple[int, int, int, int] | None) -> torch.Tensor:
    """t (B, C, H, W) cut to the area (ComfyUI's CONDNoiseShape.process_cond)."""
    if area is None:
        return t
    h, w, top, left = area
    return t[:, :, top:top + h, left:left + w]


def _batched_conditioning(group: list[_Piece], batch: int, cache: dict | None,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The group's contexts (chunks * B, tokens, C) and pooled vectors y (chunks * B, adm) or None, in one
    batch each; kept in `cache` for the next steps, which batch the same entries."""
    entries = tuple(piece.entry for piece in group)
    key = (batch, tuple(id(entry) for entry in entries))
    if cache is not None and key in cache:
        return cache[key][1:]  # the cached value holds `entries`, so their ids stay theirs
    context = torch.cat(match_token_lengths([repeat_to_batch(entry.context, batch) for entry in entries]))
    y = None if entries[0].y is None else torch.cat([repeat_to_batch(entry.y, batch) for entry in entries])
    if cache is not None:
        cache[key] = (entries, context, y)
    return context, y


def _run_batch(model: Any, group: list[_Piece], sigma: torch.Tensor, extra_args: Mapping[str, Any],
               cache: dict | None = None) -> tuple[torch.Tensor, ...]:
    """One model call for the pieces of `group`: their x0, one (B, C, h, w) chunk each."""
    batch, chunks = group[0].x.shape[0], len(group)
    x = torch.cat([piece.x for piece in group])  # (chunks * B, C, h, w)
    context, y = _batched_conditioning(group, batch, cache)
    inputs: dict[str, Any] = {"context": context, "y": y}
    first = group[0].entry
    if first.guidance is not None:
        inputs["guidance"] = torch.cat([torch.full((batch,), float(p.entry.guidance), device=x.device)
                                        for p in group])  # (chunks * B,)
    if first.concat is not None:
        inputs["concat"] = torch.cat([repeat_to_batch(_crop(p.entry.concat, p.area), batch) for p in group])
    sigmas = sigma.repeat(chunks)  # (chunks * B,)
    if first.control is not None:
        batch_inputs = {"context": inputs["context"], "y": inputs["y"], "guidance": inputs.get("guidance")}
        inputs["control"] = first.control.get_control(x, sigmas, batch_inputs, chunks)
    if first.middle_patch is not None:
        inputs["middle_patch"] = first.middle_patch.middle_patch(x)
    return model(x, sigmas, **inputs, **extra_args).chunk(chunks)


def calc_cond_batch(model: Any, sides: Sequence[Side | None], x: torch.Tensor, sigma: torch.Tensor,
                    context_cache: dict | None = None, **extra_args: Any) -> list[torch.Tensor]:
    """x0 predicted for each side on x (B, C, H, W) at sigma (B,), as ComfyUI's calc_cond_batch; a side that
    is None (not run) predicts zeros. `context_cache` (a dict the caller keeps over its steps) saves
    batching the same prompts' tensors again at every step."""
    outputs = [torch.zeros_like(x) for _ in sides]
    counts = [torch.full_like(x, COUNT_FLOOR) for _ in sides]
    pending = [piece for index, side in enumerate(sides) for entry in side or ()
               if (piece := _piece(entry, index, x, sigma)) is not None]
    while pending:
        group = [piece for piece in pending if _batches_with(piece, pending[0])]
        pending = [piece for piece in pending if not any(piece is member for member in group)]
        for piece, predicted in zip(group, _run_batch(model, group, sigma, extra_args, context_cache),
                                    strict=True):
            out, count = outputs[piece.side], counts[piece.side]
            if piece.area is not None:
                h, w, top, left = piece.area
                out, count = out[:, :, top:top + h, left:left + w], count[:, :, top:top + h, left:left + w]
            out += predicted * piece.mult
            count += piece.mult
    return [out / count for out, count in zip(outputs, counts, strict=True)]


# ---------------------------------------------------------------------------------------------- guiders


class _Guided:
    """What the guided denoisers share: prepared sides, the interrupt check and the model's cfg function."""

    def __init__(self, model: Any, sides: Sequence[Conditioning | Side | None],
                 check_interrupt: Callable[[], None] | None):
        self.model = model
        self.sides = prepare_sides(sides)
        self.check_interrupt = check_interrupt  # called before every model evaluation; raise to abort
        self.model_sampling = getattr(model, "model_sampling", None)
        self.cfg_function: CfgFunction | None = getattr(model, "cfg_function", None)
        self.keep_uncond = False
        self.last_uncond_denoised: torch.Tensor | None = None
        self._contexts: dict = {}  # calc_cond_batch's batched prompt tensors, for the steps after the first

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, sides: Sequence[Side | None],
                 extra_args: Mapping[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.check_interrupt is not None:
            self.check_interrupt()
        sigma = torch.as_tensor(sigma, device=x.device).expand(x.shape[0])  # (B,)
        return sigma, calc_cond_batch(self.model, sides, x, sigma, self._contexts, **extra_args)

    def _cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float, x: torch.Tensor,
             sigma: torch.Tensor) -> torch.Tensor:
        """ComfyUI's cfg_function: the model's cfg function when it has one, else the CFG mix."""
        if self.cfg_function is not None:
            return self.cfg_function(CfgInputs(cond, uncond, scale, x, sigma, self.model))
        return cfg_mix(cond, uncond, scale)


class CFGDenoiser(_Guided):
    """A k-diffusion denoiser with classifier-free guidance: (x, sigma) -> guided x0.

    `cond` and `uncond` are an entry or a list of entries each; `uncond` may be None at cfg 1.
    """

    def __init__(self, model: Any, cond: Conditioning | Side, uncond: Conditioning | Side | None,
                 cfg_scale: float, check_interrupt: Callable[[], None] | None = None):
        if uncond is None and not math.isclose(cfg_scale, 1.0):
            raise ValueError(f"cfg {cfg_scale} needs a negative conditioning (give one, or use cfg 1.0)")
        super().__init__(model, [cond, uncond], check_interrupt)
        self.cfg_scale = float(cfg_scale)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra_args: Any) -> torch.Tensor:
        cond, uncond = self.sides
        run_uncond = uncond is not None and (not math.isclose(self.cfg_scale, 1.0) or self.keep_uncond)
        sides = [cond, uncond if run_uncond else None]
        sigma, (cond_x0, uncond_x0) = self._predict(x, sigma, sides, extra_args)
        self.last_uncond_denoised = uncond_x0 if run_uncond else cond_x0
        return self._cfg(cond_x0, uncond_x0, self.cfg_scale, x, sigma)


def perp_neg(cond: torch.Tensor, negative: torch.Tensor, empty: torch.Tensor, neg_scale: float,
             cond_scale: float) -> torch.Tensor:
    """Perp-Neg (Armandpour et al. 2023): guide along the positive direction and against only the part of the
    negative direction perpendicular to it (directions from the empty prompt's x0, over the whole batch)."""
    positive_dir, negative_dir = cond - empty, negative - empty
    projection = (negative_dir * positive_dir).sum() / torch.norm(positive_dir) ** 2
    perpendicular = negative_dir - projection * positive_dir
    return empty + cond_scale * (positive_dir - perpendicular * neg_scale)


class PerpNegDenoiser(_Guided):
    """ComfyUI's PerpNegGuider: the positive, negative and empty prompts in one batch, mixed by `perp_neg`."""

    def __init__(self, model: Any, cond: Conditioning | Side, uncond: Conditioning | Side,
                 empty: Conditioning | Side, cfg_scale: float, neg_scale: float,
                 check_interrupt: Callable[[], None] | None = None):
        super().__init__(model, [cond, empty, uncond], check_interrupt)
        self.cfg_scale, self.neg_scale = float(cfg_scale), float(neg_scale)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra_args: Any) -> torch.Tensor:
        cond, empty, uncond = self.sides
        if math.isclose(self.neg_scale, 0.0) and not self.keep_uncond:  # ComfyUI's cfg 1 shortcuts
            uncond = None
            empty = None if math.isclose(self.cfg_scale, 1.0) else empty
        _, (cond_x0, uncond_x0, empty_x0) = self._predict(x, sigma, [cond, uncond, empty], extra_args)
        self.last_uncond_denoised = uncond_x0
        return perp_neg(cond_x0, uncond_x0, empty_x0, self.neg_scale, self.cfg_scale)


class DualCFGDenoiser(_Guided):
    """ComfyUI's DualCFGGuider: cond1 guided away from cond2 by `cfg_conds`, cond2 from the negative by
    `cfg_cond2_negative`. Regular: cfg(cond2, negative, cfg_cond2_negative) + (cond1 - cond2) * cfg_conds;
    nested: negative + cfg_cond2_negative * (cfg(cond1, cond2, cfg_conds) - negative)."""

    def __init__(self, model: Any, cond1: Conditioning | Side, cond2: Conditioning | Side,
                 uncond: Conditioning | Side, cfg_conds: float, cfg_cond2_negative: float,
                 nested: bool = False, check_interrupt: Callable[[], None] | None = None):
        super().__init__(model, [cond1, cond2, uncond], check_interrupt)
        self.cfg_conds, self.cfg_cond2_negative = float(cfg_conds), float(cfg_cond2_negative)
        self.nested = nested

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra_args: Any) -> torch.Tensor:
        cond1, cond2, uncond = self.sides
        if self.nested:
            sides = [cond1, cond2, uncond]
            sigma, (cond1_x0, cond2_x0, uncond_x0) = self._predict(x, sigma, sides, extra_args)
            self.last_uncond_denoised = cond2_x0
            inner = self._cfg(cond1_x0, cond2_x0, self.cfg_conds, x, sigma)
            return uncond_x0 + self.cfg_cond2_negative * (inner - uncond_x0)
        if math.isclose(self.cfg_cond2_negative, 1.0) and not self.keep_uncond:  # ComfyUI's cfg 1 shortcuts
            uncond = None
            cond2 = None if math.isclose(self.cfg_conds, 1.0) else cond2
        sigma, (cond1_x0, cond2_x0, uncond_x0) = self._predict(x, sigma, [cond1, cond2, uncond], extra_args)
        self.last_uncond_denoised = uncond_x0
        return self._cfg(cond2_x0, uncond_x0, self.cfg_cond2_negative, x, sigma) + (cond1_x0 - cond2_x0) * \
            self.cfg_conds


# ---------------------------------------------------------------------------------------------- cfg functions


@dataclass(frozen=True)
class RescaleCfg:
    """RescaleCFG (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed")
    as ComfyUI's: in v-prediction space, the CFG result rescaled to the positive prediction's standard
    deviation (per batch item) and mixed back by `multiplier`. x0 -> v uses the VP-EPS scalings at sigma."""

    multiplier: float

    def __call__(self, inputs: CfgInputs) -> torch.Tensor:
        x = inputs.x
        sigma = inputs.sigma.reshape(-1, *([1] * (x.ndim - 1))).to(x)  # (B, 1, 1, 1)
        scaled_x = x / (sigma * sigma + 1.0)
        root = (sigma ** 2 + 1.0) ** 0.5
        cond_v = (scaled_x - inputs.cond_denoised) * root / sigma
        uncond_v = (scaled_x - inputs.uncond_denoised) * root / sigma
        guided_v = uncond_v + inputs.cond_scale * (cond_v - uncond_v)
        dims = tuple(range(1, x.ndim))
        rescaled = guided_v * (cond_v.std(dim=dims, keepdim=True) / guided_v.std(dim=dims, keepdim=True))
        final_v = self.multiplier * rescaled + (1.0 - self.multiplier) * guided_v
        return scaled_x - final_v * sigma / root


@dataclass(frozen=True, eq=False)
class PerpNegCfg:
    """ComfyUI's PerpNeg model patch: the CFG mix replaced by `perp_neg` against the empty prompt, predicted
    in a further call; `empty` is a CONDITIONING, resolved by the model for each call's latent size."""

    empty: list
    neg_scale: float

    def __call__(self, inputs: CfgInputs) -> torch.Tensor:
        x = inputs.x
        entries = inputs.model.resolve(self.empty, x.shape[-1] * 8, x.shape[-2] * 8)
        (empty_x0,) = calc_cond_batch(inputs.model, [prepare_sides([entries])[0]], x, inputs.sigma)
        return perp_neg(inputs.cond_denoised, inputs.uncond_denoised, empty_x0, self.neg_scale,
                        inputs.cond_scale)

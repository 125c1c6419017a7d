"""Auto-fit: choose where each component's weights live from file headers alone (reference/000, "Automatic
placement").

Components are considered in diffusion, controlnet, te, vae order, so the weights reused at every sampling
step have first claim. Each goes to the first place with room:

1. its compute GPU, leaving a compute reserve (2 GiB for diffusion and te, 1 GiB for the others), staging room
   for the largest tensor of each lower-priority component on that GPU, and room for the full weights and
   reserve of every higher-priority component that was offloaded there (so an offloaded diffusion model
   that needs the whole GPU pushes the TE and VAE off it too);
2. RAM, keeping max(2 GiB, 10 % of available RAM) free;
3. another GPU, the one with the most remaining room that fits;
4. disk, re-read on demand.

A component computing on the CPU uses RAM (its device) or disk. A component split over several GPUs
(`diffusion=cuda0&cuda1`) stays on its devices only if its full size fits on each of them, and is then
counted in full on each (reference/000: before the runners have built their split plans, auto-fit
conservatively counts the full component on each listed GPU; `--auto-fit off` avoids that). Auto-fit never
chooses a split itself. Nothing is loaded: byte counts come from the checkpoint header
(engine.models.detect statistics at the compute dtype).

Weight types. Byte counts price each tensor as it will rest: a tensor the file stores quantised (GGUF) at its
stored bytes, a float one at the compute dtype, or at its `--type` / `--tensor-type-rules` type where those
quantise it (engine/quant, stable-diffusion.cpp's eligibility rules). With the ladder of reference/004 (an
explicit `--auto-fit` and no explicit type: MemorySettings.chooses_weight_types), `component_needs` gives
each component its variants, highest precision first, and the plan takes one before placing it: a text
encoder above q8_0 is lowered to q8_0; the diffusion model takes the first of `LADDER` (q8_0, then q5 and
q4 types, those engine/quant can write) that fits resident, and stays at q8_0 and streams when none does.
The choice (`ComponentNeed.variant`) and why (`type_reason`) are what `sluice plan` prints.

Quantisation hook: `plan_placements` also takes `quantisers` (default: the module list `QUANTISERS`),
callables `(need, room_bytes) -> ComponentNeed | None`. When a component does not fit resident on its
compute GPU, each is asked in turn for a smaller variant; the first variant that fits is placed resident
and its `variant` field names the choice. Returning None declines.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from engine import telemetry
from engine.devices import GIB, ComputeDevice, memory_info
from engine.memory.ledger import DEFAULT_RESERVE, resolve_budget
from engine.models.formats import CheckpointReader
from engine.placement import MemorySettings, max_vram_for
from engine.quant.loading import WeightTypes
from engine.quant.types import GGML_TYPES, QUANTIZED

log = logging.getLogger("sluice.autofit")

PRIORITY = ("diffusion", "controlnet", "te", "vae")  # what runs at every step first
TYPED_COMPONENTS = ("diffusion", "te")  # what --type and the ladder quantise (the VAE's convolutions never)
COMPUTE_RESERVE = {"diffusion": 2 * GIB, "te": 2 * GIB, "vae": 1 * GIB}
RAM_KEEP_FREE_GIB, RAM_KEEP_FREE_FRACTION = 2, 0.10


@dataclass(frozen=True)
class ComponentNeed:
    name: str  # a unique label, e.g. "4/diffusion" (node id / module)
    module: str  # diffusion, te, vae, ...
    compute: str  # compute device name
    weight_bytes: int  # all weights at the compute dtype
    largest_tensor_bytes: int  # the staging room one weight needs
    variant: str = ""  # set by a quantiser: e.g. "q8_0"
    fixed: str | None = None  # an explicit params choice (device, cpu, disk): planned as given
    split: tuple[str, ...] = ()  # the other GPUs of a module split over several (compute is the main one)
    variants: tuple[ComponentNeed, ...] = ()  # the ladder's choices, highest precision first (see above)
    type_reason: str = ""  # why the component rests in its `variant`


@dataclass(frozen=True)
class Choice:
    need: ComponentNeed
    params: str  # "device", "cpu", "disk", or another GPU's name
    reason: str


@dataclass(frozen=True)
class AutoFitPlan:
    choices: tuple[Choice, ...]
    budgets: dict[str, int | None]  # planning room per device ("cpu": a managed budget, else RAM); None: n/a

    def choice(self, name: str) -> Choice:
        for choice in self.choices:
            if choice.need.name == name:
                return choice
        known = ", ".join(c.need.name for c in self.choices) or "none"
        raise KeyError(f"no component {name!r} in the auto-fit plan; planned: {known}")

    def predicted(self) -> dict[str, dict[str, int]]:
        """Per device: resident weights, the largest compute reserve of its modules, and cache room that
        offloaded components will use while they compute there."""
        rows: dict[str, dict[str, int]] = {}
        for choice in self.choices:
            need = choice.need
            compute = rows.setdefault(need.compute, {"weights": 0, "reserve": 0, "streamed": 0})
            if need.compute in self.budgets and need.compute != "cpu":  # a CPU module reserves no GPU room
                compute["reserve"] = max(compute["reserve"], _reserve(need))
            if choice.params == "device":
                compute["weights"] += need.weight_bytes
            else:
                compute["streamed"] = max(compute["streamed"], need.weight_bytes)
                if choice.params != "disk":
                    home = rows.setdefault(choice.params, {"weights": 0, "reserve": 0, "streamed": 0})
                    home["weights"] += need.weight_bytes
        return rows

    def format(self) -> str:
        """The table `sluice plan` prints: one line per component (its weight type: the file's, or the one it
        is quantised to and why), then the predicted memory per device."""
        lines = ["component            compute  params  type    weights GiB  reason"]
        for c in self.choices:
            need = c.need
            reason = f"{need.type_reason}; {c.reason}" if need.type_reason else c.reason
            lines.append(f"{need.name:<20} {need.compute:<8} {c.params:<7} {need.variant or 'file':<7} "
                         f"{need.weight_bytes / GIB:>11.3f}  {reason}")
        lines.append("")
        lines.append("device   planning room GiB  resident weights GiB  compute reserve GiB  "
                     "streamed max GiB")
        for device, row in self.predicted().items():
            room = self.budgets.get(device)
            shown = "n/a" if room is None else f"{room / GIB:.2f}"
            weights, reserve, streamed = (row[k] / GIB for k in ("weights", "reserve", "streamed"))
            lines.append(f"{device:<8} {shown:>17}  {weights:>20.3f}  {reserve:>19.2f}  {streamed:>16.3f}")
        return "\n".join(lines)


Quantiser = Callable[[ComponentNeed, int], "ComponentNeed | None"]
QUANTISERS: list[Quantiser] = []  # asked in order by every plan that is not given its own list
# reference/004's ladder for the diffusion model, highest precision first; the types engine/quant writes
LADDER = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0")
TEXT_ENCODER_TYPE = "Q8_0"  # what auto-fit lowers a text encoder to


def ladder_types() -> tuple[str, ...]:
    from engine.quant.quantize import QUANTIZABLE

    return tuple(t for t in LADDER if t in QUANTIZABLE and not t.startswith("Q6"))


def choose_type(need: ComponentNeed, room: int | None) -> ComponentNeed:
    """The variant of `need` the ladder takes for `room` bytes (None: unknown, the first); `need` itself when
    it has none. A text encoder takes its only variant (q8_0) whatever the room."""
    if not need.variants:
        return need
    first = need.variants[0]
    if need.module == "te":
        return replace(first, type_reason=f"text encoders above {first.variant.lower()} are lowered to it")
    names = ", ".join(v.variant.lower() for v in need.variants)
    if room is None:
        return replace(first, type_reason=f"the top of the ladder {names} (placed as given)")
    fitting = next((v for v in need.variants if v.weight_bytes <= room), None)
    shown = f"{max(room, 0) / GIB:.2f} GiB"
    if fitting is None:
        return replace(first, type_reason=f"no rung of {names} fits resident in {shown}: "
                                          f"{first.variant.lower()}, streamed")
    return replace(fitting, type_reason=f"the highest rung of {names} that fits resident in {shown}")


def _reserve(need: ComponentNeed) -> int:
    return COMPUTE_RESERVE.get(need.module, 1 * GIB)


def _priority(need: ComponentNeed) -> int:
    return PRIORITY.index(need.module) if need.module in PRIORITY else len(PRIORITY)


def plan_placements(
    needs: Sequence[ComponentNeed],
    gpu_room: Mapping[str, int],
    ram_room: int | None,
    quantisers: Sequence[Quantiser] | None = None,
) -> AutoFitPlan:
    """The auto-fit choice for every component; `gpu_room` is each GPU's planning budget, `ram_room` the
    RAM that may hold weights (None: RAM could not be queried, so RAM residency is skipped)."""
    quantisers = QUANTISERS if quantisers is None else quantisers
    ordered = sorted(needs, key=_priority)  # stable: equal priorities keep their order
    remaining = dict(gpu_room)
    ram = ram_room
    claimed = dict.fromkeys(remaining, 0)  # room kept for higher-priority offloaded components
    choices = []
    for index, need in enumerate(ordered):
        if need.fixed is not None:
            given_room = (remaining[need.compute] - claimed[need.compute] - _reserve(need)
                          if need.fixed == "device" and need.compute in remaining else None)
            need = choose_type(need, given_room)
            if need.fixed == "device" and need.compute in remaining:
                remaining[need.compute] -= need.weight_bytes
            elif need.fixed == "cpu" or (need.fixed == "device" and ram is not None):
                ram = None if ram is None else ram - need.weight_bytes
            if need.fixed != "device" and need.compute in remaining:
                claimed[need.compute] += need.weight_bytes + _reserve(need)
            choices.append(Choice(need, need.fixed, "explicit params_backend"))
            continue
        if need.compute not in remaining:  # a CPU (or unbudgeted) compute device: RAM or disk
            need = choose_type(need, ram)
            if ram is not None and need.weight_bytes <= ram:
                ram -= need.weight_bytes
                choices.append(Choice(need, "device", "fits in RAM, where it computes"))
            else:
                choices.append(Choice(need, "disk", "does not fit in RAM"))
            continue
        gpu = need.compute
        staging = sum(n.largest_tensor_bytes for n in ordered[index + 1 :] if n.compute == gpu)
        room = remaining[gpu] - claimed[gpu] - _reserve(need) - staging
        for other in need.split:  # a split module: its full size on each of its GPUs, conservatively
            room = min(room, remaining.get(other, 0) - claimed.get(other, 0) - _reserve(need))
        need = choose_type(need, room)
        candidate = need
        if need.weight_bytes > room:
            for quantiser in quantisers:
                smaller = quantiser(need, room)
                if smaller is not None and smaller.weight_bytes <= room:
                    candidate = smaller
                    break
        if candidate.weight_bytes <= room:
            for device in (gpu, *need.split):
                remaining[device] -= candidate.weight_bytes
            where = " and ".join((gpu, *need.split))
            choices.append(Choice(candidate, "device", f"fits on {where} with its compute reserve"))
            continue
        claimed[gpu] += need.weight_bytes + _reserve(need)
        if ram is not None and need.weight_bytes <= ram:
            ram -= need.weight_bytes
            choices.append(Choice(need, "cpu", f"does not fit on {gpu}; fits in RAM"))
            continue
        others = sorted(
            (g for g in remaining
             if g not in (gpu, "cpu") and remaining[g] - claimed[g] >= need.weight_bytes),
            key=lambda g: remaining[g] - claimed[g],
            reverse=True,
        )
        if others:
            remaining[others[0]] -= need.weight_bytes
            choices.append(Choice(need, others[0], f"fits neither on {gpu} nor in RAM; {others[0]} has room"))
            continue
        choices.append(Choice(need, "disk", "fits on no GPU and not in RAM"))
    budgets: dict[str, int | None] = {"cpu": ram_room, **gpu_room}  # a managed CPU budget is the CPU's room
    return AutoFitPlan(tuple(choices), budgets)


def planning_room(
    devices: Sequence[ComputeDevice], settings: MemorySettings
) -> tuple[dict[str, int], int | None]:
    """(room per GPU, RAM room): a `--max-vram` budget where set, else free memory minus 512 MiB; RAM is
    available memory minus max(2 GiB, 10 %). The CPU is in the first map only with a managed budget."""
    gpus = {}
    for device in devices:
        if device.kind == "cpu":
            cpu_budget = max_vram_for(device, settings.max_vram, devices)
            if cpu_budget is not None:  # a managed CPU budget (--max-vram cpu=GiB) is planned like a GPU's
                gpus[device.name] = resolve_budget(cpu_budget, device) or 0
            continue
        budget = resolve_budget(max_vram_for(device, settings.max_vram, devices), device)
        gpus[device.name] = budget if budget is not None else max(0, memory_info(device)[1] - DEFAULT_RESERVE)
    try:
        available = int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return gpus, None
    keep = max(RAM_KEEP_FREE_GIB * GIB, int(RAM_KEEP_FREE_FRACTION * available))
    return gpus, max(0, available - keep)


def component_needs(
    path: str | Path, components: Mapping[str, str], label: str, dtype: torch.dtype | None = None,
    types: WeightTypes | None = None, ladder: bool = False, devices: Sequence[ComputeDevice] | None = None,
) -> list[ComponentNeed]:
    """Header-only needs of the file's components; `components` maps each wanted one to its compute device
    (a name among `devices`, default the devices that exist).

    `types` (--type, --tensor-type-rules) prices the diffusion model's and text encoder's tensors at the types
    they will be quantised to; `ladder` gives those two components the ladder's variants (module docstring).
    Pricing assumes every eligible tensor rests quantised; the few a model keeps in float (OpenCLIP's fused
    attention weights, a quantised file's norms) are counted at their stored bytes."""
    from engine.devices import resolve_device
    from engine.models.detect import detect
    from engine.models.formats import open_checkpoint
    from engine.models.loader import default_dtype

    if set(components) == {"controlnet"}:  # a ControlNet or T2I-Adapter file
        from engine.models.control_loader import control_needs

        return control_needs(path, components["controlnet"], label, dtype)
    if set(components) == {"clip_vision"}:  # a CLIP vision file (or an unCLIP checkpoint's image embedder)
        from engine.models.clip_vision_loader import clip_vision_needs

        return clip_vision_needs(path, components["clip_vision"], label, dtype)
    needs = []
    with open_checkpoint(path) as reader:
        info = detect(reader)
        for component, device_name in components.items():
            if component not in info.components:
                continue
            prefix = info.components[component]
            keys = [k for k in reader.keys() if k.startswith(prefix)]
            stored = next((reader.info(k).dtype for k in keys
                           if k.endswith(".weight") and reader.info(k).dtype is not None), None)
            device = resolve_device(device_name, devices)
            element = (dtype or default_dtype(component, device.torch_device, stored)).itemsize
            typed = types if component in TYPED_COMPONENTS else None
            base = ComponentNeed(f"{label}/{component}", component, device.name, 0, 0)
            if typed is not None:
                need = _priced(base, reader, keys, element, typed, (typed.default or "rules").upper(),
                               _explicit_reason(typed))
            else:
                need = _priced(base, reader, keys, element, None)
            if ladder and typed is None and component in TYPED_COMPONENTS:
                rungs = (TEXT_ENCODER_TYPE,) if component == "te" else ladder_types()
                variants = [_priced(base, reader, keys, element, WeightTypes(rung), rung) for rung in rungs]
                smaller = tuple(v for v in variants if v.weight_bytes < need.weight_bytes)
                need = replace(need, variants=smaller)
            needs.append(need)
    return needs


def _priced(need: ComponentNeed, reader: CheckpointReader, keys: list[str], element: int,
            types: WeightTypes | None, variant: str = "", reason: str = "") -> ComponentNeed:
    """`need` with the bytes of `keys` resting at `types` (see _tensor_bytes)."""
    sizes = [_tensor_bytes(reader, key, element, types) for key in keys]
    return replace(need, weight_bytes=sum(sizes), largest_tensor_bytes=max(sizes, default=0), variant=variant,
                   type_reason=reason)


def _tensor_bytes(reader: CheckpointReader, key: str, element: int, types: WeightTypes | None) -> int:
    """The bytes tensor `key` rests in: as stored when quantised (or not a float), at `types`' type where it
    quantises it, else at the compute dtype's `element` size."""
    info = reader.info(key)
    if info.dtype is None or not info.dtype.is_floating_point:
        return info.nbytes
    qtype = types.type_for(key, info.shape) if types is not None else None
    if qtype in QUANTIZED:
        t = GGML_TYPES[qtype]
        return math.prod(info.shape) // t.block_size * t.type_size
    return math.prod(info.shape) * element


def _explicit_reason(types: WeightTypes) -> str:
    given = [f"--type {types.default.lower()}"] if types.default else []
    return " and ".join(given + ([f"--tensor-type-rules {types.rules!r}"] if types.rules else []))


def publish_plan(plan: AutoFitPlan, bus: telemetry.EventBus | None = None) -> None:
    """One "placement" event and log line per choice."""
    bus = bus or telemetry.bus
    for choice in plan.choices:
        need = choice.need
        bus.publish("placement", module=need.name, component=need.module, device=need.compute,
                    params=choice.params, weight_bytes=need.weight_bytes, source="auto-fit",
                    reason=choice.reason, variant=need.variant)
        log.info("auto-fit: %s computes on %s, weights %s (%.2f GiB): %s", need.name, need.compute,
                 choice.params, need.weight_bytes / GIB, choice.reason)


def with_variant(need: ComponentNeed, variant: str, weight_bytes: int, largest_tensor_bytes: int,
                 ) -> ComponentNeed:
    """A quantiser's answer: the same component at another precision."""
    return replace(need, variant=variant, weight_bytes=weight_bytes,
                   largest_tensor_bytes=largest_tensor_bytes)

"""Auto-fit: choose where each component's weights live from file headers alone (reference/000, "Automatic
placement").

Components are considered in diffusion, te, vae order, so the weights reused at every sampling step have
first claim. Each goes to the first place with room:

1. its compute GPU, leaving a compute reserve (2 GiB for diffusion and te, 1 GiB for the VAE), staging room
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

Quantisation hook (for edge-dit's ladder, reference/004, filled by a later issue): `plan_placements` takes
`quantisers` (default: the module list `QUANTISERS`, empty until then), callables
`(need, room_bytes) -> ComponentNeed | None`. When a component does not fit
resident on its compute GPU, each is asked in turn for a smaller variant (e.g. the text encoder at q8_0,
the diffusion model down a q8_0 -> q4_K ladder); the first variant that fits is placed resident and its
`variant` field names the choice. Returning None declines.
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
from engine.placement import MemorySettings, max_vram_for

log = logging.getLogger("sluice.autofit")

PRIORITY = ("diffusion", "te", "vae")
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


@dataclass(frozen=True)
class Choice:
    need: ComponentNeed
    params: str  # "device", "cpu", "disk", or another GPU's name
    reason: str


@dataclass(frozen=True)
class AutoFitPlan:
    choices: tuple[Choice, ...]
    budgets: dict[str, int | None]  # planning room per device name ("cpu" = RAM); None = not queried

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
        """The table `sluice plan` prints: one line per component, then the predicted memory per device."""
        lines = ["component            compute  params  weights GiB  reason"]
        for c in self.choices:
            label = c.need.name + (f" [{c.need.variant}]" if c.need.variant else "")
            gib = c.need.weight_bytes / GIB
            lines.append(f"{label:<20} {c.need.compute:<8} {c.params:<7} {gib:>11.3f}  {c.reason}")
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
            if need.fixed == "device" and need.compute in remaining:
                remaining[need.compute] -= need.weight_bytes
            elif need.fixed == "cpu" or (need.fixed == "device" and ram is not None):
                ram = None if ram is None else ram - need.weight_bytes
            if need.fixed != "device" and need.compute in remaining:
                claimed[need.compute] += need.weight_bytes + _reserve(need)
            choices.append(Choice(need, need.fixed, "explicit params_backend"))
            continue
        if need.compute not in remaining:  # a CPU (or unbudgeted) compute device: RAM or disk
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
    budgets: dict[str, int | None] = {**gpu_room, "cpu": ram_room}
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
    devices: Sequence[ComputeDevice] | None = None,
) -> list[ComponentNeed]:
    """Header-only needs of the file's components; `components` maps each wanted one to its compute device
    (a name among `devices`, default the devices that exist)."""
    from engine.devices import resolve_device
    from engine.models.detect import detect
    from engine.models.formats import open_checkpoint
    from engine.models.loader import default_dtype

    needs = []
    with open_checkpoint(path) as reader:
        info = detect(reader)
        for component, device_name in components.items():
            if component not in info.components:
                continue
            prefix = info.components[component]
            keys = [k for k in reader.keys() if k.startswith(prefix)]
            stored = next((reader.dtype(k) for k in keys if k.endswith(".weight")), None)
            device = resolve_device(device_name, devices)
            element = (dtype or default_dtype(component, device.torch_device, stored)).itemsize
            largest = max((math.prod(reader.shape(k)) for k in keys), default=0)
            needs.append(ComponentNeed(f"{label}/{component}", component, device.name,
                                       info.stats[component].parameters * element, largest * element))
    return needs


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

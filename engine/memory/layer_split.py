"""Layer split (reference/000, "Multiple devices per module"): stage ranges per device, and moving the state.

A module computed on several devices (`--backend diffusion=cuda0&cuda1`) gives each device a contiguous range
of its block stages, sized in proportion to the device's capacity (free memory minus a compute headroom of
about 2 GiB, `split_capacity`); the first device is the main one: it also holds the non-block stages
(embeddings, final norms and projections) and the graph inputs and outputs. The state (the residual stream,
the skip list, the context) is copied to the next device at each range boundary (`move_state`).

Which stages are "non-block": a model may define `non_block_stage_names()` (a collection of stage names);
otherwise the first and the last stage are (the UNet's "embed" and "out", CLIP's "embeddings" and "final").

Stages that read a common parameter are never cut apart (`stage_groups`); `plan_layer_split` gives each
device its stages and the modules holding their parameters. Each device's part of the model is registered
with its own weight store through a view (`part_view`): a tree of plain modules named like the model's, whose
nodes share the `_parameters` dicts of the model's modules, so the store's keys are the model's parameter
names and binding a view's parameter binds the model's. `SplitViews` maps a call's stages onto the views and
cuts them into one run per device.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.devices import GIB
from engine.models.staged import Stage

SPLIT_HEADROOM = 2 * GIB  # compute-buffer headroom per device (reference/000)
MIB = 1024**2


class LayerSplitError(MemoryError):
    """The stages of a module cannot be laid out over its devices."""


def split_capacity(available: int, headroom: int = SPLIT_HEADROOM) -> int:
    """Weight bytes a device can take in a layer split: its available bytes minus the headroom, the headroom
    never taking more than half of them (small managed budgets, small devices)."""
    return max(0, max(available - headroom, available // 2))


def non_block_stages(model: Any, stages: Sequence[Stage]) -> set[int]:
    """Indices of the stages that stay on the main device: the model's `non_block_stage_names()` when it
    defines one, else the first and the last stage."""
    if not stages:
        return set()
    names_of = getattr(model, "non_block_stage_names", None)
    if names_of is None:
        return {0, len(stages) - 1}
    names = set(names_of())
    return {i for i, stage in enumerate(stages) if stage.name in names}


def split_stage_ranges(
    stage_bytes: Sequence[int],
    capacities: Sequence[int],
    main_only: Collection[int] = (),
    device_names: Sequence[str] | None = None,
) -> list[int]:
    """A device index per stage: the stages not in `main_only` in contiguous ranges, device 0 first, sized in
    proportion to `capacities` (bytes each device may hold); the `main_only` stages on device 0.

    The proportional layout is used when every device's share fits its capacity; otherwise (a large stage at
    a boundary) devices are filled in order. Raises LayerSplitError when no contiguous layout fits.
    """
    names = [f"device {i}" for i in range(len(capacities))] if device_names is None else list(device_names)
    if not capacities:
        raise ValueError("split_stage_ranges needs at least one device capacity")
    if len(names) != len(capacities):
        raise ValueError(f"{len(names)} device names for {len(capacities)} capacities")
    if any(c < 0 for c in capacities) or any(b < 0 for b in stage_bytes):
        raise ValueError(f"capacities {list(capacities)} and stage bytes must not be negative")
    main = set(main_only)
    outside = sorted(i for i in main if not 0 <= i < len(stage_bytes))
    if outside:
        raise ValueError(f"main-only stage indices {outside} are outside 0..{len(stage_bytes) - 1}")
    main_bytes = sum(stage_bytes[i] for i in main)
    total = sum(stage_bytes)
    if main_bytes > capacities[0] or total > sum(capacities):
        raise LayerSplitError(
            f"the module's {_mib(total)} of weights ({_mib(main_bytes)} of them non-block, which stay on "
            f"{names[0]}) do not fit its devices: {_describe(names, capacities)}"
        )
    blocks = [i for i in range(len(stage_bytes)) if i not in main]
    block_bytes = [stage_bytes[i] for i in blocks]
    layout = _proportional(block_bytes, capacities, main_bytes)
    if not _fits(layout, block_bytes, capacities, main_bytes):
        layout = _filled_in_order(block_bytes, capacities, main_bytes)
    if layout is None:
        largest = max(block_bytes, default=0)
        raise LayerSplitError(
            f"no contiguous layout of the module's stages ({_mib(total)} in all, the largest block stage "
            f"{_mib(largest)}) fits its devices: {_describe(names, capacities)}"
        )
    devices = [0] * len(stage_bytes)
    for index, device in zip(blocks, layout, strict=True):
        devices[index] = device
    return devices


def _proportional(block_bytes: list[int], capacities: Sequence[int], main_bytes: int) -> list[int]:
    """Each block stage on the device whose proportional share holds the stage's middle byte."""
    total = sum(block_bytes) + main_bytes
    scale = sum(capacities)
    bounds, reached = [], -main_bytes  # device 0's share also holds the non-block bytes
    for capacity in capacities:
        reached += total * capacity / scale if scale else 0
        bounds.append(reached)
    layout, position, device = [], 0, 0
    for nbytes in block_bytes:
        middle = position + nbytes / 2
        while device < len(capacities) - 1 and middle > bounds[device]:
            device += 1
        layout.append(device)
        position += nbytes
    return layout


def _filled_in_order(block_bytes: list[int], capacities: Sequence[int], main_bytes: int) -> list[int] | None:
    """Fill device 0, then 1, ... (the contiguous layout that fits whenever any does), or None."""
    layout, device, used = [], 0, main_bytes
    for nbytes in block_bytes:
        while used + nbytes > capacities[device]:
            device, used = device + 1, 0
            if device == len(capacities):
                return None
        layout.append(device)
        used += nbytes
    return layout


def _fits(layout: list[int], block_bytes: list[int], capacities: Sequence[int], main_bytes: int) -> bool:
    used = [main_bytes] + [0] * (len(capacities) - 1)
    for device, nbytes in zip(layout, block_bytes, strict=True):
        used[device] += nbytes
    return all(u <= c for u, c in zip(used, capacities, strict=True))


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def _describe(names: Sequence[str], capacities: Sequence[int]) -> str:
    return ", ".join(f"{name} can take {_mib(c)}" for name, c in zip(names, capacities, strict=True))


def move_state(state: Any, device: torch.device | str) -> Any:
    """`state` with every tensor (also inside lists, tuples and dicts) on `device`; CUDA-to-CUDA copies are
    asynchronous (ordered on both devices' current streams by torch)."""
    device = torch.device(device)
    if isinstance(state, torch.Tensor):
        if state.device == device:
            return state
        return state.to(device, non_blocking=state.device.type == "cuda" and device.type == "cuda")
    if isinstance(state, Mapping):
        return {key: move_state(value, device) for key, value in state.items()}
    if isinstance(state, list):
        return [move_state(value, device) for value in state]
    if isinstance(state, tuple):
        return tuple(move_state(value, device) for value in state)
    return state


def parameter_owners(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules under `modules` that hold parameters themselves, each once, in visiting order."""
    owners: dict[int, nn.Module] = {}
    for top in modules:
        for sub in top.modules():
            if any(p is not None for p in sub._parameters.values()):
                owners.setdefault(id(sub), sub)
    return list(owners.values())


def parameter_holders(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Per parameter id, every module of `model` holding that parameter itself (tied weights, root views)."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                holders.setdefault(id(parameter), []).append(module)
    return holders


def stage_groups(stages: Sequence[Stage]) -> list[list[int]]:
    """Consecutive stage indices that must stay on one device: no cut separates two stages reading the
    same parameter."""
    last_reader: dict[int, int] = {}
    for index, stage in enumerate(stages):
        for parameter in stage.parameters():
            last_reader[id(parameter)] = index
    groups: list[list[int]] = []
    reach = -1  # the last stage that must join the current group
    for index, stage in enumerate(stages):
        if index > reach:
            groups.append([])
        groups[-1].append(index)
        reach = max([reach, *(last_reader[id(p)] for p in stage.parameters())])
    return groups


def part_view(model: nn.Module, owners: Sequence[nn.Module]) -> tuple[nn.Module, dict[int, nn.Module]]:
    """A module tree holding exactly `owners`' parameters under the model's names: every node on the path of
    an owner is a plain module, and an owner's node shares the owner's `_parameters` dict. Returns the view
    and, per id of an owner, its node."""
    path_of = {id(module): name for name, module in model.named_modules()}
    missing = [type(owner).__name__ for owner in owners if id(owner) not in path_of]
    if missing:
        raise ValueError(f"modules {', '.join(missing)} of a stage are not submodules of the model")
    view = nn.Module()
    node_of: dict[int, nn.Module] = {}
    for owner in owners:
        node = view
        path = path_of[id(owner)]
        for step in path.split(".") if path else ():
            if step not in node._modules:
                node.add_module(step, nn.Module())
            node = node._modules[step]
        object.__setattr__(node, "_parameters", owner._parameters)  # the same dict: binding one binds both
        node_of[id(owner)] = node
    return view, node_of


class NoLayerSplit(ValueError):
    """A model whose stages cannot be laid out over several devices (it then runs on the first one)."""


@dataclass(frozen=True)
class LayerSplitPlan:
    device_of_stage: list[int]  # device index per stage
    owners: dict[int, list[nn.Module]]  # device index -> the modules holding the parameters it gets

    def ranges(self, stages: Sequence[Stage], device: int) -> list[tuple[str, str]]:
        """(first, last) stage names of each contiguous range of stages on `device`."""
        ranges: list[tuple[str, str]] = []
        for index, stage in enumerate(stages):
            if self.device_of_stage[index] != device:
                continue
            if index > 0 and self.device_of_stage[index - 1] == device:
                ranges[-1] = (ranges[-1][0], stage.name)
            else:
                ranges.append((stage.name, stage.name))
        return ranges


def plan_layer_split(
    model: nn.Module, stages: Sequence[Stage], capacities: Sequence[int], device_names: Sequence[str]
) -> LayerSplitPlan:
    """Stage ranges per device (`split_stage_ranges` over the stage groups, non-block stages on the main
    device) and the parameter owners each device gets, tied holders included. Raises NoLayerSplit when there
    is nothing to split, LayerSplitError when it does not fit."""
    groups = stage_groups(stages)
    if len(groups) < 2:
        raise NoLayerSplit(f"its {len(stages)} stage(s) read parameters in common; nothing to lay out")
    non_block = non_block_stages(model, stages)
    group_bytes = []
    for group in groups:
        parameters = {id(p): p for index in group for p in stages[index].parameters()}
        group_bytes.append(sum(p.numel() * p.element_size() for p in parameters.values()))
    main_only = [i for i, group in enumerate(groups) if non_block.intersection(group)]
    layout = split_stage_ranges(group_bytes, capacities, main_only, device_names)
    device_of_stage = [layout[i] for i, group in enumerate(groups) for _ in group]
    holders = parameter_holders(model)
    owners: dict[int, list[nn.Module]] = {}
    device_of_owner: dict[int, int] = {}
    for stage, device in zip(stages, device_of_stage, strict=True):
        direct = parameter_owners(stage.modules)
        tied = [h for o in direct for p in o._parameters.values() if p is not None for h in holders[id(p)]]
        for owner in dict.fromkeys([*direct, *tied]):
            first = device_of_owner.setdefault(id(owner), device)
            if first != device:
                raise NoLayerSplit(f"its {type(owner).__name__} holds parameters of stages on "
                                   f"{device_names[first]} and {device_names[device]}")
            if owner not in owners.setdefault(device, []):
                owners[device].append(owner)
    return LayerSplitPlan(device_of_stage, owners)


_View = tuple[tuple[nn.Module, ...], int | None]  # a stage's view nodes and its part (None: no parameters)


class SplitViews:
    """The view nodes of a layer-split module's parameter owners, and the stage ranges of a call over them."""

    def __init__(self) -> None:
        self.node_of: dict[int, tuple[nn.Module, int]] = {}  # id(owner) -> (its view node, part index)
        # id()s of a stage's modules -> (the modules, so the ids stay theirs; the nodes; part or None)
        self._stages: dict[tuple[int, ...], tuple[tuple[nn.Module, ...], _View]] = {}

    def add(self, nodes: Mapping[int, nn.Module], part: int) -> None:
        self.node_of.update({owner: (node, part) for owner, node in nodes.items()})

    def ranges(self, stages: Sequence[Stage]) -> list[tuple[int, list[Stage]]]:
        """Consecutive stages of one part each, as (part index, the stages over the part's view): a stage
        computes where its parameters are, one without parameters where the previous one did."""
        ranges: list[tuple[int, list[Stage]]] = []
        current = 0
        for stage in stages:
            nodes, part = self._view(stage)
            current = current if part is None else part
            if not ranges or ranges[-1][0] != current:
                ranges.append((current, []))
            ranges[-1][1].append(Stage(stage.name, nodes, stage.run))
        return ranges

    def _view(self, stage: Stage) -> tuple[tuple[nn.Module, ...], int | None]:
        ids = tuple(map(id, stage.modules))
        cached = self._stages.get(ids)
        if cached is not None and cached[0] == stage.modules:
            return cached[1]
        nodes, parts = [], set()
        for owner in parameter_owners(stage.modules):
            if id(owner) not in self.node_of:
                raise ValueError(f"stage {stage.name!r} reads parameters of a {type(owner).__name__} that "
                                 f"the split module does not hold")
            node, part = self.node_of[id(owner)]
            nodes.append(node)
            parts.add(part)
        if len(parts) > 1:
            raise ValueError(f"stage {stage.name!r} reads parameters held by parts {sorted(parts)} of a "
                             f"split module; a stage computes on one device")
        view = (tuple(nodes), next(iter(parts), None))
        self._stages[ids] = (stage.modules, view)
        return view

"""The stage contract that makes segmented execution possible (DESIGN.md, "The model contract").

A model's forward pass is an ordered list of stages. Each stage owns the parameters of its modules
and transforms a small state object (a dict of tensors: latent, skip list, context, ...). Running
every stage in order is the ordinary forward pass; the memory runtime runs the same stages in
segments, and a layer split gives stage ranges to devices. Stage boundaries are the only places a
segment may end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

State = dict[str, Any]


@dataclass(frozen=True)
class Stage:
    name: str  # e.g. "input_blocks.3", "middle_block", "encoder.layers.7"
    modules: tuple[nn.Module, ...]  # the modules whose parameters this stage reads
    run: Callable[[State], State]

    def parameters(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for module in self.modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


StageHook = Callable[[int, Stage], None]


def run_stages(stages: Sequence[Stage], state: State, before: StageHook | None = None,
               after: StageHook | None = None) -> State:
    """Run `stages` in order on `state`; the hooks let a runner stage weights in and out around each stage."""
    for index, stage in enumerate(stages):
        if before is not None:
            before(index, stage)
        state = stage.run(state)
        if after is not None:
            after(index, stage)
    return state


class StagedModel(nn.Module):
    """Base of the models: subclasses build stages for one call and map inputs to a state and back.

    `stages()` lists the stages in execution order (the same list every call, so plans can be cached);
    `forward` must equal `run_stages(self.stages(), initial_state)` followed by reading the output.
    """

    def stages(self) -> list[Stage]:
        """The stage list of `_build_stages`, built once per model object (a structural copy, e.g. a
        LoRA-patched clone, builds its own: the cache is keyed by the object's id)."""
        cached = self.__dict__.get("_stage_cache")
        if cached is None or cached[0] != id(self):
            cached = (id(self), self._build_stages())
            self.__dict__["_stage_cache"] = cached
        return list(cached[1])

    def _build_stages(self) -> list[Stage]:
        raise NotImplementedError

    def forget_stages(self) -> None:
        """Drop a cached stage list: its stages hold the modules they read, which a row split replaces."""
        self.__dict__.pop("_stage_cache", None)

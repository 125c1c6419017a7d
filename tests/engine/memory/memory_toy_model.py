"""A toy StagedModel for the memory-runtime tests: Linear+GELU stages over a {"x": tensor} state."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.models.staged import Stage, StagedModel, State, run_stages


class ToyStaged(StagedModel):
    def __init__(self, width: int = 64, depth: int = 8, device: str = "meta") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width, device=device) for _ in range(depth))

    def stages(self) -> list[Stage]:
        return [Stage(f"blocks.{i}", (block,), _linear_gelu(block)) for i, block in enumerate(self.blocks)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_stages(self.stages(), {"x": x})["x"]


def _linear_gelu(block: nn.Linear) -> Callable[[State], State]:
    def run(state: State) -> State:
        return {"x": torch.nn.functional.gelu(block(state["x"]))}

    return run


def reference_weights(
    width: int = 64, depth: int = 8, seed: int = 0
) -> tuple[ToyStaged, dict[str, torch.Tensor]]:
    """A resident model with random weights, and a copy of its state dict (the 'checkpoint')."""
    torch.manual_seed(seed)
    model = ToyStaged(width, depth, device="cpu")
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}

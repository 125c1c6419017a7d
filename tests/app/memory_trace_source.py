"""A recorded memory trace from the real engine: a weight store and segment runner on the CPU with a
managed budget, running a toy text encoder, a segmented toy diffusion model for a few steps and a toy VAE."""

from __future__ import annotations

import time

import torch
from torch import nn

from app.memory_model import MemoryModel
from engine.memory.ledger import DeviceLedger
from engine.memory.segments import SegmentRunner
from engine.memory.weight_store import WeightStore
from engine.models.staged import Stage, State
from engine.telemetry import EventBus

WIDTH = 256
BLOCK_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's weight and bias, f32
DEPTHS = {"te": 3, "diffusion": 10, "vae": 4}
BUDGET = 5 * BLOCK_BYTES  # the diffusion model (10 blocks) must run in segments
STEPS = 3


class ToyBlocks(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, device="meta") for _ in range(depth))

    def stages(self) -> list[Stage]:
        def linear_gelu(block: nn.Linear):
            def run(state: State) -> State:
                return {"x": torch.nn.functional.gelu(block(state["x"]))}

            return run

        return [Stage(f"blocks.{i}", (b,), linear_gelu(b)) for i, b in enumerate(self.blocks)]


def record_runtime_trace(model: MemoryModel, pause: float = 0.01) -> EventBus:
    """Run the toy pipeline on a private bus that `model` listens to; returns the bus."""
    bus = EventBus()
    model.subscribe(bus)
    ledger = DeviceLedger("cpu", BUDGET, bus=bus)
    store = WeightStore(ledger, bus=bus)
    runner = SegmentRunner(store, ledger, "cpu", bus=bus)
    generator = torch.Generator().manual_seed(0)
    models = {}
    for module, depth in DEPTHS.items():
        models[module] = ToyBlocks(depth)
        weights = {f"blocks.{i}.{p}": torch.randn(shape, generator=generator) * 0.05
                   for i in range(depth) for p, shape in (("weight", (WIDTH, WIDTH)), ("bias", (WIDTH,)))}
        store.register_model(module, models[module], "cpu", "cpu", weights.__getitem__)
    model.observe_ledger(ledger.snapshot())
    x = torch.randn(4, WIDTH, generator=generator)
    for module, steps in (("te", 1), ("diffusion", STEPS), ("vae", 1)):
        for _ in range(steps):
            x = runner.run(models[module].stages(), {"x": x}, module)["x"]
            time.sleep(pause)
        store.release_module(module)
        model.observe_ledger(ledger.snapshot())
        time.sleep(pause)
    return bus

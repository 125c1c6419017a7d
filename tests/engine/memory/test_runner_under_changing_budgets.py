"""A segment runner under budgets that change between calls (a GUI lowers --max-vram, another module takes
room), with a tied weight shared by two stages and weight-free stages in between: every call is exact and
fits, and the ledger, pins and replica counters stay consistent. Random stage times stand in for measured
ones, so that plans mix resident and streamed segments in many ways."""

import random

import pytest
import torch
from torch import nn

from engine.memory import stage_timing
from engine.memory.ledger import DeviceLedger
from engine.memory.segments import SegmentRunner
from engine.memory.weight_store import WeightStore
from engine.models.staged import Stage, run_stages
from engine.telemetry import EventBus

WIDTH, DEPTH = 32, 10
BLOCK = (WIDTH * WIDTH + WIDTH) * 4


class TiedToy(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, device=device) for _ in range(DEPTH))
        self.blocks[DEPTH - 2].weight = self.blocks[1].weight  # one weight read by two stages
        self.gaps = nn.ModuleList(nn.Identity() for _ in range(DEPTH))

    def stages(self) -> list[Stage]:
        out = []
        for i, block in enumerate(self.blocks):
            out.append(Stage(f"b{i}", (block,), lambda state, b=block: {"x": torch.tanh(b(state["x"]))}))
            if i % 3 == 0:  # weight-free
                out.append(Stage(f"gap{i}", (self.gaps[i],), lambda state: {"x": state["x"] * 1.0}))
        return out


@pytest.mark.parametrize("trial", range(16))
def test_calls_stay_exact_and_within_budget_as_budgets_change(trial, monkeypatch):
    measured = stage_timing.StageTiming.finish

    def random_times(self):
        workspace, seconds = measured(self)
        draw = random.Random(trial * 1000 + len(seconds))
        return workspace, [draw.random() for _ in seconds]

    monkeypatch.setattr(stage_timing.StageTiming, "finish", random_times)
    torch.manual_seed(0)
    reference = TiedToy("cpu")
    checkpoint = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    rng = random.Random(trial)
    model = TiedToy("meta")
    bus = EventBus()
    ledger = DeviceLedger("cpu", 10**9, bus=bus)
    store = WeightStore(ledger, bus=bus)
    store.register_model("m", model, rng.choice(["cpu", "disk"]), "cpu", checkpoint.__getitem__)
    runner = SegmentRunner(store, ledger, "cpu", prefetch=rng.random() < 0.5, bus=bus)
    for _ in range(12):
        ledger.budget_bytes = rng.choice([2 * BLOCK + 4096, 3 * BLOCK + 4096, int(2.5 * BLOCK), 5 * BLOCK,
                                          20 * BLOCK])
        if rng.random() < 0.2:
            store.release_module("m")  # another module took the room
        x = torch.randn(rng.choice([4, 2]), WIDTH)
        got = runner.run(model.stages(), {"x": x}, "m")["x"]
        assert torch.equal(got, run_stages(reference.stages(), {"x": x})["x"])
        assert not [w for w in store._weights.values() if w.pins]
        replicas = sum(w.nbytes for w in store._weights.values() if w.replica is not None)
        assert store.replica_bytes("m") == replicas
        assert ledger.tracked() == sum(a.nbytes for a in ledger._tracked.values())

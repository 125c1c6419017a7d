"""Quantised weights in the memory runtime: the ledger, the store's snapshot (the live panel) and the planner
count the file's quantised bytes, streaming copies them quantised, and a streamed run under a budget is
bit-identical to the resident one (issue 17)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.memory.ledger import DeviceLedger
from engine.memory.runtime import MemoryRuntime
from engine.models.loader import clear_cache, load_diffusion_model
from engine.placement import MemorySettings
from engine.quant.modules import QUANT_LAYERS
from engine.telemetry import EventBus, EventRecorder
from tests.engine.models.sd_checkpoints import checkpoint_shapes, random_state_dict
from tests.engine.quant.gguf_models import quant_flux_state, quantised_bytes, write_quantised_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")
UNET_PREFIX = "model.diffusion_model."


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SD1 UNets and FLUX transformers, their non-quantised tensors in F32 (the CPU's compute dtype)."""
    folder = tmp_path_factory.mktemp("quantised")
    unet = {k.removeprefix(UNET_PREFIX): v for k, v in
            random_state_dict(checkpoint_shapes("sd1", "tiny", ["diffusion"]), seed=4).items()}
    paths = {}
    for qtype in ("Q4_0", "Q8_0", "Q4_K"):
        paths[f"sd1-{qtype}"] = folder / f"sd1-{qtype}.gguf"
        write_quantised_gguf(paths[f"sd1-{qtype}"], unet, qtype, "sd1", fallback="F32")
    paths["flux-Q4_K"] = folder / "flux-Q4_K.gguf"
    write_quantised_gguf(paths["flux-Q4_K"], quant_flux_state(), "Q4_K", "flux", fallback="F32")
    return paths


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def runtime_with_budget(budget: int) -> tuple[MemoryRuntime, DeviceLedger, EventRecorder]:
    bus = EventBus()
    ledger = DeviceLedger("cpu", budget, bus=bus)
    return MemoryRuntime(MemorySettings(), bus=bus, ledgers={"cpu": ledger}), ledger, EventRecorder(bus)


def sd1_step(model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    x, context = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 77, 64, generator=generator)
    return model.apply(x, torch.tensor([999.0, 10.0]), context)


def flux_step(model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(1, 16, 8, 8, generator=generator)
    context, pooled = torch.randn(1, 5, 32, generator=generator), torch.randn(1, 32, generator=generator)
    return model.apply(x, torch.tensor([0.7]), context, pooled, torch.tensor([3.5]))


@pytest.mark.parametrize("name", ["sd1-Q4_0", "sd1-Q8_0", "sd1-Q4_K", "flux-Q4_K"])
def test_the_ledger_and_the_live_panel_count_the_files_quantised_bytes(files, name):
    runtime, ledger, _ = runtime_with_budget(10**9)
    model = load_diffusion_model(files[name], runtime=runtime)
    assert any(isinstance(m, QUANT_LAYERS) for m in model.unet.modules())
    assert ledger.tracked("diffusion") == quantised_bytes(files[name])
    panel = runtime.snapshot()["modules"]["diffusion"]["weights"]
    assert panel["device_home"] == quantised_bytes(files[name])


@pytest.mark.parametrize(("name", "step", "home"), [("sd1-Q8_0", sd1_step, "cpu"),
                                                    ("sd1-Q4_K", sd1_step, "disk"),
                                                    ("flux-Q4_K", flux_step, "cpu")])
def test_a_streamed_run_under_a_budget_equals_the_resident_run(files, name, step, home):
    resident_runtime, _, _ = runtime_with_budget(10**9)
    expected = step(load_diffusion_model(files[name], runtime=resident_runtime))
    budget = quantised_bytes(files[name]) * 2 // 3  # the weights cannot all rest on the device
    runtime, ledger, events = runtime_with_budget(budget)
    model = load_diffusion_model(files[name], params=home, runtime=runtime)
    got = [step(model) for _ in range(2)]
    for result in got:
        assert torch.equal(result, expected)
    plans = [p for p in events.of_kind("plan") if p["module"] == "diffusion"]
    assert plans and not plans[0]["whole"] and len(plans[0]["segments"]) > 1
    assert ledger.peak_tracked <= budget
    copied = sum(e["bytes"] for e in events.of_kind("transfer") if e["direction"] == "h2d")
    assert 0 < copied <= 2 * quantised_bytes(files[name])  # two steps of quantised bytes (float: 3.8x to 7x)

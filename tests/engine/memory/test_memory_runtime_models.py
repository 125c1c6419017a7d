"""The memory runtime runs real (tiny) SD models: bit-identical to the plain path for every weight home,
under budgets that force segments, and never above the budget."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

from engine.memory.ledger import DeviceLedger  # noqa: E402
from engine.memory.runtime import MemoryRuntime  # noqa: E402
from engine.models.loader import clear_cache, load_checkpoint  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.telemetry import EventBus, EventRecorder  # noqa: E402

MIB = 1024**2



pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    paths = {}
    for family in ("sd1", "sdxl"):
        paths[family] = folder / f"{family}.safetensors"
        write_checkpoint(paths[family], family, size="tiny")
    return paths


def runtime_with_budget(budget, segmented=True):
    bus = EventBus()
    events = EventRecorder(bus)
    ledger = DeviceLedger("cpu", budget, bus=bus)
    settings = MemorySettings(segmented=segmented)
    return MemoryRuntime(settings, bus=bus, ledgers={"cpu": ledger}), ledger, events


def outputs(model, clip, vae, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=generator)
    conditioning = clip.encode("a (red:1.2) teapot on a table")
    context = conditioning[0][0].expand(2, -1, -1)
    pooled = conditioning[0][1]["pooled_output"]
    y = model._adm({"pooled_output": pooled.expand(2, -1)}, 64, 64) if pooled is not None else None
    eps = [model.apply(x, torch.tensor([999.0, 10.0]), context, y) for _ in range(2)]
    image = vae.decode(x[:1])
    latent = vae.encode(image)
    return [conditioning[0][0], *eps, image, latent]


@pytest.fixture(scope="module")
def plain_outputs(checkpoints):
    clear_cache()
    return {family: outputs(*load_checkpoint(path)) for family, path in checkpoints.items()}


# sdxl's OpenCLIP-G has root-level parameters (positional_embedding, text_projection) staged through a view
@pytest.mark.parametrize(
    ("family", "home"), [("sd1", "device"), ("sd1", "cpu"), ("sd1", "disk"), ("sdxl", "disk")]
)
def test_every_weight_home_is_bit_identical_to_the_plain_path(checkpoints, plain_outputs, family, home):
    expected = plain_outputs[family]
    runtime, ledger, events = runtime_with_budget(10**9)
    got = outputs(*load_checkpoint(checkpoints[family], params=home, runtime=runtime))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    placements = events.of_kind("placement")
    assert {p["params"] for p in placements} == {home}
    assert {p["component"] for p in placements} == {"diffusion", "te", "vae"}
    assert all(plan["whole"] for plan in events.of_kind("plan"))


@pytest.mark.parametrize("home", ["cpu", "disk"])
def test_a_budget_forcing_segments_stays_bit_identical_and_within_budget(checkpoints, plain_outputs, home):
    expected = plain_outputs["sd1"]
    budget = 14 * MIB  # below the UNet's 16 MiB of weights; the text encoder's 12.6 MiB embedding fits
    runtime, ledger, events = runtime_with_budget(budget)
    model, clip, vae = load_checkpoint(checkpoints["sd1"], params=home, runtime=runtime)
    got = outputs(model, clip, vae)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    unet_plans = [p for p in events.of_kind("plan") if p["module"] == "diffusion"]
    assert unet_plans and not unet_plans[0]["whole"] and len(unet_plans[0]["segments"]) > 1
    assert ledger.peak_tracked <= budget
    assert max(e["tracked"] for e in events.of_kind("ledger")) <= budget
    # the text encoder's copies were released to make room for the diffusion model
    assert any(e["module"] == "te" and e["reason"] == "module_done" for e in events.of_kind("eviction"))


def test_a_segmented_vae_decode_is_bit_identical(checkpoints):
    _, _, plain_vae = load_checkpoint(checkpoints["sd1"], components=("vae",))
    budget = MIB  # below the decoder's 1.4 MiB of weights
    runtime, ledger, events = runtime_with_budget(budget)
    _, _, vae = load_checkpoint(checkpoints["sd1"], components=("vae",), params="disk", runtime=runtime)
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(vae.decode(latent), plain_vae.decode(latent))
    assert not events.of_kind("plan")[-1]["whole"] and ledger.peak_tracked <= budget


def test_device_home_weights_stay_resident_and_snapshot_reports_them(checkpoints):
    runtime, ledger, events = runtime_with_budget(10**9)
    model, _, _ = load_checkpoint(
        checkpoints["sd1"], components=("diffusion",), params="cpu", runtime=runtime
    )
    x, context = torch.randn(1, 4, 8, 8), torch.randn(1, 77, 64)
    for _ in range(3):
        model.apply(x, torch.tensor([500.0]), context)
    copies = [e for e in events.of_kind("transfer") if e["module"] == "diffusion"]
    assert len(copies) == len({e["key"] for e in copies})  # every weight copied once across the steps
    snapshot = runtime.snapshot()
    row = snapshot["devices"]["cpu"]["modules"]["diffusion"]
    assert row["weights"] == sum(e["bytes"] for e in copies)
    assert snapshot["modules"]["diffusion"]["plan"]["segments"][0]["state"] == "resident"


def test_a_dropped_bundle_leaves_the_ledger(checkpoints):
    runtime, ledger, _ = runtime_with_budget(10**9)
    model, _, _ = load_checkpoint(checkpoints["sd1"], components=("diffusion",), runtime=runtime)
    assert ledger.tracked("diffusion") > 0
    del model
    import gc

    gc.collect()
    assert ledger.tracked() == 0 and runtime.modules() == []


def test_flash_attention_auto_on_the_cpu_is_decided_without_timing(monkeypatch):
    from engine.memory import attention_probe

    def no_timing(*args):
        raise AssertionError("the CPU decision must not time anything")

    monkeypatch.setattr(attention_probe, "benchmark_flash", no_timing)
    attention_probe.clear_decisions()
    assert attention_probe.flash_attention_enabled("cpu", "auto") is True
    assert attention_probe.flash_attention_enabled("cpu", "off") is False


def test_flash_attention_off_runs_ordinary_attention_within_float_tolerance(checkpoints, plain_outputs):
    bus = EventBus()
    settings = MemorySettings(flash_attn="auto,diffusion=off")
    runtime = MemoryRuntime(settings, bus=bus, ledgers={"cpu": DeviceLedger("cpu", 10**9, bus=bus)})
    model, _, _ = load_checkpoint(checkpoints["sd1"], components=("diffusion",), runtime=runtime)
    plain, _, _ = load_checkpoint(checkpoints["sd1"], components=("diffusion",))
    x, context = torch.randn(1, 4, 8, 8), torch.randn(1, 77, 64)
    expected = plain.apply(x, torch.tensor([500.0]), context)
    got = model.apply(x, torch.tensor([500.0]), context)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)  # math vs flash SDPA kernels


def test_a_clone_keeps_the_weights_registered_after_the_original_is_dropped(checkpoints):
    import gc

    runtime, ledger, _ = runtime_with_budget(10**9)
    model, clip, _ = load_checkpoint(checkpoints["sdxl"], components=("diffusion", "te"), runtime=runtime)
    clone, clip_clone = model.clone(), clip.clone_with_clip_skip(-1)
    del model, clip
    gc.collect()
    assert set(runtime.modules()) == {"diffusion", "te", "te#2"}
    clip_clone.encode("a fox")
    del clone, clip_clone
    gc.collect()
    assert runtime.modules() == [] and ledger.tracked() == 0

"""engine/memory/profile_cache.py: measured probes and stage profiles kept on disk. Entries round-trip, a
corrupt file is ignored with a warning, a changed key (torch version, input shapes) misses, and a run that
plans from a cached profile is bit-identical to the run that measured it, with the same plan and no call
timed (on a CPU with a managed budget, where the runner times the first call of a shape)."""

import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from memory_toy_model import ToyStaged, reference_weights

from engine.memory import attention_probe, conv_probe, profile_cache, segments, stream_model
from engine.memory.ledger import DeviceLedger
from engine.memory.profile_cache import PROBE, STAGE_PROFILE, ProfileCache
from engine.memory.runtime import MemoryRuntime
from engine.memory.segments import SegmentRunner
from engine.memory.weight_store import WeightStore
from engine.placement import MemorySettings
from engine.telemetry import EventBus, EventRecorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

from engine.models.loader import load_checkpoint  # noqa: E402

WIDTH, DEPTH = 64, 8
BLOCK_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's weight and bias, f32
TIGHT = 2 * BLOCK_BYTES + 2 * (4 * WIDTH * 4) + 100  # room for two blocks at a time: several segments
MIB = 1024**2


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> ProfileCache:
    """The process's profile cache in a fresh folder (device identities read again)."""
    cache = ProfileCache(tmp_path / "cache")
    monkeypatch.setattr(profile_cache, "_identities", {})
    previous = profile_cache.set_default_cache(cache)
    yield cache
    profile_cache.set_default_cache(previous)


@pytest.fixture()
def timed_calls(monkeypatch) -> list[int]:
    """Counts the runner's timed calls (one StageTiming each)."""
    calls = []
    original = segments.StageTiming

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(segments, "StageTiming", counting)
    return calls


def toy_runner(weights, cache, budget=TIGHT):
    bus = EventBus()
    events = EventRecorder(bus)
    ledger = DeviceLedger("cpu", budget, bus=bus)
    store = WeightStore(ledger, bus=bus)
    model = ToyStaged(WIDTH, DEPTH)
    store.register_model("diffusion", model, "cpu", "cpu", weights.__getitem__)
    return model, SegmentRunner(store, ledger, "cpu", bus=bus, cache=cache), events


def plan_layout(plan):
    return [(s.start, s.stop, s.streamed, s.ring_offset, s.ring_bytes, s.waits) for s in plan.segments]


def test_an_entry_round_trips_and_leaves_no_temporary_file(tmp_path):
    cache = ProfileCache(tmp_path)
    key = {"device": {"name": "a", "memory": 1}, "inputs": "((1, 2),)"}
    assert cache.get("probe", key) is None
    cache.put("probe", key, {"seconds": [0.1, 1 / 3], "workspace": 12})
    assert cache.get("probe", key) == {"seconds": [0.1, 1 / 3], "workspace": 12}  # floats exactly
    assert [p.name for p in (tmp_path / "probe").iterdir()] == [cache.path("probe", key).name]
    assert cache.get("probe", {**key, "inputs": "((1, 3),)"}) is None


def test_an_off_cache_stores_nothing(tmp_path):
    cache = ProfileCache(None)
    cache.put("probe", {"a": 1}, True)
    assert not cache.enabled and cache.get("probe", {"a": 1}) is None


@pytest.mark.parametrize("text", ["{not json", '{"key": {"a": 2}, "value": true}', "[1, 2]", "\udcff"])
def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning(tmp_path, caplog, text):
    cache = ProfileCache(tmp_path)
    path = cache.path("probe", {"a": 1})
    path.parent.mkdir(parents=True)
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger="sluice.cache"):
        assert cache.get("probe", {"a": 1}) is None
    assert str(path) in caplog.text and "measuring instead" in caplog.text


def test_an_unwritable_folder_is_a_warning_not_a_failure(tmp_path, caplog):
    (tmp_path / "file").write_text("a file where the folder should be")
    cache = ProfileCache(tmp_path / "file")
    with caplog.at_level(logging.WARNING, logger="sluice.cache"):
        cache.put("probe", {"a": 1}, True)
    assert "cannot write to the profile cache" in caplog.text


def test_a_run_from_the_cached_profile_is_bit_identical_with_the_measured_plan(cache, timed_calls):
    resident, weights = reference_weights(WIDTH, DEPTH)
    x = torch.randn(4, WIDTH)
    expected = resident(x)
    model, measured, events = toy_runner(weights, cache)
    first = measured.run(model.stages(), {"x": x})["x"]
    assert len(timed_calls) == 1 and len(list((cache.directory / STAGE_PROFILE).iterdir())) == 1
    second = measured.run(model.stages(), {"x": x})["x"]  # planned with the measured times
    assert torch.equal(first, expected) and torch.equal(second, expected)

    model, cached, cached_events = toy_runner(weights, cache)
    got = cached.run(model.stages(), {"x": x})["x"]
    assert torch.equal(got, expected)
    assert len(timed_calls) == 1  # nothing timed: the profile came from the cache
    assert len(cached.plan.segments) > 1 and plan_layout(cached.plan) == plan_layout(measured.plan)
    assert len(cached_events.of_kind("plan")) == 1  # the first plan is already the measured one
    assert cached.profile == measured.profile
    assert cached._workspace == measured._workspace and cached._seconds == measured._seconds


def test_a_corrupt_stage_profile_is_measured_again_and_rewritten(cache, timed_calls, caplog):
    _, weights = reference_weights(WIDTH, DEPTH)
    model, runner, _ = toy_runner(weights, cache)
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    (path,) = (cache.directory / STAGE_PROFILE).iterdir()
    path.write_text('{"key": ', encoding="utf-8")
    model, runner, _ = toy_runner(weights, cache)
    with caplog.at_level(logging.WARNING, logger="sluice.cache"):
        runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    assert len(timed_calls) == 2 and "not valid JSON" in caplog.text
    model, runner, _ = toy_runner(weights, cache)
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    assert len(timed_calls) == 2  # the rewritten file is read


def test_a_profile_of_the_wrong_length_is_ignored(cache, timed_calls, caplog):
    _, weights = reference_weights(WIDTH, DEPTH)
    model, runner, _ = toy_runner(weights, cache)
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    key = profile_cache.stage_profile_key(
        torch.device("cpu"), model.stages(), segments._shape_signature({"x": torch.randn(4, WIDTH)}), 1)
    assert profile_cache.read_stage_profile(cache, key) is not None  # what the runner wrote
    cache.put(STAGE_PROFILE, key, {"workspace": 10, "seconds": [0.1], "peaks": [1]})
    with caplog.at_level(logging.WARNING, logger="sluice.cache"):
        assert profile_cache.read_stage_profile(cache, key) is None
    assert "1 times, 1 peaks, workspace 10 for 8 stages" in caplog.text


def test_another_torch_version_or_input_shape_misses(cache, timed_calls, monkeypatch):
    _, weights = reference_weights(WIDTH, DEPTH)
    model, runner, _ = toy_runner(weights, cache)
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})
    model, runner, _ = toy_runner(weights, cache)
    runner.run(model.stages(), {"x": torch.randn(2, WIDTH)})  # another batch size: measured
    assert len(timed_calls) == 2
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    monkeypatch.setattr(profile_cache, "_identities", {})
    model, runner, _ = toy_runner(weights, cache)
    runner.run(model.stages(), {"x": torch.randn(4, WIDTH)})  # same shape, another torch: measured
    assert len(timed_calls) == 3
    assert len(list((cache.directory / STAGE_PROFILE).iterdir())) == 3


def test_another_model_or_sdpa_setting_has_another_key(cache):
    stages = ToyStaged(WIDTH, DEPTH).stages()
    signature = segments._shape_signature({"x": torch.randn(4, WIDTH)})
    key = profile_cache.stage_profile_key(torch.device("cpu"), stages, signature, 1)
    wider = profile_cache.stage_profile_key(torch.device("cpu"), ToyStaged(WIDTH * 2, DEPTH).stages(),
                                            signature, 1)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        math_only = profile_cache.stage_profile_key(torch.device("cpu"), stages, signature, 1)
    assert wider["model"] != key["model"] and math_only["backends"] != key["backends"]
    assert len({cache.path(STAGE_PROFILE, k) for k in (key, wider, math_only)}) == 3


def test_the_attention_probe_is_read_from_the_cache_in_a_later_process(cache, monkeypatch):
    attention_probe.clear_decisions()
    monkeypatch.setattr(attention_probe, "_flash_runs", lambda device, dtype: True)
    monkeypatch.setattr(attention_probe, "benchmark_flash", lambda device, dtype: (1.0, 2.0))
    assert attention_probe.flash_attention_enabled("mps", "auto", torch.float16) is True
    attention_probe.clear_decisions()  # a new process: only the disk remembers

    def failing(device, dtype):
        raise RuntimeError("no kernel")  # a failed probe selects off

    monkeypatch.setattr(attention_probe, "_flash_runs", failing)
    assert attention_probe.flash_attention_enabled("mps", "auto", torch.float16) is True  # not probed
    assert attention_probe.flash_attention_enabled("mps", "auto", torch.bfloat16) is False  # probed, failed
    assert len(list((cache.directory / PROBE).iterdir())) == 1  # a failure is not kept
    attention_probe.clear_decisions()


def fake_gpu(monkeypatch):
    properties = types.SimpleNamespace(name="Fake GPU", total_memory=80 * 1024**3, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)


def test_the_conv_probe_and_copy_rate_are_read_from_the_cache(cache, monkeypatch):
    fake_gpu(monkeypatch)
    conv_probe.clear_decisions()
    monkeypatch.setattr(conv_probe, "_benchmark", lambda device, dtype: (1.0, 2.0))
    assert conv_probe.conv_direct_enabled("cuda:0", "auto") is True
    conv_probe.clear_decisions()
    monkeypatch.setattr(conv_probe, "_benchmark", lambda device, dtype: (2.0, 1.0))
    assert conv_probe.conv_direct_enabled("cuda:0", "auto") is True  # from the cache, not the new timing
    conv_probe.clear_decisions()

    device = torch.device("cuda", 0)
    profile_cache.write_probe(stream_model.PROBE, device, torch.uint8, 55e9, bytes=stream_model.PROBE_BYTES)
    monkeypatch.setattr(stream_model, "_BANDWIDTH", {})
    assert stream_model.copy_bandwidth(device) == 55e9  # no copy: this machine has no CUDA
    assert {p.parent.name for p in cache.directory.rglob("*.json")} == {PROBE}


def test_a_runtime_under_a_budget_from_cached_profiles_is_bit_identical(cache, timed_calls, tmp_path):
    path = tmp_path / "sd1.safetensors"
    write_checkpoint(path, "sd1", size="tiny")

    def outputs():
        bus = EventBus()
        ledger = DeviceLedger("cpu", 14 * MIB, bus=bus)  # below the UNet's 16 MiB of weights
        runtime = MemoryRuntime(MemorySettings(), bus=bus, ledgers={"cpu": ledger})
        model, clip, vae = load_checkpoint(path, params="cpu", runtime=runtime)
        context = clip.encode("a red teapot")[0][0].expand(2, -1, -1)
        x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
        eps = [model.apply(x, torch.tensor([999.0, 10.0]), context) for _ in range(2)]
        plan = plan_layout(runtime.segment_plan(model.memory.names[0]))
        return [context, *eps, vae.decode(x[:1])], plan

    measured, measured_plan = outputs()
    timed = len(timed_calls)
    cached, cached_plan = outputs()
    assert len(timed_calls) == timed  # text encoder, UNet and VAE all planned from the cache
    assert len(measured_plan) > 1 and cached_plan == measured_plan
    for a, b in zip(cached, measured, strict=True):
        assert torch.equal(a, b)

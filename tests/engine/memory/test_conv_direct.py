"""--conv-direct as cuDNN autotuning: decisions per mode and device, and the setting a module's run sees."""

import pytest
import torch
from memory_toy_model import ToyStaged, reference_weights

from engine.memory import conv_probe
from engine.memory.ledger import DeviceLedger
from engine.memory.runtime import MemoryRuntime
from engine.models.staged import Stage
from engine.placement import MemorySettings, PlacementError
from engine.telemetry import EventBus


def test_auto_is_off_without_timing_on_a_cpu_and_on_off_are_taken_as_given(monkeypatch):
    def no_timing(*args):
        raise AssertionError("the CPU decision must not time anything")

    monkeypatch.setattr(conv_probe, "_benchmark", no_timing)
    conv_probe.clear_decisions()
    assert conv_probe.conv_direct_enabled("cpu", "auto") is False
    assert conv_probe.conv_direct_enabled("cpu", "on") is True
    assert conv_probe.conv_direct_enabled("cuda:0", "off") is False
    with pytest.raises(ValueError, match="direct convolution mode 'fast'; accepted: on, off, auto"):
        conv_probe.conv_direct_enabled("cpu", "fast")


def test_the_context_sets_cudnn_autotuning_and_restores_it():
    before = torch.backends.cudnn.benchmark
    with conv_probe.conv_backends(not before):
        assert torch.backends.cudnn.benchmark is (not before)
    assert torch.backends.cudnn.benchmark is before
    with conv_probe.conv_backends(None):
        assert torch.backends.cudnn.benchmark is before


@pytest.mark.parametrize(("setting", "kind", "expected"), [
    ("on", "vae", True), ("off", "diffusion", False), ("auto,vae=on", "vae", True),
    ("on", "te", None),  # the text encoder has no direct-convolution choice: the global setting stays
])
def test_a_module_runs_with_its_conv_direct_choice(setting, kind, expected):
    bus = EventBus()
    runtime = MemoryRuntime(MemorySettings(conv_direct=setting), bus=bus,
                            ledgers={"cpu": DeviceLedger("cpu", 10**7, bus=bus)})
    _, weights = reference_weights(16, 2)
    model = ToyStaged(16, 2)
    name = runtime.register(kind, model, "device", "cpu", weights.__getitem__)
    seen = []

    def observe(state):
        seen.append(torch.backends.cudnn.benchmark)
        return state

    stages = [*model.stages(), Stage("observe", (), observe)]
    torch.backends.cudnn.benchmark = False
    runtime.run(name, model, stages, {"x": torch.randn(2, 16)})
    assert seen == [False if expected is None else expected]
    assert torch.backends.cudnn.benchmark is False  # restored after the run


def test_a_bad_conv_direct_string_names_the_part_and_the_accepted_values():
    with pytest.raises(PlacementError, match="te"):
        MemorySettings(conv_direct="auto,te=on")

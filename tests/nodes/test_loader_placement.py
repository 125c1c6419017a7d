"""Loader nodes' backend and params_backend inputs: their order, validation, and the precedence
CLI > node > workflow file > defaults (auto-fit), with outputs identical for every weight home."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

import nodes.loaders  # noqa: E402
from app.cli import configure_memory  # noqa: E402
from engine.graph.document import Workflow  # noqa: E402
from engine.graph.spec import RunContext  # noqa: E402
from engine.graph.validate import validate  # noqa: E402
from engine.memory.runtime import MemoryRuntime, set_runtime  # noqa: E402
from engine.models.loader import clear_cache  # noqa: E402
from engine.settings import Settings  # noqa: E402
from engine.telemetry import EventBus, EventRecorder  # noqa: E402
from nodes.registry import default_registry  # noqa: E402

COMFY_INPUTS = {
    "CheckpointLoaderSimple": ["ckpt_name"],
    "UNETLoader": ["unet_name", "weight_dtype"],
    "CLIPLoader": ["clip_name", "type"],
    "DualCLIPLoader": ["clip_name1", "clip_name2", "type"],
    "VAELoader": ["vae_name"],
}



pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "checkpoints").mkdir()
    write_checkpoint(root / "checkpoints" / "sd1.safetensors", "sd1", size="tiny")
    return root


@pytest.fixture
def runtime(models_root, tmp_path):
    bus = EventBus()
    runtime = MemoryRuntime(bus=bus)
    previous = set_runtime(runtime)
    nodes.loaders.configure(Settings(models_root, tmp_path / "out", None))
    clear_cache()
    yield runtime, EventRecorder(bus)
    nodes.loaders.configure(None)
    set_runtime(previous)


def loader_workflow(memory=None, **widgets):
    workflow = Workflow()
    node = workflow.add_node("CheckpointLoaderSimple", {"ckpt_name": "sd1.safetensors", **widgets})
    if memory is not None:
        workflow.settings["memory"] = memory
    return workflow, node.id


def run_loader(models_root, workflow, node_id):
    settings = Settings(models_root, models_root / "out", None)
    ctx = RunContext(node_id=node_id, settings=settings, workflow=workflow)
    widgets = workflow.nodes[node_id].widgets
    return nodes.loaders.CheckpointLoaderSimple().run(ctx, **widgets)


def test_placement_inputs_come_after_the_comfyui_inputs():
    for name, comfy in COMFY_INPUTS.items():
        node_type = nodes.loaders.LOADERS[name]
        assert [i.name for i in node_type.inputs] == [*comfy, "backend", "params_backend"]
        assert node_type.input_named("backend").default == "auto"
        assert node_type.input_named("params_backend").current_choices() == ["auto", "device", "cpu", "disk"]


def test_validation_names_a_bad_device_and_a_bad_params_choice(runtime):
    registry = default_registry()
    workflow, _ = loader_workflow(backend="tpu3", params_backend="dsk")
    messages = [str(error) for error in validate(workflow, registry.get)]
    assert any("unknown device 'tpu3'" in m and "available devices: " in m for m in messages)
    assert any("'dsk' is not one of the choices" in m for m in messages)
    good, _ = loader_workflow(backend="CPU", params_backend="disk")
    assert not [e for e in validate(good, registry.get) if "backend" in str(e)]


@pytest.mark.parametrize(
    ("memory", "node_params", "cli", "expected"),
    [
        (None, "auto", {}, "device"),  # auto-fit: the tiny model fits in RAM, where it computes
        ({"params_backend": "disk"}, "auto", {}, "disk"),  # the workflow file
        ({"params_backend": "disk"}, "device", {}, "device"),  # the node over the file
        ({"params_backend": "vae=disk"}, "auto", {"params_backend": "cpu"}, "device"),  # cpu on cpu = device
        (None, "device", {"params_backend": "disk"}, "disk"),  # the CLI over the node
    ],
)
def test_precedence_cli_over_node_over_workflow_over_auto_fit(runtime, models_root, memory, node_params, cli,
                                                            expected):
    runtime, events = runtime
    workflow, node_id = loader_workflow(memory, params_backend=node_params)
    configure_memory(argparse.Namespace(**cli), workflow)
    model, clip, vae = run_loader(models_root, workflow, node_id)
    assert model.params_location == clip.params_location == expected
    assert model.compute_device == "cpu"
    if memory is None and not cli and node_params == "auto":
        assert {e["source"] for e in events.of_kind("placement")} == {"auto-fit", "load"}


def test_every_params_choice_gives_the_same_outputs(runtime, models_root):
    results = []
    for choice in ("device", "cpu", "disk"):
        clear_cache()
        workflow, node_id = loader_workflow(params_backend=choice)
        model, clip, vae = run_loader(models_root, workflow, node_id)
        context = clip.encode("a fox")[0][0]
        x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
        results.append((context, model.apply(x, torch.tensor([500.0]), context), vae.decode(x)))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_a_bad_workflow_memory_setting_is_an_invalid_workflow_not_a_traceback(runtime, models_root, tmp_path,
                                                                              capsys):
    from app.cli import main

    workflow, _ = loader_workflow({"params_backend": "ram"})
    path = tmp_path / "wf.json"
    workflow.save(path)
    assert main(["plan", str(path), "--models", str(models_root)]) == 1
    error = capsys.readouterr().err
    assert "invalid settings.memory" in error and "'ram'" in error and "available devices" in error

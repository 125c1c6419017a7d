"""Weight types chosen at load (issue 17): `--type` / `--tensor-type-rules` quantise a model's eligible float
weights on the compute device as they load (bit-identical to the same model whose weights gguf's own quantiser
and dequantiser made), priced before loading exactly as they rest; with an explicit `--auto-fit` the ladder of
reference/004 picks the types, and `sluice plan` prints each module's type and why."""

from __future__ import annotations

import argparse

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from app.cli import main
from engine.devices import GIB
from engine.graph.document import Workflow
from engine.memory.autofit import ComponentNeed, component_needs, plan_placements, with_variant
from engine.memory.ledger import DeviceLedger
from engine.memory.runtime import MemoryRuntime, set_runtime
from engine.models.loader import clear_cache, load_checkpoint
from engine.placement import MemorySettings, PlacementError, settings_from_namespace
from engine.quant.loading import WeightTypes
from engine.quant.modules import QUANT_LAYERS
from engine.quant.quantize import tensor_type_rules
from tests.engine.models.sd_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MIB = 1024**2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("types") / "sd1.safetensors"
    write_checkpoint(path, "sd1", size="tiny")
    return path


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def gguf_round_trip(path, out, qtype: str, rules: str = ""):
    """`path` with every tensor the rules quantise replaced by gguf's quantise-dequantise of it (float32)."""
    target = tensor_type_rules(qtype, rules)
    tensors = load_file(path)
    for key, tensor in tensors.items():
        qtype = target(key, tuple(tensor.shape))
        if key.startswith(("model.diffusion_model.", "cond_stage_model.")) and qtype:
            kind = gguf.GGMLQuantizationType[qtype]
            raw = gguf.quants.quantize(tensor.float().numpy(), kind)
            tensors[key] = torch.from_numpy(gguf.quants.dequantize(raw, kind)).reshape(tensor.shape)
    save_file(tensors, out)


def outputs(model, clip) -> list[torch.Tensor]:
    conditioning = clip.encode("a red teapot")[0][0]
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    return [conditioning, model.apply(x, torch.tensor([600.0]), conditioning)]


@pytest.mark.parametrize(("qtype", "rules"), [("Q8_0", ""), ("Q4_0", "attn2=q8_0"), ("Q5_1", "")])
def test_type_quantises_on_load_as_ggufs_own_quantiser_would(checkpoint, tmp_path, qtype, rules):
    types = WeightTypes(qtype, rules)
    runtime = MemoryRuntime(ledgers={"cpu": DeviceLedger("cpu", 10**9)})
    model, clip, _ = load_checkpoint(checkpoint, components=("diffusion", "te"), runtime=runtime,
                                     types={"diffusion": types, "te": types})
    layers = [m for m in model.unet.modules() if isinstance(m, QUANT_LAYERS)]
    assert layers and {m.qtype for m in layers} == ({qtype, "Q8_0"} if rules else {qtype})
    gguf_round_trip(checkpoint, tmp_path / "copy.safetensors", qtype, rules)
    reference = load_checkpoint(tmp_path / "copy.safetensors", components=("diffusion", "te"),
                                runtime=runtime)
    for got, expected in zip(outputs(model, clip), outputs(*reference[:2]), strict=True):
        assert torch.equal(got, expected)
    needs = {n.module: n for n in component_needs(checkpoint, {"diffusion": "cpu", "te": "cpu"}, "1",
                                                  types=types)}
    ledger = runtime.ledger("cpu")
    assert needs["diffusion"].weight_bytes == ledger.tracked("diffusion")  # the plan prices what rests
    assert needs["diffusion"].variant == qtype


def ladder_need(module: str, gib: float, rungs: dict[str, float]) -> ComponentNeed:
    base = ComponentNeed(module, module, "cuda0", int(gib * GIB), 100 * MIB)
    variants = tuple(with_variant(base, t, int(g * GIB), 50 * MIB) for t, g in rungs.items())
    return ComponentNeed(module, module, "cuda0", int(gib * GIB), 100 * MIB, variants=variants)


def test_the_ladder_lowers_text_encoders_to_q8_0_and_takes_the_highest_rung_that_fits():
    rungs = {"Q8_0": 12.6, "Q5_1": 8.9, "Q5_0": 8.2, "Q4_1": 7.4, "Q4_0": 6.7}
    te = ladder_need("te", 9.1, {"Q8_0": 4.8})
    plan = plan_placements([ladder_need("diffusion", 23.8, rungs), te], {"cuda0": 24 * GIB}, 64 * GIB)
    diffusion, text = plan.choice("diffusion"), plan.choice("te")
    assert (diffusion.need.variant, diffusion.params) == ("Q8_0", "device")
    assert (text.need.variant, text.params) == ("Q8_0", "device")
    assert "lowered" in text.need.type_reason and "highest rung" in diffusion.need.type_reason
    plan = plan_placements([ladder_need("diffusion", 23.8, rungs)], {"cuda0": int(10.5 * GIB)}, 64 * GIB)
    assert (plan.choices[0].need.variant, plan.choices[0].params) == ("Q5_0", "device")  # 8.5 GiB of room
    plan = plan_placements([ladder_need("diffusion", 23.8, rungs)], {"cuda0": 6 * GIB}, 64 * GIB)
    choice = plan.choices[0]
    assert (choice.need.variant, choice.params) == ("Q8_0", "cpu")  # none fits: q8_0, streamed from RAM
    assert "no rung" in choice.need.type_reason and choice.need.weight_bytes == int(12.6 * GIB)


def test_explicit_auto_fit_alone_chooses_the_types_and_type_values_are_checked():
    assert not MemorySettings().chooses_weight_types  # auto-fit's default placement never quantises
    explicit = settings_from_namespace(argparse.Namespace(auto_fit="on"))
    assert explicit.chooses_weight_types
    typed = settings_from_namespace(argparse.Namespace(auto_fit="on", weight_type="q4_0"))
    assert not typed.chooses_weight_types and typed.weight_type == "q4_0"
    assert MemorySettings.from_dict(typed.to_dict()) == typed
    assert not MemorySettings.from_dict({"auto_fit": "on"}).chooses_weight_types
    with pytest.raises(PlacementError, match="q9_0"):
        settings_from_namespace(argparse.Namespace(weight_type="q9_0"))
    with pytest.raises(PlacementError, match="REGEX=TYPE"):
        settings_from_namespace(argparse.Namespace(tensor_type_rules="attn"))


@pytest.fixture
def plan_workflow(tmp_path, checkpoint):
    (tmp_path / "models" / "checkpoints").mkdir(parents=True)
    (tmp_path / "models" / "checkpoints" / "sd1.safetensors").write_bytes(checkpoint.read_bytes())
    workflow = Workflow()
    workflow.add_node("CheckpointLoaderSimple", {"ckpt_name": "sd1.safetensors"})
    workflow.save(tmp_path / "workflow.json")
    previous = set_runtime(MemoryRuntime())
    yield tmp_path
    set_runtime(previous)


def plan_rows(capsys) -> dict[str, list[str]]:
    out = capsys.readouterr().out
    return {line.split()[0]: line.split(maxsplit=5) for line in out.splitlines() if line.startswith("1/")}


def test_sluice_plan_prints_the_type_of_each_module_and_why(plan_workflow, capsys):
    args = ["plan", str(plan_workflow / "workflow.json"), "--models", str(plan_workflow / "models")]
    assert main(args) == 0
    assert {name: row[3] for name, row in plan_rows(capsys).items()} == {
        "1/diffusion": "file", "1/te": "file", "1/vae": "file"}
    assert main([*args, "--auto-fit"]) == 0
    rows = plan_rows(capsys)
    types = {name: row[3] for name, row in rows.items()}
    assert types == {"1/diffusion": "Q8_0", "1/te": "Q8_0", "1/vae": "file"}
    assert "text encoders above q8_0 are lowered to it" in rows["1/te"][5]
    assert "highest rung of q8_0, q5_k, q5_1, q5_0, q4_k, q4_1, q4_0" in rows["1/diffusion"][5]
    assert main([*args, "--type", "q4_0"]) == 0
    rows = plan_rows(capsys)
    assert rows["1/diffusion"][3] == "Q4_0" and rows["1/diffusion"][5].startswith("--type q4_0;")
    assert float(rows["1/diffusion"][4]) < float(rows["1/vae"][4]) * 100


def test_sluice_runs_type_flag_reaches_the_loader_nodes(plan_workflow, checkpoint):
    """`sluice run --type q5_0` (the runtime's CLI overrides) quantises what CheckpointLoaderSimple loads."""
    from engine import telemetry
    from engine.graph.executor import Executor
    from engine.memory.runtime import get_runtime
    from engine.settings import Settings
    from nodes.registry import default_registry
    from tests.nodes.capture_node import Capture

    settings = Settings(plan_workflow / "models", plan_workflow / "out", None)
    get_runtime().overrides = {"weight_type": "q5_0"}
    registry = default_registry(settings)
    registry.register(Capture)
    workflow = Workflow.load(plan_workflow / "workflow.json")
    workflow.connect("1", 0, workflow.add_node("Capture").id, "value", "MODEL")
    Capture.seen.clear()
    result = Executor(registry.get, bus=telemetry.EventBus(), settings=settings).run(workflow)
    assert result.status == "finished", result.failure or result.errors
    (model,) = [v for v in Capture.seen.values() if v is not None]
    assert {m.qtype for m in model.unet.modules() if isinstance(m, QUANT_LAYERS)} == {"Q5_0"}

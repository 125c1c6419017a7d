"""Auto-fit (reference/000): placement order and reserves in closed-form cases, header-only byte counts, the
quantiser hook, and `sluice plan` / `sluice devices`."""

import os
import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

from app.cli import main  # noqa: E402
from engine.devices import GIB, format_devices  # noqa: E402
from engine.graph.document import Workflow  # noqa: E402
from engine.memory.autofit import ComponentNeed, component_needs, plan_placements, with_variant  # noqa: E402
from engine.memory.runtime import MemoryRuntime, set_runtime  # noqa: E402
from engine.models.loader import load_checkpoint  # noqa: E402

MIB = 1024**2



pytestmark = pytest.mark.usefixtures("one_torch_thread")

def need(module, gib, compute="cuda0", largest_mib=100, fixed=None):
    return ComponentNeed(module, module, compute, int(gib * GIB), largest_mib * MIB, fixed=fixed)


def params(plan):
    return {c.need.name: c.params for c in plan.choices}


def test_everything_resident_when_it_fits_with_the_reserves():
    plan = plan_placements([need("vae", 0.2), need("te", 1.6), need("diffusion", 3.2)], {"cuda0": 24 * GIB},
                           64 * GIB)
    assert params(plan) == {"diffusion": "device", "te": "device", "vae": "device"}
    assert [c.need.module for c in plan.choices] == ["diffusion", "te", "vae"]  # priority order


def test_compute_reserve_and_lower_priority_staging_are_left_free():
    largest = 512  # MiB, the VAE's largest tensor: staging room the diffusion model must leave
    room = int(10 * GIB)
    fits = 10 - 2 - largest / 1024  # GiB: room - 2 GiB diffusion reserve - staging
    plan = plan_placements([need("diffusion", fits), need("vae", 0.1, largest_mib=largest)], {"cuda0": room},
                           None)
    assert params(plan)["diffusion"] == "device"
    plan = plan_placements([need("diffusion", fits + 0.01), need("vae", 0.1, largest_mib=largest)],
                           {"cuda0": room}, None)
    assert params(plan)["diffusion"] == "disk"  # no RAM figure: RAM residency is skipped


def test_offloaded_diffusion_that_needs_the_whole_gpu_pushes_te_and_vae_off_it():
    plan = plan_placements([need("diffusion", 23), need("te", 1.0), need("vae", 0.2)], {"cuda0": 24 * GIB},
                           64 * GIB)
    assert params(plan) == {"diffusion": "cpu", "te": "cpu", "vae": "cpu"}


def test_ram_is_shared_then_another_gpu_then_disk():
    plan = plan_placements([need("diffusion", 30), need("te", 10), need("vae", 9)],
                           {"cuda0": 8 * GIB, "cuda1": 12 * GIB}, 32 * GIB)
    assert params(plan) == {"diffusion": "cpu", "te": "cuda1", "vae": "disk"}


def test_a_split_module_counts_its_full_size_on_each_of_its_gpus():
    split = ComponentNeed("diffusion", "diffusion", "cuda0", 10 * GIB, 100 * MIB, split=("cuda1",))
    te = need("te", 5, compute="cuda1")
    # 10 GiB + 2 GiB reserve fit on both GPUs: resident; cuda1 keeps 6 GiB, too little for 5 + 2 GiB of te
    plan = plan_placements([split, te], {"cuda0": 16 * GIB, "cuda1": 16 * GIB}, 64 * GIB)
    assert params(plan) == {"diffusion": "device", "te": "cpu"}
    assert "cuda0 and cuda1" in plan.choices[0].reason
    # too small for the full size on cuda1, though the split halves would fit: offloaded (reference/000)
    plan = plan_placements([split], {"cuda0": 16 * GIB, "cuda1": 8 * GIB}, 64 * GIB)
    assert params(plan) == {"diffusion": "cpu"}


def test_cpu_compute_uses_ram_or_disk_and_reserves_no_gpu_room():
    plan = plan_placements([need("diffusion", 5, compute="cpu"), need("te", 11, compute="cuda0")],
                           {"cuda0": 12 * GIB}, 6 * GIB)
    assert params(plan) == {"diffusion": "device", "te": "disk"}  # 12 - 2 GiB reserve < 11; RAM holds 1
    plan = plan_placements([need("diffusion", 5, compute="cpu")], {}, 4 * GIB)
    assert params(plan) == {"diffusion": "disk"}


def test_a_quantiser_hook_can_make_a_component_fit_resident():
    asked = []

    def q8(component, room):
        asked.append((component.name, room))
        return with_variant(component, "q8_0", component.weight_bytes // 2, component.largest_tensor_bytes)

    plan = plan_placements([need("diffusion", 15)], {"cuda0": 16 * GIB}, 64 * GIB, quantisers=[q8])
    choice = plan.choices[0]
    assert choice.params == "device" and choice.need.variant == "q8_0"
    assert asked == [("diffusion", 14 * GIB)]  # 16 GiB - the 2 GiB compute reserve


def test_explicit_params_are_kept_and_counted():
    plan = plan_placements([need("diffusion", 20, fixed="device"), need("te", 9)], {"cuda0": 24 * GIB},
                           64 * GIB)
    assert params(plan) == {"diffusion": "device", "te": "cpu"}
    assert plan.predicted()["cuda0"]["weights"] == 20 * GIB


def test_header_byte_counts_equal_the_loaded_parameters(tmp_path):
    path = tmp_path / "sd1.safetensors"
    write_checkpoint(path, "sd1", size="tiny")
    needs = {n.module: n for n in component_needs(path, {"diffusion": "cpu", "te": "cpu", "vae": "cpu"}, "1")}
    model, clip, vae = load_checkpoint(path)
    loaded = {"diffusion": model.unet, "vae": vae.autoencoder}
    for module, torch_model in loaded.items():
        assert needs[module].weight_bytes == sum(p.numel() * 4 for p in torch_model.parameters())
    text_params = sum(p.numel() * 4 for encoder in clip.encoders for p in encoder.parameters())
    assert needs["te"].weight_bytes >= text_params  # the file also holds unused position ids


@pytest.fixture
def models_workflow(tmp_path):
    (tmp_path / "models" / "checkpoints").mkdir(parents=True)
    write_checkpoint(tmp_path / "models" / "checkpoints" / "sd1.safetensors", "sd1", size="tiny")
    workflow = Workflow()
    workflow.add_node("CheckpointLoaderSimple", {"ckpt_name": "sd1.safetensors"})
    path = tmp_path / "workflow.json"
    workflow.save(path)
    previous = set_runtime(MemoryRuntime())
    yield tmp_path, path
    set_runtime(previous)


def test_sluice_plan_prints_every_component_without_loading(models_workflow, capsys):
    root, path = models_workflow
    assert main(["plan", str(path), "--models", str(root / "models"), "--params-backend", "te=disk"]) == 0
    out = capsys.readouterr().out
    assert "1/diffusion" in out and "1/vae" in out
    assert [line.split()[2] for line in out.splitlines() if line.startswith("1/te")] == ["disk"]
    assert out.splitlines()[-1] == "job: no image size in the workflow's widgets"
    from engine.memory.runtime import get_runtime

    assert get_runtime().modules() == []  # nothing was loaded


def test_sluice_plan_shows_a_managed_cpu_budget_as_the_cpu_room(models_workflow, capsys):
    root, path = models_workflow
    assert main(["plan", str(path), "--models", str(root / "models"), "--backend", "cpu",
                 "--max-vram", "cpu=0.02"]) == 0
    rooms = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("cpu ")}
    assert rooms == {"cpu": "0.02"}  # the budget asked for, not the free RAM
    plan = plan_placements([need("diffusion", 1, compute="cpu")], {"cpu": GIB // 2}, 6 * GIB)
    assert plan.budgets["cpu"] == GIB // 2


def test_sluice_plan_rejects_a_bad_flag_with_a_clear_message(models_workflow, capsys):
    root, path = models_workflow
    assert main(["plan", str(path), "--models", str(root / "models"), "--backend", "te=tpu9"]) == 2
    assert "unknown device 'tpu9'" in capsys.readouterr().err


def test_sluice_devices_prints_the_device_table(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == format_devices().splitlines()[0] and "cpu" in out


@pytest.mark.parametrize("content", [None, b"not a checkpoint at all", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"],
                         ids=["missing", "garbage", "truncated-safetensors"])
def test_sluice_plan_fails_naming_a_missing_or_bad_model_file(models_workflow, capsys, content):
    root, path = models_workflow
    bad = root / "models" / "checkpoints" / "bad.safetensors"
    if content is not None:
        bad.write_bytes(content)
    workflow = Workflow.load(path)
    workflow.add_node("CheckpointLoaderSimple", {"ckpt_name": "bad.safetensors"})
    workflow.save(path)
    assert main(["plan", str(path), "--models", str(root / "models")]) == 1
    captured = capsys.readouterr()
    assert "1/diffusion" in captured.out  # the readable loader is still planned
    assert "bad.safetensors" in captured.err and "CheckpointLoaderSimple" in captured.err


class _Payload:
    """Unpickling it runs `touch marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_sluice_plan_fails_naming_a_malicious_pickle_and_never_runs_it(models_workflow, capsys):
    root, path = models_workflow
    marker = root / "pwned"
    (root / "models" / "checkpoints" / "evil.ckpt").write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    workflow = Workflow.load(path)
    workflow.add_node("CheckpointLoaderSimple", {"ckpt_name": "evil.ckpt"})
    workflow.save(path)
    assert main(["plan", str(path), "--models", str(root / "models")]) == 1
    err = capsys.readouterr().err
    assert "evil.ckpt" in err and "refusing to load" in err
    assert not marker.exists()

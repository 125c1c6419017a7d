"""The memory guard: a job whose largest image cannot fit the RAM available, or whose activations cannot
fit a compute device's budget, is refused before it runs, with the estimate, the limit and what to change;
a forced job passes."""

from types import SimpleNamespace

import pytest
import torch

from app.cli import default_workflow_path, main
from engine.devices import ComputeDevice
from engine.graph import job_guard
from engine.graph.document import Workflow
from engine.graph.job_guard import (
    DECODE_BYTES_PER_PIXEL,
    DIFFUSION_BYTES_PER_LATENT_PIXEL,
    IMAGE_BYTES_PER_PIXEL,
    VAE_MIN_TILE_PIXELS,
    check_job_memory,
)
from engine.graph.validate import validate
from engine.settings import Settings
from nodes.registry import default_registry

GIB = 1024**3


def text_to_image(width: int, height: int, batch: int = 1, decode: str = "VAEDecode") -> Workflow:
    workflow = Workflow()
    add = workflow.add_node
    loader = add("CheckpointLoaderSimple", {"ckpt_name": "model.safetensors"}).id
    positive = add("CLIPTextEncode", {"text": "a cat"}).id
    negative = add("CLIPTextEncode", {"text": ""}).id
    latent = add("EmptyLatentImage", {"width": width, "height": height, "batch_size": batch}).id
    sampler = add("KSampler", {}).id
    decoder = add(decode, {}).id
    save = add("SaveImage", {}).id
    for source, output, target, name, kind in (
            (loader, 1, positive, "clip", "CLIP"), (loader, 1, negative, "clip", "CLIP"),
            (loader, 0, sampler, "model", "MODEL"), (positive, 0, sampler, "positive", "CONDITIONING"),
            (negative, 0, sampler, "negative", "CONDITIONING"),
            (latent, 0, sampler, "latent_image", "LATENT"),
            (sampler, 0, decoder, "samples", "LATENT"), (loader, 2, decoder, "vae", "VAE"),
            (decoder, 0, save, "images", "IMAGE")):
        workflow.connect(source, output, target, name, kind)
    return workflow


def test_the_estimate_is_the_largest_image_times_the_bytes_each_pixel_needs():
    workflow, pixels = text_to_image(1024, 768, batch=3), 1024 * 768 * 3
    assert job_guard.estimated_peak_bytes(workflow, decode_on_cpu=True) == pixels * DECODE_BYTES_PER_PIXEL
    assert job_guard.estimated_peak_bytes(workflow, decode_on_cpu=False) == pixels * IMAGE_BYTES_PER_PIXEL
    tiled = text_to_image(1024, 768, batch=3, decode="VAEDecodeTiled")
    assert job_guard.estimated_peak_bytes(tiled, decode_on_cpu=True) == pixels * IMAGE_BYTES_PER_PIXEL


def test_a_16384_square_job_is_refused_with_the_estimate_and_what_to_change():
    errors = check_job_memory(text_to_image(16384, 16384), available=24 * GIB)
    assert [e.kind for e in errors] == ["too_large"]
    message = errors[0].message
    assert "16384x16384" in message and "24.0 GiB available" in message
    assert "VAEDecodeTiled" in message and "--force" in message


def with_prompt(workflow: Workflow, text: str) -> Workflow:
    next(node for node in workflow.nodes.values() if node.type == "CLIPTextEncode").widgets["text"] = text
    return workflow


def test_a_50_mb_prompt_is_refused_before_it_is_tokenized_and_an_ordinary_long_one_passes():
    errors = check_job_memory(with_prompt(text_to_image(512, 512), "a " * 25_000_000), available=24 * GIB)
    assert [e.kind for e in errors] == ["too_large"]
    message = errors[0].message
    assert "prompts (50,000,000 characters)" in message and "shorten the prompts" in message
    assert "24.0 GiB available" in message
    assert check_job_memory(with_prompt(text_to_image(512, 512), "a cat, " * 1500), available=24 * GIB) == []


def test_a_prompt_of_a_muted_encoder_is_not_counted():
    workflow = with_prompt(text_to_image(512, 512), "a " * 25_000_000)
    next(node for node in workflow.nodes.values() if node.type == "CLIPTextEncode").mode = "muted"
    assert check_job_memory(workflow, available=24 * GIB) == []


def test_an_ordinary_job_passes_and_a_forced_one_too():
    assert check_job_memory(text_to_image(512, 512), available=24 * GIB) == []
    huge = text_to_image(16384, 16384, batch=64)
    huge.settings[job_guard.FORCE_KEY] = True
    assert check_job_memory(huge, available=GIB) == []


def test_validation_refuses_the_huge_job_before_anything_runs(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "model.safetensors").write_bytes(b"")  # listed; never read
    workflow = text_to_image(16384, 16384, batch=4096)
    registry = default_registry(Settings(tmp_path, tmp_path / "out", None))
    assert [e.kind for e in validate(workflow, registry.get)] == ["too_large"]
    path = tmp_path / "huge.json"
    workflow.save(path)
    assert main(["run", str(path), "--models", str(tmp_path), "--output", str(tmp_path / "out")]) == 1
    assert "16384x16384 x 4096" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("widgets", [{"width": "wide", "height": 5}, {"width": True, "height": None}, {}])
def test_odd_widget_values_do_not_break_the_estimate(widgets):
    workflow = Workflow()
    workflow.add_node("EmptyLatentImage", widgets)
    assert job_guard.largest_image(workflow)[:3] in ((0, 0, 0), (1, 0, 1))


def test_sluice_plan_prints_the_jobs_estimate(tmp_path, capsys):
    path = tmp_path / "job.json"
    text_to_image(16384, 16384, batch=2).save(path)
    main(["plan", str(path), "--models", str(tmp_path)])
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("job: largest image 16384x16384 x 2, about ") and "GiB of RAM at its peak" in line


# -- each compute device's budget (job_guard.check_device_memory) --

CPU = ComputeDevice("cpu", torch.device("cpu"), "cpu", "test CPU")
FAKE_CUDA = ComputeDevice("cuda0", torch.device("cuda", 0), "gpu", "fake 24 GiB GPU")


def on(workflow: Workflow, backend: str, max_vram: str = "") -> Workflow:
    workflow.settings["memory"] = {"backend": backend, "max_vram": max_vram}
    return workflow


def test_a_job_whose_diffusion_activations_pass_a_cpu_budget_is_refused_naming_the_device_and_limit():
    workflow = on(text_to_image(2048, 2048, batch=4), "cpu", "cpu=0.5")
    latent_pixels = (2048 // 8) ** 2 * 4
    (estimate,) = job_guard.device_estimates(workflow, [CPU])
    assert estimate.device == "cpu" and estimate.budget == GIB // 2
    assert estimate.phases["diffusion"] == latent_pixels * DIFFUSION_BYTES_PER_LATENT_PIXEL["unet"]
    errors = check_job_memory(workflow, available=64 * GIB, devices=[CPU])  # the RAM is not the limit here
    assert [e.kind for e in errors] == ["too_large"]
    message = errors[0].message
    assert "diffusion activations (2048x2048 x 4)" in message and "on cpu" in message
    assert "0.5 GiB budget" in message and "lower the size or the batch" in message and "--force" in message
    workflow.settings[job_guard.FORCE_KEY] = True
    assert check_job_memory(workflow, available=64 * GIB, devices=[CPU]) == []


def test_the_vae_decode_counts_at_its_smallest_tile_and_refuses_only_a_batch_too_large_for_it():
    tiny_batch = on(text_to_image(64, 64, batch=4096), "cpu", "cpu=16")
    (estimate,) = job_guard.device_estimates(tiny_batch, [CPU])
    assert estimate.phases["vae"] == min(64, VAE_MIN_TILE_PIXELS) ** 2 * 4096 * DECODE_BYTES_PER_PIXEL
    (error,) = job_guard.check_device_memory(tiny_batch, [CPU])
    assert "VAE decode (64x64 x 4096)" in error.message and "lower the batch" in error.message
    large = on(text_to_image(4096, 4096), "cpu", "cpu=16")  # decoded whole: 24 GiB; it tiles itself
    assert job_guard.device_estimates(large, [CPU])[0].phases["vae"] == \
        VAE_MIN_TILE_PIXELS ** 2 * DECODE_BYTES_PER_PIXEL
    assert job_guard.check_device_memory(large, [CPU]) == []


def test_a_flux_job_counts_its_dit_tokens():
    workflow = on(text_to_image(1024, 1024, batch=2), "cpu", "cpu=4")
    next(n for n in workflow.nodes.values() if n.type == "CheckpointLoaderSimple").type = "UNETLoader"
    (estimate,) = job_guard.device_estimates(workflow, [CPU])
    assert "te" not in estimate.phases and "vae" not in estimate.phases  # the UNETLoader loads only the DiT
    assert estimate.phases["diffusion"] == 128 * 128 * 2 * DIFFUSION_BYTES_PER_LATENT_PIXEL["flux"]


def fake_gpu_total(monkeypatch, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=total))


def test_a_gpu_without_a_budget_is_checked_against_its_total_and_its_max_vram_wins(monkeypatch):
    fake_gpu_total(monkeypatch, 24 * GIB)
    huge = on(text_to_image(16384, 16384), "cuda0")
    (error,) = job_guard.check_device_memory(huge, [FAKE_CUDA, CPU])
    assert "on cuda0" in error.message and "24.0 GiB budget" in error.message
    assert "16384x16384 x 1" in error.message
    assert job_guard.check_device_memory(on(text_to_image(16384, 16384), "cuda0", "cuda0=64"),
                                         [FAKE_CUDA, CPU]) == []
    (error,) = job_guard.check_device_memory(huge, [FAKE_CUDA, CPU], overrides={"max_vram": "cuda0=8"})
    assert "8.0 GiB budget" in error.message  # the CLI's --max-vram over the workflow's


def test_only_the_devices_the_modules_use_are_checked(monkeypatch):
    fake_gpu_total(monkeypatch, 24 * GIB)
    workflow = on(text_to_image(1024, 1024), "cuda0,vae=cpu", "cpu=2")
    estimates = {e.device: e for e in job_guard.device_estimates(workflow, [FAKE_CUDA, CPU])}
    assert set(estimates["cuda0"].phases) == {"diffusion", "te"} and set(estimates["cpu"].phases) == {"vae"}
    assert estimates["cuda0"].budget == 24 * GIB and estimates["cpu"].budget == 2 * GIB
    assert job_guard.device_estimates(on(text_to_image(512, 512), "cpu"), [CPU])[0].budget is None


@pytest.mark.parametrize("workflow, budget", [
    (default_workflow_path(), "1"), ((512, 512), "1"), ((1024, 1024), "2")])
def test_ordinary_jobs_pass_under_small_budgets(workflow, budget, monkeypatch):
    fake_gpu_total(monkeypatch, 8 * GIB)
    job = Workflow.load(workflow) if not isinstance(workflow, tuple) else text_to_image(*workflow)
    for backend in ("cpu", "cuda0"):
        device = backend if backend == "cuda0" else "cpu"
        assert job_guard.check_device_memory(on(job, backend, f"{device}={budget}"), [FAKE_CUDA, CPU]) == []


@pytest.fixture
def own_runtime():
    """A memory runtime of the test's own: the CLI's --backend and --max-vram go to the process-wide one,
    and would place later tests' models at the CPU under a 0.1 GiB budget."""
    from engine.memory.runtime import MemoryRuntime, set_runtime

    previous = set_runtime(MemoryRuntime())
    yield
    set_runtime(previous)


def test_sluice_run_refuses_a_job_over_the_cli_budget_and_runs_it_with_force(tmp_path, capsys, own_runtime):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "model.safetensors").write_bytes(b"")  # listed; unreadable if it were loaded
    path = tmp_path / "job.json"
    text_to_image(1024, 1024).save(path)  # its diffusion activations: 0.16 GiB
    common = [str(path), "--models", str(tmp_path), "--output", str(tmp_path / "out"), "--backend", "cpu",
              "--max-vram", "cpu=0.1"]
    assert main(["run", *common]) == 1
    err = capsys.readouterr().err
    assert "on cpu, over its 0.1 GiB budget" in err and "lower the size or the batch" in err
    assert main(["run", *common, "--force"]) == 1  # it ran, and failed only at loading the empty file
    assert "budget" not in capsys.readouterr().err


def test_sluice_plan_prints_each_devices_estimate(tmp_path, capsys, own_runtime):
    path = tmp_path / "job.json"
    text_to_image(2048, 2048, batch=4).save(path)
    main(["plan", str(path), "--models", str(tmp_path), "--backend", "cpu", "--max-vram", "cpu=0.5"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("job on cpu: ")]
    diffusion = (2048 // 8) ** 2 * 4 * DIFFUSION_BYTES_PER_LATENT_PIXEL["unet"]
    assert len(lines) == 1 and f"diffusion activations {diffusion / GIB:.2f} GiB" in lines[0]
    assert "budget 0.5 GiB, over: `sluice run` refuses it without --force" in lines[0]

"""The memory guard: a job whose largest image cannot fit the RAM available is refused before it runs,
with the estimate, the limit and what to change; a forced job passes."""

import pytest

from app.cli import main
from engine.graph import job_guard
from engine.graph.document import Workflow
from engine.graph.job_guard import DECODE_BYTES_PER_PIXEL, IMAGE_BYTES_PER_PIXEL, check_job_memory
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

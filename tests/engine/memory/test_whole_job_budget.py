"""A whole generation through the node graph (loader, two prompts, KSampler, VAE decode, save) under a
`--max-vram` budget: no tracked allocation of any module, nor the sampler's own tensors, ever takes the
device's ledger over the budget."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

import app.cli  # noqa: E402
from engine.graph.document import Workflow  # noqa: E402
from engine.graph.executor import Executor  # noqa: E402
from engine.memory.runtime import MemoryRuntime, set_runtime  # noqa: E402
from engine.models.loader import clear_cache  # noqa: E402
from engine.placement import MemorySettings  # noqa: E402
from engine.settings import Settings  # noqa: E402
from engine.telemetry import EventBus, EventRecorder  # noqa: E402
from nodes.registry import default_registry  # noqa: E402

MIB = 1024**2
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def generation(checkpoint: str, budget_gib: float) -> Workflow:
    workflow = Workflow()
    add = workflow.add_node
    loader = add("CheckpointLoaderSimple", {"ckpt_name": checkpoint}).id
    positive = add("CLIPTextEncode", {"text": "a red teapot on a wooden table"}).id
    negative = add("CLIPTextEncode", {"text": "blurry"}).id
    latent = add("EmptyLatentImage", {"width": 64, "height": 64, "batch_size": 1}).id
    sampler = add("KSampler", {"seed": 3, "steps": 2, "cfg": 7.0, "sampler_name": "euler",
                               "scheduler": "normal", "denoise": 1.0}).id
    decode = add("VAEDecode", {}).id
    save = add("SaveImage", {"filename_prefix": "budget"}).id
    for source, output, target, name, kind in (
            (loader, 1, positive, "clip", "CLIP"), (loader, 1, negative, "clip", "CLIP"),
            (loader, 0, sampler, "model", "MODEL"), (positive, 0, sampler, "positive", "CONDITIONING"),
            (negative, 0, sampler, "negative", "CONDITIONING"),
            (latent, 0, sampler, "latent_image", "LATENT"),
            (sampler, 0, decode, "samples", "LATENT"), (loader, 2, decode, "vae", "VAE"),
            (decode, 0, save, "images", "IMAGE")):
        workflow.connect(source, output, target, name, kind)
    # every module on the CPU, also on a machine with a GPU: the budget checked is the CPU's
    workflow.settings["memory"] = {"max_vram": f"cpu={budget_gib!r}", "backend": "cpu"}
    return workflow


def test_a_whole_generation_under_a_budget_never_tracks_more_than_the_budget(tmp_path):
    (tmp_path / "models" / "checkpoints").mkdir(parents=True)
    write_checkpoint(tmp_path / "models" / "checkpoints" / "tiny.safetensors", "sd1", size="tiny")
    settings = Settings(tmp_path / "models", tmp_path / "output", None)
    budget = 14 * MIB  # below the tiny UNet's 16 MiB of weights: it must stream in segments
    bus = EventBus()
    events = EventRecorder(bus)
    previous = set_runtime(MemoryRuntime(MemorySettings(), bus=bus))
    clear_cache()
    try:
        workflow = generation("tiny.safetensors", budget / 1024**3)
        runtime = app.cli.configure_memory(argparse.Namespace(), workflow)
        job = Executor(default_registry(settings).get, settings=settings).run(workflow)
        ledger = runtime.ledgers["cpu"]
    finally:
        set_runtime(previous)
        clear_cache()
    assert job.status == "finished", job.failure
    assert list((tmp_path / "output").glob("budget_*.png"))
    assert ledger.budget_bytes == budget
    tracked = [e["tracked"] for e in events.of_kind("ledger") if e["device"] == "cpu"]
    modules = {e["module"] for e in events.of_kind("ledger") if e["device"] == "cpu"}
    assert {"te", "diffusion", "vae"} <= modules  # every model of the job ran under this ledger
    assert max(tracked) <= budget and ledger.peak_tracked <= budget
    held = [e for e in events.of_kind("ledger") if e["key"] == "sampler state"]
    assert [e["delta"] > 0 for e in held] == [True, False]  # the sampler's own tensors, held while it ran
    unet_plans = [p for p in events.of_kind("plan") if p["module"] == "diffusion"]
    assert unet_plans and not unet_plans[-1]["whole"]  # the budget really bit


def test_the_sampler_state_held_beside_the_unet_does_not_make_its_steps_evict_and_recopy(tmp_path):
    """The sampler's own tensors are held in the ledger while it samples; the UNet's plan must leave room for
    them, not count them as its own reusable workspace: else every step evicts resident weights to make
    room and copies them back (never steady, so never a CUDA graph: 2-3x slower steps on the H200)."""
    (tmp_path / "models" / "checkpoints").mkdir(parents=True)
    write_checkpoint(tmp_path / "models" / "checkpoints" / "tiny.safetensors", "sd1", size="tiny")
    settings = Settings(tmp_path / "models", tmp_path / "output", None)
    bus = EventBus()
    events = EventRecorder(bus)
    previous = set_runtime(MemoryRuntime(MemorySettings(), bus=bus))
    clear_cache()
    try:
        workflow = generation("tiny.safetensors", 14 * MIB / 1024**3)
        sampler = next(node for node in workflow.nodes.values() if node.type == "KSampler")
        sampler.widgets["steps"] = 6
        app.cli.configure_memory(argparse.Namespace(), workflow)
        job = Executor(default_registry(settings).get, bus=bus, settings=settings).run(workflow)
    finally:
        set_runtime(previous)
        clear_cache()
    assert job.status == "finished", job.failure
    kinds = [(e.kind, e.get("module"), e.get("allocation")) for e in events.events]
    steps = [i for i, (kind, _, _) in enumerate(kinds) if kind == "progress"]
    assert len(steps) >= 6
    steady = kinds[steps[1]:steps[-1]]  # after the calls that measure the UNet, before the VAE
    evicted = [k for k in steady if k[0] == "eviction" and k[1] == "diffusion" and k[2] == "weights"]
    assert not evicted, f"{len(evicted)} evictions of the UNet's weights between steady steps"

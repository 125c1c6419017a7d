"""Layer split (reference/000, "Multiple devices per module"): the range planner against a brute-force search,
moving the state, and a UNet / CLIP split over two devices giving exactly the single-device output."""

import contextlib
import itertools
import logging
import random
import sys
from pathlib import Path

import pytest
import torch
from split_models import (  # noqa: F401 (exact_fp32_convolutions: a fixture the GPU tests use)
    MIB,
    clip_with_weights,
    exact_fp32_convolutions,
    fake_gpu_runtime,
    fake_gpus,
    run_unet,
    tiny_clip_config,
    tiny_unet_config,
    two_gpus,
    unet_inputs,
    unet_with_weights,
)

import engine.devices
import engine.memory.runtime as runtime_module
from engine.memory.layer_split import (
    LayerSplitError,
    move_state,
    non_block_stages,
    split_capacity,
    split_stage_ranges,
    stage_groups,
)
from engine.memory.runtime import MemoryRuntime
from engine.models.clip import CLIPTextModel
from engine.models.loader import clear_cache, load_checkpoint
from engine.models.staged import Stage
from engine.models.unet import UNetModel
from engine.placement import MemorySettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from sd_checkpoints import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TWO = ["cuda0", "cuda1"]


# ---------------------------------------------------------------- planner


def used_bytes(devices, stage_bytes, count):
    used = [0] * count
    for device, nbytes in zip(devices, stage_bytes, strict=True):
        used[device] += nbytes
    return used


def block_devices(devices, main_only):
    return [d for i, d in enumerate(devices) if i not in main_only]


def test_equal_devices_get_equal_contiguous_halves():
    assert split_stage_ranges([10] * 10, [1000, 1000]) == [0] * 5 + [1] * 5


def test_ranges_follow_the_capacity_ratio_within_one_stage():
    stage_bytes = [7, 13, 10, 9, 11, 10, 12, 8, 10, 10] * 4
    devices = split_stage_ranges(stage_bytes, [3000, 1000])
    share = used_bytes(devices, stage_bytes, 2)[0] / sum(stage_bytes)
    assert abs(share - 0.75) <= max(stage_bytes) / sum(stage_bytes)
    assert devices == sorted(devices)


def test_non_block_stages_stay_on_the_main_device_and_blocks_are_contiguous():
    stage_bytes = [20, *([10] * 12), 10]
    main_only = {0, len(stage_bytes) - 1}
    devices = split_stage_ranges(stage_bytes, [500, 500, 500], main_only)
    assert devices[0] == devices[-1] == 0
    blocks = block_devices(devices, main_only)
    assert blocks == sorted(blocks) and set(blocks) == {0, 1, 2}
    # a third of the 150 bytes each, device 0's third counting its 30 non-block bytes
    assert all(abs(used - 50) <= 10 for used in used_bytes(devices, stage_bytes, 3))


def test_non_block_bytes_beyond_the_main_share_push_every_block_to_the_other_devices():
    stage_bytes = [90, *([10] * 6), 10]
    devices = split_stage_ranges(stage_bytes, [500, 500], {0, 7})
    assert devices == [0, *([1] * 6), 0]


def feasible_layouts(stage_bytes, capacities, main_only):
    """Every contiguous layout of the block stages (device index non-decreasing) that fits: brute force."""
    blocks = [i for i in range(len(stage_bytes)) if i not in main_only]
    for layout in itertools.combinations_with_replacement(range(len(capacities)), len(blocks)):
        devices = [0] * len(stage_bytes)
        for index, device in zip(blocks, layout, strict=True):
            devices[index] = device
        used = used_bytes(devices, stage_bytes, len(capacities))
        if all(u <= c for u, c in zip(used, capacities, strict=True)):
            yield devices


def test_planner_finds_a_fitting_layout_exactly_when_one_exists():
    rng = random.Random(0)
    for _ in range(300):
        stage_bytes = [rng.randint(0, 40) for _ in range(rng.randint(2, 7))]
        capacities = [rng.randint(10, 90) for _ in range(rng.randint(1, 3))]
        main_only = {0, len(stage_bytes) - 1} if rng.random() < 0.5 else set()
        exists = next(feasible_layouts(stage_bytes, capacities, main_only), None) is not None
        if not exists:
            with pytest.raises(LayerSplitError):
                split_stage_ranges(stage_bytes, capacities, main_only)
            continue
        devices = split_stage_ranges(stage_bytes, capacities, main_only)
        used = used_bytes(devices, stage_bytes, len(capacities))
        assert all(u <= c for u, c in zip(used, capacities, strict=True)), (stage_bytes, capacities, devices)
        assert all(devices[i] == 0 for i in main_only)
        blocks = block_devices(devices, main_only)
        assert blocks == sorted(blocks)


def test_too_large_module_names_devices_capacities_and_bytes():
    with pytest.raises(LayerSplitError, match=r"cuda0 can take 0\.0 MiB, cuda1 can take 1\.0 MiB") as error:
        split_stage_ranges([MIB, MIB], [10, MIB], device_names=["cuda0", "cuda1"])
    assert "2.0 MiB" in str(error.value)


def test_non_block_stages_larger_than_the_main_device_are_refused():
    with pytest.raises(LayerSplitError, match="non-block"):
        split_stage_ranges([100, 1, 100], [150, 1000], main_only={0, 2})


def test_bad_planner_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="outside"):
        split_stage_ranges([1, 2], [10, 10], main_only={5})
    with pytest.raises(ValueError, match="at least one"):
        split_stage_ranges([1, 2], [])
    with pytest.raises(ValueError, match="2 device names for 1"):
        split_stage_ranges([1], [10], device_names=["a", "b"])


def test_capacity_keeps_two_gib_headroom_but_never_more_than_half():
    gib = 1024**3
    assert split_capacity(80 * gib) == 78 * gib
    assert split_capacity(64 * MIB) == 32 * MIB
    assert split_capacity(0) == 0


def test_non_block_stages_are_the_first_and_last_unless_the_model_names_them():
    unet = UNetModel(tiny_unet_config(), device="meta")
    stages = unet.stages()
    assert non_block_stages(unet, stages) == {0, len(stages) - 1}
    assert [stages[i].name for i in sorted(non_block_stages(unet, stages))] == ["embed", "out"]

    class Named:
        def non_block_stage_names(self):
            return {"b"}

    named = [Stage(n, (), lambda s: s) for n in "abc"]
    assert non_block_stages(Named(), named) == {1}


def test_stages_sharing_a_parameter_are_never_cut_apart():
    shared, alone = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    stages = [Stage("a", (shared,), None), Stage("b", (alone,), None), Stage("c", (shared,), None),
              Stage("d", (alone,), None), Stage("e", (), None)]
    assert stage_groups(stages) == [[0, 1, 2, 3], [4]]


# ---------------------------------------------------------------- moving the state


def test_move_state_moves_tensors_in_lists_tuples_and_dicts_and_keeps_the_rest():
    state = {"h": torch.ones(2), "hs": [torch.zeros(1), torch.ones(3)], "pair": (torch.ones(1), 3),
             "nested": {"t": torch.zeros(2)}, "size": (4, 4), "flag": None}
    moved = move_state(state, "meta")
    assert moved["h"].is_meta and all(t.is_meta for t in moved["hs"]) and moved["pair"][0].is_meta
    assert moved["nested"]["t"].is_meta and moved["pair"][1] == 3
    assert moved["size"] == (4, 4) and moved["flag"] is None
    assert state["h"].device.type == "cpu"  # the input state is not changed
    same = torch.ones(1)
    assert move_state({"x": same}, "cpu")["x"] is same


# ---------------------------------------------------------------- runtime on two device names


@pytest.mark.parametrize("home", ["device", "cpu", "disk"])
def test_layer_split_unet_is_bit_identical_to_the_single_device_run(unet_reference, home):
    weights, expected = unet_reference
    runtime = fake_gpu_runtime()
    model = UNetModel(tiny_unet_config(), device="meta")
    name = runtime.register("diffusion", model, home, "cuda0", weights.__getitem__, devices=TWO)
    for _ in range(2):
        assert torch.equal(run_unet(runtime, name, model, unet_inputs()), expected)
    snapshot = runtime.snapshot()
    module = snapshot["modules"][name]
    assert module["split"] == "layer" and module["device"] == "cuda0"
    assert module["devices"] == ["cuda0", "cuda1"]
    assert [part["device"] for part in module["parts"]] == ["cuda0", "cuda1"]
    main_ranges = module["parts"][0]["stages"]
    assert main_ranges[0][0] == "embed" and main_ranges[-1] == ("out", "out")
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    assert sum(sum(part["weights"].values()) for part in module["parts"]) == weight_bytes
    assert {"kind", "device", "params", "weights", "plan", "parts"} <= set(module)
    on_second = snapshot["devices"]["cuda1"]["modules"][name]["weights"]
    assert 0.25 * weight_bytes < on_second < 0.75 * weight_bytes  # equal budgets: about half each
    runtime.unregister(name)
    assert all(d["tracked"] == 0 for d in runtime.snapshot()["devices"].values())


def test_layer_split_follows_the_budgets(unet_reference):
    weights, expected = unet_reference
    runtime = fake_gpu_runtime(budgets_mib=(24, 8))  # capacities 12 and 4 MiB: three quarters on cuda0
    model = UNetModel(tiny_unet_config(), device="meta")
    name = runtime.register("diffusion", model, "device", "cuda0", weights.__getitem__,
                            devices=TWO)
    assert torch.equal(run_unet(runtime, name, model, unet_inputs()), expected)
    tracked = {d: s["modules"][name]["weights"] for d, s in runtime.snapshot()["devices"].items()}
    assert tracked["cuda0"] > 2 * tracked["cuda1"] > 0


def test_layer_split_that_cannot_fit_names_the_devices(unet_reference):
    weights, _ = unet_reference
    runtime = fake_gpu_runtime(budgets_mib=(4, 4))
    model = UNetModel(tiny_unet_config(), device="meta")
    with pytest.raises(LayerSplitError, match="cuda0 can take 2.0 MiB, cuda1 can take 2.0 MiB"):
        runtime.register("diffusion", model, "device", "cuda0", weights.__getitem__, devices=TWO)
    assert runtime.modules() == []
    assert all(d["tracked"] == 0 for d in runtime.snapshot()["devices"].values())


@pytest.mark.parametrize("layout", ["hf", "open_clip"])
def test_layer_split_clip_is_bit_identical_to_the_single_device_run(layout):
    reference, weights = clip_with_weights(layout)
    tokens = torch.randint(0, 999, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden, pooled = reference(tokens, clip_skip=2, return_pooled=True)
    runtime = fake_gpu_runtime(budgets_mib=(4, 4))
    model = CLIPTextModel(tiny_clip_config(layout), device="meta")
    name = runtime.register("te", model, "cpu", "cuda0", weights.__getitem__, devices=TWO)
    with torch.no_grad():
        state = runtime.run(name, model, model.stages(), model.initial_state(tokens, 2, True))
    assert torch.equal(state["hidden"], hidden) and torch.equal(state["pooled"], pooled)
    embeddings = model.stages()[0]  # a call of other stages over the same modules (ManagedEncoder's lookup)
    lookup = Stage("token_embeddings", embeddings.modules,
                   lambda s: {"embeds": model.token_embeddings(s["tokens"])})
    with torch.no_grad():
        embeds = runtime.run(name, model, [lookup], {"tokens": tokens})["embeds"]
    assert torch.equal(embeds, reference.token_embeddings(tokens))
    parts = runtime.snapshot()["modules"][name]["parts"]
    assert parts[0]["stages"][0][0] == "embeddings" and parts[0]["stages"][-1] == ("final", "final")
    assert parts[1]["device"] == "cuda1" and parts[1]["weights"]["replica"] > 0


def test_a_model_without_stages_falls_back_to_the_first_device(caplog):
    runtime = fake_gpu_runtime()
    model = torch.nn.Linear(4, 4, device="meta")
    weights = {"weight": torch.ones(4, 4), "bias": torch.zeros(4)}
    with caplog.at_level(logging.WARNING, logger="sluice.memory"):
        name = runtime.register("diffusion", model, "device", "cuda0", weights.__getitem__,
                                devices=TWO)
    assert "computing on cuda0" in caplog.text
    module = runtime.snapshot()["modules"][name]
    assert module["split"] is None and module["devices"] == ["cuda0"]


def test_devices_must_list_the_main_device_first():
    runtime = fake_gpu_runtime()
    model = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="must list cuda0 first"):
        runtime.register("diffusion", model, "device", "cuda0", {}.__getitem__, devices=["cuda1", "cuda0"])
    with pytest.raises(ValueError, match="unknown split mode 'rows'; accepted: layer, row"):
        runtime.register("diffusion", model, "device", "cuda0", {}.__getitem__, devices=TWO,
                         split_mode="rows")


def test_resolve_placement_carries_the_device_list_and_split_mode():
    runtime = fake_gpu_runtime()
    runtime.overrides = {"backend": "diffusion=cuda0&cuda1,te=cuda1", "split_mode": "diffusion=row"}
    diffusion = runtime.resolve_placement("diffusion")
    assert (diffusion.compute, diffusion.devices, diffusion.split_mode) == ("cuda0", tuple(TWO), "row")
    te = runtime.resolve_placement("te")
    assert (te.compute, te.devices, te.split_mode) == ("cuda1", ("cuda1",), "layer")


def test_flash_attention_of_a_split_module_needs_every_device(monkeypatch, unet_reference):
    weights, _ = unet_reference
    asked, used = [], []

    def first_device_says_on(device, mode, dtype):
        asked.append(device)
        return len(asked) == 1

    def record_choice(flash):
        used.append(flash)
        return contextlib.nullcontext()

    monkeypatch.setattr(runtime_module, "flash_attention_enabled", first_device_says_on)
    monkeypatch.setattr(runtime_module, "attention_backends", record_choice)
    runtime = fake_gpu_runtime(settings=MemorySettings(flash_attn="auto"))
    model = UNetModel(tiny_unet_config(), device="meta")
    name = runtime.register("diffusion", model, "device", "cuda0", weights.__getitem__, devices=TWO)
    run_unet(runtime, name, model, unet_inputs())
    assert len(asked) == 2 and used == [False]


# ---------------------------------------------------------------- two CUDA devices


@two_gpus
@pytest.mark.parametrize("home", ["device", "cpu"])
def test_layer_split_on_two_gpus_matches_one_gpu(home):
    model, weights = unet_with_weights("cuda:0")
    inputs = unet_inputs("cuda:0")
    with torch.no_grad():
        expected = model(*inputs)
    runtime = MemoryRuntime(MemorySettings(max_vram="cuda0=0.02,cuda1=0.02"))  # 20 MiB each: a real split
    split = UNetModel(tiny_unet_config(), device="meta")
    name = runtime.register("diffusion", split, home, "cuda0", weights.__getitem__, devices=TWO)
    out = run_unet(runtime, name, split, inputs)
    assert out.device == torch.device("cuda:0")
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    tracked = runtime.snapshot()["devices"]["cuda1"]["modules"][name]["weights"]
    assert tracked > 0
    runtime.unregister(name)


def outputs_on_one_and_on_two_devices(tmp_path, runtime, devices):
    """(text context, UNet prediction) of a tiny SDXL checkpoint loaded on cuda0, then on `devices`, and the
    split modules' snapshots by kind."""
    path = tmp_path / "sdxl.safetensors"
    write_checkpoint(path, "sdxl", size="tiny")
    clear_cache()
    results = []
    for device in ("cuda0", devices):
        model, clip, _ = load_checkpoint(path, "fp32", device, ("diffusion", "te"), runtime=runtime)
        with torch.no_grad():
            conditioning = clip.encode("a (red:1.2) teapot on a table")
            context = conditioning[0][0].expand(2, -1, -1)
            y = model._adm({"pooled_output": conditioning[0][1]["pooled_output"].expand(2, -1)}, 64, 64)
            x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
            results.append((conditioning[0][0], model.apply(x, torch.tensor([999.0, 10.0]), context, y)))
    split = {m["kind"]: m for m in runtime.snapshot()["modules"].values() if m["split"]}
    clear_cache()
    return results, split


@pytest.mark.parametrize("mode", ["layer", "row"])
def test_a_checkpoint_loaded_on_two_device_names_matches_one_device(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(engine.devices, "list_devices", fake_gpus)  # the loader resolves cuda0, cuda1
    runtime = fake_gpu_runtime((256, 256), MemorySettings(split_mode=mode))
    results, split = outputs_on_one_and_on_two_devices(tmp_path, runtime, "cuda0&cuda1")
    (context_one, eps_one), (context_two, eps_two) = results
    assert set(split) == {"diffusion", "te"} and split["diffusion"]["devices"] == TWO
    assert split["te"]["split"] == split["diffusion"]["split"] == mode
    torch.testing.assert_close(context_two, context_one, rtol=0, atol=1e-6 if mode == "row" else 0)
    torch.testing.assert_close(eps_two, eps_one, rtol=0, atol=1e-6 if mode == "row" else 0)


def test_only_the_diffusion_model_and_text_encoder_load_on_several_devices(tmp_path, monkeypatch):
    monkeypatch.setattr(engine.devices, "list_devices", fake_gpus)
    path = tmp_path / "sdxl.safetensors"
    write_checkpoint(path, "sdxl", size="tiny", components=("vae",))
    with pytest.raises(ValueError, match="vae: computing on several devices .* diffusion, te only"):
        load_checkpoint(path, "fp32", {"vae": "cuda0&cuda1"}, ("vae",), runtime=fake_gpu_runtime())


@two_gpus
@pytest.mark.parametrize("mode", ["layer", "row"])
def test_a_checkpoint_loaded_over_two_gpus_matches_one_gpu(tmp_path, mode):
    runtime = MemoryRuntime(MemorySettings(split_mode=mode))
    results, split = outputs_on_one_and_on_two_devices(tmp_path, runtime, "cuda0&cuda1")
    (context_one, eps_one), (context_two, eps_two) = results
    assert set(split) == {"diffusion", "te"} and split["diffusion"]["split"] == mode
    torch.testing.assert_close(context_two, context_one, rtol=0, atol=1e-5)
    torch.testing.assert_close(eps_two, eps_one, rtol=0, atol=1e-4)

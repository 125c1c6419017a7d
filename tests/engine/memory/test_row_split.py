"""Row split (reference/000, "--split-mode row"): a row-sharded linear equals nn.Linear, sharding a UNet's
transformer-block linears keeps its output, and the runtime's row split over two devices matches one
device."""

import logging

import pytest
import torch
from memory_toy_model import ToyStaged, reference_weights
from split_models import (  # noqa: F401 (exact_fp32_convolutions: a fixture the GPU tests use)
    clip_with_weights,
    exact_fp32_convolutions,
    fake_gpu_runtime,
    run_unet,
    tiny_unet_config,
    two_gpus,
    unet_inputs,
    unet_with_weights,
)

from engine.memory.row_split import RowShardedLinear, block_linears, shard_transformer_linears, split_rows
from engine.memory.runtime import MemoryRuntime
from engine.models.unet import UNetModel
from engine.placement import MemorySettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TWO, ROW = ["cuda0", "cuda1"], "row"


def test_rows_are_split_in_proportion_and_sum_to_the_total():
    assert split_rows(10, [1, 1]) == [5, 5]
    assert split_rows(12, [3, 1]) == [9, 3]
    counts = split_rows(1280, [0.5, 0.3, 0.2])
    assert sum(counts) == 1280 and counts == [640, 384, 256]
    odd = split_rows(7, [1, 1, 1])
    assert sum(odd) == 7 and max(odd) - min(odd) <= 1
    with pytest.raises(ValueError, match="positive sum"):
        split_rows(4, [0, 0])


@pytest.mark.parametrize("fractions", [(0.5, 0.5), (0.6, 0.3, 0.1)])
@pytest.mark.parametrize("bias", [True, False])
def test_row_sharded_linear_equals_nn_linear(fractions, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 70, bias=bias)
    sharded = RowShardedLinear(linear.weight.detach(), linear.bias, [("cpu", f) for f in fractions])
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), linear(x), rtol=0, atol=1e-6)
    assert [stop - start for start, stop in sharded.rows] == split_rows(70, fractions)
    assert sum(nbytes for _, nbytes in sharded.shard_bytes()) == linear.weight.numel() * 4


def test_a_device_with_no_rows_holds_no_slice():
    linear = torch.nn.Linear(8, 3)
    sharded = RowShardedLinear(linear.weight.detach(), linear.bias, [("cpu", 1.0), ("meta", 0.0)])
    assert sharded.devices == [torch.device("cpu")]


def test_block_linears_are_the_transformer_block_and_encoder_layer_linears():
    unet = UNetModel(tiny_unet_config(), device="meta")
    names = block_linears(unet)
    assert names and all(".transformer_blocks." in name for name in names)
    linears = {n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {n for n in linears if "transformer_blocks" in n}
    assert set(names) == expected
    assert not any(name.endswith(("proj_in", "proj_out")) for name in names)  # outside the blocks
    hf, _ = clip_with_weights("hf")
    assert {name.split(".")[-1] for name in block_linears(hf)} == {"q_proj", "k_proj", "v_proj", "out_proj",
                                                                   "fc1", "fc2"}
    open_clip, _ = clip_with_weights("open_clip")
    assert {name.split(".")[-1] for name in block_linears(open_clip)} == {"out_proj", "c_fc", "c_proj"}


def test_sharding_a_unets_transformer_linears_keeps_its_output():
    model, _ = unet_with_weights()
    inputs = unet_inputs()
    with torch.no_grad():
        expected = model(*inputs)
        names = shard_transformer_linears(model, ["cpu", "cpu", "cpu"], [0.5, 0.25, 0.25])
        out = model(*inputs)
    assert names == block_linears(UNetModel(tiny_unet_config(), device="meta"))
    assert all(isinstance(model.get_submodule(name), RowShardedLinear) for name in names)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_a_meta_weight_is_read_from_the_source():
    _, weights = unet_with_weights()
    model = UNetModel(tiny_unet_config(), device="meta")
    reserved = []
    names = shard_transformer_linears(model, ["cpu", "cpu"], [1, 1], weights.__getitem__,
                                      lambda index, shard, nbytes: reserved.append((index, nbytes)))
    first = model.get_submodule(names[0])
    torch.testing.assert_close(torch.cat(first.shards), weights[f"{names[0]}.weight"], rtol=0, atol=0)
    weight_bytes = sum(weights[f"{n}.weight"].numel() * 4 for n in names)
    assert sum(nbytes for _, nbytes in reserved) == weight_bytes and {i for i, _ in reserved} == {0, 1}


@pytest.mark.parametrize("home", ["device", "cpu", "disk"])
def test_row_split_unet_matches_the_single_device_run(unet_reference, home):
    weights, expected = unet_reference
    runtime = fake_gpu_runtime()
    model = UNetModel(tiny_unet_config(), device="meta")
    name = runtime.register("diffusion", model, home, "cuda0", weights.__getitem__, TWO, ROW)
    torch.testing.assert_close(run_unet(runtime, name, model, unet_inputs()), expected, rtol=0, atol=1e-5)
    snapshot = runtime.snapshot()
    module = snapshot["modules"][name]
    assert module["split"] == "row" and module["device"] == "cuda0"
    assert [part["device"] for part in module["parts"]] == TWO
    names = block_linears(UNetModel(tiny_unet_config(), device="meta"))
    sliced = sum(weights[f"{n}.weight"].numel() * 4 for n in names)
    on_cuda1 = module["parts"][1]["row_slices"]
    assert module["parts"][0]["row_slices"] + on_cuda1 == sliced and 0.4 < on_cuda1 / sliced < 0.6
    assert snapshot["devices"]["cuda1"]["modules"][name]["weights"] == on_cuda1
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    assert sum(module["weights"].values()) == weight_bytes
    runtime.unregister(name)
    assert all(d["tracked"] == 0 for d in runtime.snapshot()["devices"].values())


def test_row_split_without_block_linears_falls_back_to_the_first_device(caplog):
    _, weights = reference_weights()
    runtime = fake_gpu_runtime()
    with caplog.at_level(logging.WARNING, logger="sluice.memory"):
        name = runtime.register("diffusion", ToyStaged(), "device", "cuda0", weights.__getitem__, devices=TWO,
                                split_mode="row")
    assert "no transformer-block linears" in caplog.text
    assert runtime.snapshot()["modules"][name]["split"] is None


def test_row_slices_that_do_not_fit_leave_nothing_tracked(unet_reference):
    weights, _ = unet_reference
    runtime = fake_gpu_runtime(budgets_mib=(2, 1))
    model = UNetModel(tiny_unet_config(), device="meta")
    with pytest.raises(MemoryError):
        runtime.register("diffusion", model, "device", "cuda0", weights.__getitem__, TWO, ROW)
    assert all(d["tracked"] == 0 for d in runtime.snapshot()["devices"].values())


@two_gpus
@pytest.mark.parametrize("home", ["device", "cpu"])
def test_row_split_on_two_gpus_matches_one_gpu(home):
    model, weights = unet_with_weights("cuda:0")
    inputs = unet_inputs("cuda:0")
    with torch.no_grad():
        expected = model(*inputs)
    runtime = MemoryRuntime(MemorySettings())
    split = UNetModel(tiny_unet_config(), device="meta")
    name = runtime.register("diffusion", split, home, "cuda0", weights.__getitem__, TWO, ROW)
    out = run_unet(runtime, name, split, inputs)
    assert out.device == torch.device("cuda:0")
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
    slices = runtime.snapshot()["modules"][name]["parts"][1]["row_slices"]
    assert slices > 0 and runtime.snapshot()["devices"]["cuda1"]["modules"][name]["weights"] == slices
    runtime.unregister(name)

import pytest
import torch
from memory_toy_model import ToyStaged, reference_weights
from safetensors import safe_open
from safetensors.torch import save_file

from engine.memory.ledger import BudgetExceeded, DeviceLedger
from engine.memory.weight_store import WeightStore, WeightStoreError
from engine.telemetry import EventBus, EventRecorder


def make_store(budget):
    bus = EventBus()
    ledger = DeviceLedger("cpu", budget, bus=bus)
    return WeightStore(ledger, bus=bus), ledger, EventRecorder(bus)


def block_keys(module, index):
    return [f"{module}/blocks.{index}.weight", f"{module}/blocks.{index}.bias"]


def two_modules(store, budget_bytes=None):
    """diffusion: 4 blocks in segments 0..3; vae: 2 blocks outside any plan, acquired after diffusion."""
    _, diffusion_weights = reference_weights(width=16, depth=4)
    _, vae_weights = reference_weights(width=16, depth=2, seed=1)
    store.register_model("diffusion", ToyStaged(16, 4), "cpu", "cpu", diffusion_weights.__getitem__)
    store.register_model("vae", ToyStaged(16, 2), "cpu", "cpu", vae_weights.__getitem__)
    store.set_segments({key: i for i in range(4) for key in block_keys("diffusion", i)})
    for i in range(4):
        store.acquire(block_keys("diffusion", i), "cpu")
    for i in range(2):
        store.acquire(block_keys("vae", i), "cpu")


def test_eviction_order_is_idle_workspace_then_last_segment_backward_then_least_recently_used():
    store, ledger, events = make_store(10**6)
    two_modules(store)
    ledger.allocate("te", "workspace", "compute", 100)
    ledger.set_idle("te", "compute")
    store.evict_until_fits(10**6, "cpu")
    evicted = [(e["key"], e["reason"]) for e in events.of_kind("eviction")]
    expected = [("compute", "idle_workspace")]
    for i in (3, 2, 1, 0):
        expected += [
            (f"diffusion/blocks.{i}.bias", "last_segment"),
            (f"diffusion/blocks.{i}.weight", "last_segment"),
        ]
    expected += [(key, "lru") for i in (0, 1) for key in block_keys("vae", i)]
    assert evicted == expected
    assert ledger.tracked() == 0


def test_eviction_stops_as_soon_as_the_request_fits():
    store, ledger, events = make_store(10**6)
    two_modules(store)
    segment_bytes = sum(store.nbytes(k) for k in block_keys("diffusion", 3))
    needed = ledger.available() + segment_bytes
    store.evict_until_fits(needed, "cpu")
    assert [e["key"] for e in events.of_kind("eviction")] == block_keys("diffusion", 3)[::-1]
    assert ledger.would_fit(needed)


def test_pinned_and_protected_replicas_are_never_evicted():
    store, ledger, events = make_store(10**6)
    two_modules(store)
    store.pin(block_keys("diffusion", 3))
    store.evict_until_fits(10**6, "cpu", protect=block_keys("vae", 1))
    evicted = {e["key"] for e in events.of_kind("eviction")}
    assert not evicted & set(block_keys("diffusion", 3) + block_keys("vae", 1))
    assert all(store.is_resident(k) for k in block_keys("diffusion", 3) + block_keys("vae", 1))
    store.unpin(block_keys("diffusion", 3))
    with pytest.raises(WeightStoreError, match="is not pinned"):
        store.unpin(block_keys("diffusion", 3))


def test_copy_that_cannot_fit_is_refused_before_allocation():
    _, weights = reference_weights(width=64, depth=1)
    store, ledger, events = make_store(10_000)  # one 64x64 f32 weight is 16384 bytes
    store.register_model("diffusion", ToyStaged(64, 1), "cpu", "cpu", weights.__getitem__)
    with pytest.raises(BudgetExceeded, match="weights 'diffusion/blocks.0.weight' of diffusion needs"):
        store.acquire(["diffusion/blocks.0.weight"], "cpu")
    assert not store.is_resident("diffusion/blocks.0.weight")
    assert ledger.tracked() == 0 and events.of_kind("transfer") == []


def test_device_home_is_tracked_at_load_and_refused_over_budget():
    _, weights = reference_weights(width=64, depth=2)
    store, ledger, _ = make_store(20_000)
    with pytest.raises(BudgetExceeded):
        store.register_model("diffusion", ToyStaged(64, 2), "device", "cpu", weights.__getitem__)
    roomy, roomy_ledger, events = make_store(10**6)
    model = ToyStaged(64, 2)
    roomy.register_model("diffusion", model, "device", "cpu", weights.__getitem__)
    assert roomy_ledger.tracked("diffusion", "weights") == sum(t.numel() * 4 for t in weights.values())
    assert torch.equal(model.blocks[1].weight, weights["blocks.1.weight"])
    roomy.acquire(block_keys("diffusion", 0), "cpu")
    assert events.of_kind("transfer") == []


def test_replicas_stay_resident_and_each_copy_is_one_transfer_event():
    _, weights = reference_weights(width=16, depth=2)
    store, ledger, events = make_store(10**6)
    store.register_model("te", ToyStaged(16, 2), "cpu", "cpu", weights.__getitem__)
    first = store.acquire(block_keys("te", 0), "cpu")
    second = store.acquire(block_keys("te", 0), "cpu")
    assert first["te/blocks.0.weight"] is second["te/blocks.0.weight"]
    assert torch.equal(first["te/blocks.0.weight"], weights["blocks.0.weight"])
    assert first["te/blocks.0.weight"].data_ptr() != weights["blocks.0.weight"].data_ptr()  # a real copy
    transfers = events.of_kind("transfer")
    assert [(e["key"], e["direction"], e["bytes"]) for e in transfers] == [
        ("te/blocks.0.weight", "h2d", 16 * 16 * 4),
        ("te/blocks.0.bias", "h2d", 16 * 4),
    ]
    assert ledger.tracked("te", "weights") == 16 * 16 * 4 + 16 * 4


def test_disk_home_rereads_from_a_safetensors_file_after_eviction(tmp_path):
    _, weights = reference_weights(width=16, depth=2)
    path = tmp_path / "toy.safetensors"
    save_file(weights, str(path))
    store, _, events = make_store(10**6)
    with safe_open(str(path), framework="pt") as reader:
        store.register_model("vae", ToyStaged(16, 2), "disk", "cpu", reader.get_tensor)
        assert events.of_kind("transfer") == []  # nothing read at registration
        tensors = store.acquire(block_keys("vae", 1), "cpu")
        assert torch.equal(tensors["vae/blocks.1.weight"], weights["blocks.1.weight"])
        assert store.release_module("vae") == 16 * 16 * 4 + 16 * 4
        store.acquire(block_keys("vae", 1), "cpu")
    assert [e["direction"] for e in events.of_kind("transfer")] == ["disk2h"] * 4
    assert [e["reason"] for e in events.of_kind("eviction")] == ["module_done"] * 2


def test_binding_puts_replicas_into_the_model_and_unbinding_back_to_meta():
    _, weights = reference_weights(width=16, depth=2)
    store, _, _ = make_store(10**6)
    model = ToyStaged(16, 2)
    store.register_model("diffusion", model, "cpu", "cpu", weights.__getitem__)
    stage = model.stages()[1]
    assert store.stage_keys(stage) == block_keys("diffusion", 1)
    assert model.blocks[1].weight.is_meta
    store.bind_stage_weights(stage, store.acquire(store.stage_keys(stage), "cpu"))
    assert torch.equal(model.blocks[1].weight, weights["blocks.1.weight"])
    assert not model.blocks[1].weight.requires_grad
    store.unbind_stage_weights(stage)
    assert model.blocks[1].weight.is_meta and model.blocks[1].weight.shape == (16, 16)


def test_evicting_a_bound_replica_unbinds_it():
    _, weights = reference_weights(width=16, depth=1)
    store, _, _ = make_store(10**6)
    model = ToyStaged(16, 1)
    store.register_model("diffusion", model, "cpu", "cpu", weights.__getitem__)
    stage = model.stages()[0]
    store.bind_stage_weights(stage, store.acquire(store.stage_keys(stage), "cpu"))
    store.evict_until_fits(10**6, "cpu")
    assert model.blocks[0].weight.is_meta


def test_bad_sources_and_keys_are_clear_errors():
    _, weights = reference_weights(width=16, depth=1)
    store, _, _ = make_store(10**6)
    with pytest.raises(WeightStoreError, match="unknown weight home 'gpu'; accepted: device, cpu, disk"):
        store.register_model("te", ToyStaged(16, 1), "gpu", "cpu", weights.__getitem__)
    with pytest.raises(WeightStoreError, match="has no tensor 'blocks.0.weight'"):
        store.register_model("te", ToyStaged(16, 1), "cpu", "cpu", {}.__getitem__)
    with pytest.raises(WeightStoreError, match=r"has shape \(16, 16\), the model expects \(8, 8\)"):
        store.register_model("vae", ToyStaged(8, 1), "cpu", "cpu", weights.__getitem__)
    with pytest.raises(WeightStoreError, match="unknown weight key 'te/nothing'"):
        store.acquire(["te/nothing"], "cpu")
    with pytest.raises(WeightStoreError, match="no ledger for device 'cuda0'"):
        store.ledger("cuda:0")


def test_stage_with_unregistered_parameters_is_an_error():
    store, _, _ = make_store(10**6)
    stage = ToyStaged(16, 1, device="cpu").stages()[0]
    with pytest.raises(WeightStoreError, match="stage 'blocks.0' is not registered"):
        store.stage_keys(stage)


def test_tied_parameters_are_one_weight_bound_in_every_place():
    _, weights = reference_weights(width=16, depth=2)
    model = ToyStaged(16, 2)
    model.blocks[1].weight = model.blocks[0].weight  # tied, as T5's shared embedding is
    store, ledger, _ = make_store(10**6)
    keys = store.register_model("te", model, "cpu", "cpu", weights.__getitem__)
    assert "te/blocks.1.weight" not in keys and len(keys) == 3
    stages = model.stages()
    assert store.stage_keys(stages[1]) == ["te/blocks.0.weight", "te/blocks.1.bias"]
    store.bind_stage_weights(stages[1], store.acquire(store.stage_keys(stages[1]), "cpu"))
    assert torch.equal(model.blocks[1].weight, weights["blocks.0.weight"])
    assert torch.equal(model.blocks[0].weight, weights["blocks.0.weight"])
    store.unbind_stage_weights(stages[1])
    assert model.blocks[0].weight.is_meta and model.blocks[1].weight.is_meta


def test_failed_registration_leaves_nothing_registered_or_tracked():
    _, weights = reference_weights(width=16, depth=2)
    del weights["blocks.1.bias"]
    store, ledger, _ = make_store(10**6)
    model = ToyStaged(16, 2)
    with pytest.raises(WeightStoreError, match="has no tensor 'blocks.1.bias'"):
        store.register_model("diffusion", model, "device", "cpu", weights.__getitem__)
    assert ledger.tracked() == 0
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(WeightStoreError, match="not registered"):
        store.stage_keys(model.stages()[0])


def test_a_unets_weights_lie_in_its_host_arena_in_stage_order():
    """A transformer block registers its norms after its attention and feed-forward layers; the arena still
    lays each stage's weights (norm1 beside attn1) after the previous stage's, so any run of stages is one
    contiguous span: one copy per streamed segment."""
    from split_models import tiny_unet_config

    from engine.memory.weight_store import aligned
    from engine.models.unet import UNetModel

    unet = UNetModel(tiny_unet_config(), dtype=torch.float32, device="meta")
    shapes = {name: p.shape for name, p in unet.named_parameters()}
    store, _, _ = make_store(1 << 30)
    store.register_model("diffusion", unet, "cpu", "cpu", lambda name: torch.zeros(shapes[name]))
    keys = [key for stage in unet.stages() for key in store.stage_keys(stage)]
    assert len(keys) == len(set(keys)) == len(shapes)
    offsets = [store.host_span(key)[1] for key in keys]
    expected = [0]
    for key in keys[:-1]:
        expected.append(expected[-1] + aligned(store.layout(key)[2]))
    assert offsets == expected

"""Models built on meta skip torch's initialisers; anything built on a real device meanwhile is initialised
exactly as without the context, and the initialisers come back afterwards."""

import threading

import torch
from torch import nn

from engine.models.meta_init import INITIALISERS, skipping_meta_init


def _layers(device: str) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 4, device=device), nn.Conv2d(3, 5, 3, device=device),
                         nn.GroupNorm(1, 5, device=device), nn.Embedding(7, 3, device=device))


def test_real_devices_are_initialised_as_without_the_context():
    torch.manual_seed(0)
    expected = _layers("cpu").state_dict()
    with skipping_meta_init():
        torch.manual_seed(0)
        built = _layers("cpu").state_dict()
        meta = _layers("meta")
    assert all(torch.equal(built[k], expected[k]) for k in expected)
    assert all(p.is_meta for p in meta.parameters())


def test_meta_builds_call_no_initialiser_and_the_originals_come_back(monkeypatch):
    before = {name: getattr(torch.nn.init, name) for name in INITIALISERS}
    calls = []
    original = torch.Tensor.uniform_
    monkeypatch.setattr(torch.Tensor, "uniform_",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    with skipping_meta_init(), skipping_meta_init():  # nested
        _layers("meta")
    assert calls == []
    assert {name: getattr(torch.nn.init, name) for name in INITIALISERS} == before
    _layers("meta")
    assert calls  # outside, the initialisers run again (on meta, for nothing)


def test_contexts_in_two_threads_restore_the_originals_once_both_end():
    before = torch.nn.init.uniform_
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with skipping_meta_init():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    with skipping_meta_init():
        pass
    assert torch.nn.init.uniform_ is not before  # the other thread's context still holds
    leave.set()
    thread.join()
    assert torch.nn.init.uniform_ is before

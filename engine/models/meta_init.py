"""Build models on the meta device without running torch.nn's default initialisers.

Every model is built on meta and its parameters bound to the weight store's tensors afterwards (DESIGN.md),
so the random initialisation each nn.Linear, nn.Conv2d and norm layer runs in its constructor computes
nothing; dispatching it still took about 0.3 s of an SDXL load on the H200's host (1,648 uniform_ and 398
ones_ calls). Inside `skipping_meta_init()` the initialisers return a meta tensor untouched and run as
usual on any other tensor, so a module built meanwhile on a real device, in this thread or another, is
initialised as always.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.init

INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")
_lock = threading.Lock()
_depth = 0  # nested or concurrent contexts: the originals come back when the last one ends
_originals: dict[str, Callable[..., Any]] = {}


def _skipping_meta(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialise(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(tensor, "is_meta", False):
            return tensor
        return original(tensor, *args, **kwargs)

    return initialise


@contextmanager
def skipping_meta_init() -> Iterator[None]:
    """torch.nn.init's initialisers do nothing to meta tensors while inside."""
    global _depth
    with _lock:
        if _depth == 0:
            for name in INITIALISERS:
                _originals[name] = getattr(torch.nn.init, name)
                setattr(torch.nn.init, name, _skipping_meta(_originals[name]))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, original in _originals.items():
                    setattr(torch.nn.init, name, original)
                _originals.clear()

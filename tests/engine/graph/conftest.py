"""Tiny node types for the graph runtime tests; every `run` records its node id in `calls`."""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from engine.graph.spec import (
    ANY,
    INT,
    NodeType,
    Output,
    RunContext,
    bool_input,
    combo_input,
    int_input,
    link_input,
    seed_input,
    string_input,
)

NUM = "NUM"  # a link type (INT would be a widget kind)
calls: Counter[str] = Counter()
looper_started = threading.Event()


class Const(NodeType):
    inputs = (int_input("value", 1, min=0, max=100),)
    outputs = (Output("value", NUM),)

    def run(self, ctx: RunContext, value: int) -> tuple:
        calls[ctx.node_id] += 1
        return (value,)


class Add(NodeType):
    inputs = (link_input("a", NUM), link_input("b", NUM, optional=True))
    outputs = (Output("sum", NUM),)

    def run(self, ctx: RunContext, a: int, b: int | None) -> tuple:
        calls[ctx.node_id] += 1
        return (a + (b or 0),)


class Scale(NodeType):
    inputs = (link_input("x", NUM), int_input("factor", 2, min=1, max=10))
    outputs = (Output("scaled", NUM),)

    def run(self, ctx: RunContext, x: int, factor: int) -> tuple:
        calls[ctx.node_id] += 1
        return (x * factor,)


class Sink(NodeType):
    output_node = True
    inputs = (link_input("value", NUM),)
    outputs = (Output("seen", NUM),)

    def run(self, ctx: RunContext, value: int) -> tuple:
        calls[ctx.node_id] += 1
        return (value,)


class Show(NodeType):
    output_node = True
    inputs = (link_input("anything", ANY),)

    def run(self, ctx: RunContext, anything: object) -> tuple:
        calls[ctx.node_id] += 1
        return ()


class Loader(NodeType):
    inputs = (string_input("name", "tiny.safetensors"),)
    outputs = (Output("model", "MODEL"), Output("clip", "CLIP"))

    def run(self, ctx: RunContext, name: str) -> tuple:
        calls[ctx.node_id] += 1
        return (f"model:{name}", f"clip:{name}")


class Sampler(NodeType):
    inputs = (link_input("model", "MODEL"), seed_input("seed", 5), int_input("steps", 20, min=1, max=150),
              combo_input("sampler", ("euler", "heun")), bool_input("denoise_all", True))
    outputs = (Output("latent", "LATENT"),)

    def run(self, ctx: RunContext, model: str, seed: int, steps: int, sampler: str,
            denoise_all: bool) -> tuple:
        calls[ctx.node_id] += 1
        for step in range(steps):
            ctx.report_progress(step + 1, steps)
        ctx.report_preview(f"preview of {model}")
        return (f"{model}|{seed}|{steps}|{sampler}",)


class ModelPatch(NodeType):
    """A MODEL -> MODEL node, the kind one bypasses (e.g. a LoRA loader)."""

    inputs = (link_input("model", "MODEL"), int_input("strength", 1, min=0, max=10))
    outputs = (Output("model", "MODEL"), Output("strength", INT))

    def run(self, ctx: RunContext, model: str, strength: int) -> tuple:
        calls[ctx.node_id] += 1
        return (f"patched({model},{strength})", strength)


class Looper(NodeType):
    """Loops until interrupted, calling ctx.check_interrupt() like a sampler does every step."""

    inputs = (link_input("x", NUM),)
    outputs = (Output("x", NUM),)

    def run(self, ctx: RunContext, x: int) -> tuple:
        calls[ctx.node_id] += 1
        looper_started.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ctx.check_interrupt()
            time.sleep(0.001)
        raise AssertionError("Looper was never interrupted")


class Boom(NodeType):
    inputs = (link_input("x", NUM), int_input("fuse", 0, min=0, max=1))
    outputs = (Output("x", NUM),)

    def run(self, ctx: RunContext, x: int, fuse: int) -> tuple:
        calls[ctx.node_id] += 1
        if fuse:
            raise RuntimeError(f"boom at {x}")
        return (x,)


NODE_TYPES = {cls.type_name: cls for cls in (Const, Add, Scale, Sink, Show, Loader, Sampler, ModelPatch,
                                              Looper, Boom)}


@pytest.fixture
def nodes() -> SimpleNamespace:
    """The test node types, their lookup, and the per-node call counter (reset per test)."""
    calls.clear()
    looper_started.clear()
    return SimpleNamespace(lookup=NODE_TYPES.get, calls=calls, looper_started=looper_started, **NODE_TYPES)

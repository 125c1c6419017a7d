"""Generate images with the embedded model through Sluice's ordinary path: the default workflow, run by the
executor with the built-in nodes. Used by the judge test and by tools/embedded_model_bench.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

from engine.graph.document import Workflow
from engine.graph.executor import Executor
from engine.graph.spec import NodeType, Output, RunContext, link_input
from engine.settings import Settings, resources_dir
from engine.telemetry import EventBus
from nodes.registry import default_registry
from tools import shapes_dataset

DEFAULT_WORKFLOW = resources_dir() / "workflows" / "default.json"


class CollectImage(NodeType):
    """Output node that hands the decoded image back to the caller instead of saving it."""

    output_node = True
    inputs = (link_input("images", "IMAGE"),)
    outputs = (Output("images", "IMAGE"),)

    def run(self, ctx: RunContext, images) -> tuple:
        return (images,)


@dataclass(frozen=True)
class JudgedPrompt:
    scene: shapes_dataset.Scene
    caption: str
    held_out: bool

    @property
    def names_size(self) -> bool:
        return any(f" {size} " in f" {self.caption} " for size in shapes_dataset.SIZES)


def judge_prompts(count: int, seed: int = 1234) -> list[JudgedPrompt]:
    """One-shape scenes with captions; every other one uses a colour/shape pair held out of training."""
    prompts = []
    for i in range(count):
        rng = random.Random(seed + i)
        held_out = i % 2 == 1
        scene = shapes_dataset.random_scene(rng, held_out=held_out, max_shapes=1)
        prompts.append(JudgedPrompt(scene, shapes_dataset.caption(scene, rng), held_out))
    return prompts


class EmbeddedGenerator:
    def __init__(self, settings: Settings, steps: int = 20, cfg: float = 5.0):
        registry = default_registry(settings)
        registry.register(CollectImage)
        self.workflow = Workflow.load(DEFAULT_WORKFLOW)
        self.sampler_id = next(i for i, n in self.workflow.nodes.items() if n.type == "KSampler")
        self.positive_id = self.workflow.links_into(self.sampler_id)["positive"].source
        save_id = next(i for i, n in self.workflow.nodes.items() if n.type == "SaveImage")
        self.workflow.nodes[save_id].type = "CollectImage"
        self.workflow.nodes[save_id].widgets.clear()
        self.save_id = save_id
        self.workflow.nodes[self.sampler_id].widgets.update(steps=steps, cfg=cfg)
        self.executor = Executor(registry.get, bus=EventBus(), settings=settings)

    def generate(self, prompt: str, seed: int) -> Image.Image:
        self.workflow.nodes[self.positive_id].widgets["text"] = prompt
        self.workflow.nodes[self.sampler_id].widgets["seed"] = seed
        result = self.executor.run(self.workflow)
        if result.status != "finished":
            detail = result.failure or "; ".join(str(e) for e in result.errors)
            raise RuntimeError(f"the default workflow did not finish ({result.status}): {detail}")
        images = result.outputs[self.save_id][0]  # [B, H, W, 3] in 0..1
        return Image.fromarray((images[0].numpy() * 255).round().clip(0, 255).astype(np.uint8))

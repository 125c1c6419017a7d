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


# The judge's prompt groups: colour/shape pairs seen in training, pairs held out of it (HELD_OUT), and seen
# pairs phrased in wordings training never uses (HELD_OUT_TEMPLATES).
GROUPS = ("trained pairs", "held-out pairs", "unseen wordings")


@dataclass(frozen=True)
class JudgedPrompt:
    scene: shapes_dataset.Scene
    caption: str
    group: str  # one of GROUPS

    @property
    def held_out(self) -> bool:
        return self.group == "held-out pairs"

    @property
    def names_size(self) -> bool:
        return shapes_dataset.names_size(self.caption)


def judge_prompts(count: int, seed: int = 1234, groups: tuple[str, ...] = GROUPS[:2]) -> list[JudgedPrompt]:
    """One-shape scenes with captions, the i-th of group groups[i % len(groups)]."""
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise ValueError(f"unknown judge prompt group(s) {unknown or groups!r}; "
                         f"accepted: {', '.join(GROUPS)}")
    prompts = []
    for i in range(count):
        rng = random.Random(seed + i)
        group = groups[i % len(groups)]
        scene = shapes_dataset.random_scene(rng, held_out=group == "held-out pairs", max_shapes=1)
        text = shapes_dataset.caption(scene, rng, held_out_wording=group == "unseen wordings")
        prompts.append(JudgedPrompt(scene, text, group))
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
        self.bus = EventBus()  # the run's events; live previews arrive as "preview" events
        self.executor = Executor(registry.get, bus=self.bus, settings=settings)

    def generate(self, prompt: str, seed: int) -> Image.Image:
        self.workflow.nodes[self.positive_id].widgets["text"] = prompt
        self.workflow.nodes[self.sampler_id].widgets["seed"] = seed
        result = self.executor.run(self.workflow)
        if result.status != "finished":
            detail = result.failure or "; ".join(str(e) for e in result.errors)
            raise RuntimeError(f"the default workflow did not finish ({result.status}): {detail}")
        images = result.outputs[self.save_id][0]  # [B, H, W, 3] in 0..1
        return Image.fromarray((images[0].numpy() * 255).round().clip(0, 255).astype(np.uint8))

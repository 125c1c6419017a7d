"""The memory guard of a job, checked before anything runs: the RAM its largest image needs.

A workflow's sizes are widgets (EmptyLatentImage's width, height and batch_size, ImageScale's size, a
scale_by factor), which the node specs allow up to 16384x16384 and batches of 4096. Decoding such an image
in one piece needs far more RAM than any machine has, and the run would grind for minutes before the
system kills it. So validation estimates the job's peak from its widgets and refuses a job whose estimate is
over the RAM available now, with the estimate, the limit and what to change. A workflow whose
settings hold {"force_large_jobs": true} (`sluice run --force`) runs anyway.

The estimate is an upper bound of the largest image: the largest width x height x batch of any node,
times the square of the largest scale_by factor. A VAEDecode that runs on the CPU keeps about
DECODE_BYTES_PER_PIXEL per output pixel alive at its last, full-resolution block (128 float32 channels,
three tensors); on a GPU the decode tiles itself when the device is short, and RAM only holds the images
(IMAGE_BYTES_PER_PIXEL: float32 RGB, its uint8 copy and the PNG buffers). A text encoder's prompt adds its
conditioning: at worst a token per character, 77 positions per 75 tokens, each up to 4096 float32 features
(T5-XXL's width; CLIP-L + CLIP-G's is 2048), PROMPT_BYTES_PER_CHARACTER in all, so a 50 MB prompt is refused
before the tokenizer spends minutes on it.
"""

from __future__ import annotations

import psutil
import torch

from engine.graph.document import Workflow
from engine.graph.errors import ValidationError

GIB = 1024**3
DECODE_BYTES_PER_PIXEL = 3 * 128 * 4
IMAGE_BYTES_PER_PIXEL = 16
PROMPT_BYTES_PER_CHARACTER = 77 * 4096 * 4 // 75
FORCE_KEY = "force_large_jobs"


def largest_image(workflow: Workflow) -> tuple[int, int, int, float]:
    """(width, height, batch, scale) bounding the largest image `workflow` makes, from its widgets."""
    width = height = batch = 0
    scale = 1.0
    for node in workflow.nodes.values():
        if node.mode != "normal":
            continue
        w, h, b = node.widgets.get("width"), node.widgets.get("height"), _batch(node.widgets)
        if isinstance(w, int) and isinstance(h, int) and w * h * b > width * height * batch:
            width, height, batch = w, h, b
        factor = node.widgets.get("scale_by")
        if isinstance(factor, (int, float)) and not isinstance(factor, bool):
            scale = max(scale, float(factor))
    return width, height, batch, scale


def _batch(widgets: dict) -> int:
    value = widgets.get("batch_size", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def estimated_peak_bytes(workflow: Workflow, decode_on_cpu: bool | None = None) -> int:
    """The RAM the job's largest image needs at its peak (see the module's docstring)."""
    width, height, batch, scale = largest_image(workflow)
    pixels = width * height * batch * scale * scale
    if decode_on_cpu is None:
        decode_on_cpu = not torch.cuda.is_available()
    decodes_whole = any(n.type == "VAEDecode" and n.mode == "normal" for n in workflow.nodes.values())
    per_pixel = DECODE_BYTES_PER_PIXEL if decode_on_cpu and decodes_whole else IMAGE_BYTES_PER_PIXEL
    return int(pixels * per_pixel)


def prompt_characters(workflow: Workflow) -> int:
    """The characters of every text widget of the text encoders (CLIPTextEncode, ...) that run."""
    return sum(len(value) for node in workflow.nodes.values()
               if node.mode == "normal" and "TextEncode" in node.type
               for value in node.widgets.values() if isinstance(value, str))


def job_peak_bytes(workflow: Workflow) -> int:
    """The RAM the job needs at its peak: its largest image and its prompts' conditioning."""
    return estimated_peak_bytes(workflow) + prompt_characters(workflow) * PROMPT_BYTES_PER_CHARACTER


def check_job_memory(workflow: Workflow, available: int | None = None) -> list[ValidationError]:
    """[] when the job's estimate fits the RAM available (psutil's figure unless given) or the workflow
    forces it; else one error with the estimate, the limit and what to change."""
    if workflow.settings.get(FORCE_KEY) is True:
        return []
    needed = job_peak_bytes(workflow)
    available = psutil.virtual_memory().available if available is None else available
    if needed <= available:
        return []
    width, height, batch, scale = largest_image(workflow)
    size = f"{width}x{height}" + (f" x {batch}" if batch > 1 else "")
    size += f", scaled by {scale:g}" if scale > 1 else ""
    characters = prompt_characters(workflow)
    parts = [f"largest image ({size})"] if width else []
    if characters * PROMPT_BYTES_PER_CHARACTER * 10 >= needed:  # the prompts are a tenth of it or more
        parts.append(f"prompts ({characters:,} characters)")
    return [ValidationError(
        "too_large",
        f"this job's {' and '.join(parts)} need{'s' if len(parts) == 1 else ''} about {needed / GIB:.1f} GiB "
        f"of RAM, over the {available / GIB:.1f} GiB available now; lower the size or the batch, shorten the "
        f"prompts, decode in tiles (VAEDecodeTiled), or run it anyway with `sluice run --force` "
        f"(settings.{FORCE_KEY})")]


# Beyond these a job takes minutes even on a fast GPU (and hours on a CPU): the GUI asks before running it
# and `sluice run` warns. SD's images are 512-1024 pixels a side, 20-30 steps, a batch of 1-4.
STEPS_WARNING = 150
PIXELS_WARNING = 2048 * 2048
BATCH_WARNING = 16


def slow_job_warnings(workflow: Workflow) -> list[str]:
    """One line per widget value beyond what finishes in reasonable time (steps, image size, batch), naming
    the value, its node and the usual range; [] for an ordinary job. Nothing is refused here."""
    warnings: list[str] = []
    for node_id, node in workflow.nodes.items():
        steps = node.widgets.get("steps")
        if node.mode == "normal" and isinstance(steps, int) and not isinstance(steps, bool) \
                and steps > STEPS_WARNING:
            warnings.append(f"{steps} steps (node {node_id}, {node.type}): over {STEPS_WARNING} steps takes "
                            f"long; 20-30 are usual")
    width, height, batch, scale = largest_image(workflow)
    pixels = width * height * scale * scale
    if pixels > PIXELS_WARNING:
        shown = f"{width}x{height}" + (f" scaled by {scale:g}" if scale > 1 else "")
        warnings.append(f"an image of {shown} ({pixels / 1e6:.0f} megapixels): over "
                        f"{PIXELS_WARNING / 1e6:.1f} megapixels (2048x2048) takes long; 512-1024 pixels a "
                        f"side are usual, or upscale afterwards")
    if batch > BATCH_WARNING:
        warnings.append(f"a batch of {batch} images: over {BATCH_WARNING} takes long; queue several jobs")
    return warnings

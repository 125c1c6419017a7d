"""The memory guard of a job, checked before anything runs: the RAM its largest image needs, and each
compute device's activation peak.

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

Each compute device the job's modules use (placed as the memory runtime resolves it: CLI flags, a loader's
backend, the workflow's settings["memory"]) is checked too, against its `--max-vram` budget (a positive
figure; else a GPU's total memory; a CPU without a budget is the RAM check above). The memory runtime
streams weights under that budget, so what is counted is what cannot stream: the activations at the job's
size and batch, per phase (the phases run one after another, so a device's peak is its largest phase):
- diffusion: latent pixels (width/8 x height/8) x batch x DIFFUSION_BYTES_PER_LATENT_PIXEL of its family:
  an SD1/SD2/SDXL UNet keeps about 8 fp16 tensors of 320 channels at the full latent resolution, for the
  two halves of classifier-free guidance (2 x 8 x 320 x 2 bytes); a FLUX DiT has a token per 2x2 latent
  pixels of 3072 bf16 features and its MLP's 4x wider hidden, about 8 such widths live (8 x 3072 x 2 / 4
  bytes a latent pixel; no CFG batch: FLUX is guidance-distilled);
- text encoders: the prompts' conditioning (PROMPT_BYTES_PER_CHARACTER a character);
- VAE decode (KL-f8): DECODE_BYTES_PER_PIXEL per output pixel x batch, at the size of its smallest tile
  (VAE_MIN_TILE_PIXELS a side), as the decode tiles itself when short (tiling on or auto, and its
  out-of-memory retries in half-size tiles even when off), so only a batch too large for even that tile
  is refused.
The largest single stage's weights are not counted (the headers are not read here): an estimate that errs
towards allowing, as a guard that refuses what runs is worse than none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from engine.devices import ComputeDevice, DeviceError, list_devices, resolve_device
from engine.graph.document import Workflow
from engine.graph.errors import ValidationError
from engine.memory.vae_tiling import TilingConfig
from engine.placement import PlacementError, max_vram_for, resolve_node_placement

GIB = 1024**3
DECODE_BYTES_PER_PIXEL = 3 * 128 * 4
IMAGE_BYTES_PER_PIXEL = 16
PROMPT_BYTES_PER_CHARACTER = 77 * 4096 * 4 // 75
FORCE_KEY = "force_large_jobs"
DIFFUSION_BYTES_PER_LATENT_PIXEL = {"unet": 2 * 8 * 320 * 2, "flux": 8 * 3072 * 2 // 4}
VAE_MIN_TILE_PIXELS = TilingConfig().min_tile * 8  # the smallest tile a KL-f8 decode retries down to
LOADER_MODULES = {"CheckpointLoaderSimple": ("diffusion", "te", "vae"), "UNETLoader": ("diffusion",),
                  "CLIPLoader": ("te",), "DualCLIPLoader": ("te",), "VAELoader": ("vae",)}


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


def check_job_memory(workflow: Workflow, available: int | None = None,
                     devices: Sequence[ComputeDevice] | None = None,
                     overrides: Mapping[str, Any] | None = None) -> list[ValidationError]:
    """[] when the job's estimate fits the RAM available (psutil's figure unless given) and every device's
    budget (check_device_memory), or the workflow forces it; else an error per limit with the estimate,
    the limit and what to change."""
    if workflow.settings.get(FORCE_KEY) is True:
        return []
    return _check_ram(workflow, available) + check_device_memory(workflow, devices, overrides)


def _check_ram(workflow: Workflow, available: int | None) -> list[ValidationError]:
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


@dataclass(frozen=True)
class DeviceEstimate:
    """One compute device's activation peak of a job (bytes per phase that runs there) and its budget."""

    device: str
    phases: dict[str, int]  # diffusion, text encoders, VAE decode -> bytes
    budget: int | None  # bytes; None: no managed budget and no total to compare with

    @property
    def peak(self) -> int:
        return max(self.phases.values(), default=0)


def _family(workflow: Workflow) -> str:
    """flux when a UNETLoader or a flux DualCLIPLoader runs (FLUX's loaders), else unet (SD1/SD2/SDXL)."""
    for node in workflow.nodes.values():
        if node.mode == "normal" and (node.type == "UNETLoader" or node.widgets.get("type") == "flux"):
            return "flux"
    return "unet"


def phase_bytes(workflow: Workflow) -> dict[str, int]:
    """The activation bytes of each module's phase at the job's size and batch (the module's docstring)."""
    width, height, batch, scale = largest_image(workflow)
    latent = (width * scale / 8) * (height * scale / 8) * max(batch, 1)
    tile = VAE_MIN_TILE_PIXELS
    decoded = min(width * scale, tile) * min(height * scale, tile) * max(batch, 1)
    return {"diffusion": int(latent * DIFFUSION_BYTES_PER_LATENT_PIXEL[_family(workflow)]),
            "te": prompt_characters(workflow) * PROMPT_BYTES_PER_CHARACTER,
            "vae": int(decoded * DECODE_BYTES_PER_PIXEL)}


def device_budget(device: ComputeDevice, max_vram: str, devices: Sequence[ComputeDevice]) -> int | None:
    """`device`'s `--max-vram` budget in bytes when positive, else a GPU's total memory (torch's figure); None
    for a CPU without a positive budget (the RAM check covers it)."""
    gib = max_vram_for(device, max_vram, devices)
    if gib is not None and gib > 0:
        return int(gib * GIB)
    if device.torch_device.type == "cuda":
        return int(torch.cuda.get_device_properties(device.torch_device).total_memory)
    return None


def device_estimates(workflow: Workflow, devices: Sequence[ComputeDevice] | None = None,
                     overrides: Mapping[str, Any] | None = None) -> list[DeviceEstimate]:
    """Per compute device that a running loader's module uses: its phases' activation bytes and budget.
    `overrides` are CLI flags by argparse name (the memory runtime's); a placement that does not resolve is
    left out (validation reports the device)."""
    devices = list_devices() if devices is None else list(devices)
    memory = workflow.settings.get("memory") if isinstance(workflow.settings.get("memory"), dict) else None
    phases, settings = phase_bytes(workflow), None
    per_device: dict[str, dict[str, int]] = {}
    for node in workflow.nodes.values():
        if node.mode != "normal" or node.type not in LOADER_MODULES:
            continue
        backend = node.widgets.get("backend", "auto")
        for module in LOADER_MODULES[node.type]:
            try:
                placed = resolve_node_placement(module, memory, backend if isinstance(backend, str)
                                                else "auto", "auto", overrides, devices)
            except (PlacementError, DeviceError):
                continue
            settings = placed.settings
            for name in placed.compute:  # a split module's activations run on each of its devices
                per_device.setdefault(name, {})[module] = phases[module]
    if settings is None:
        return []
    try:
        return [DeviceEstimate(name, found, device_budget(resolve_device(name, devices), settings.max_vram,
                                                          devices)) for name, found in per_device.items()]
    except PlacementError:  # --max-vram names a device that does not exist: validation reports it
        return []


PHASE_NAMES = {"diffusion": "diffusion activations", "te": "prompt conditioning", "vae": "VAE decode"}


def check_device_memory(workflow: Workflow, devices: Sequence[ComputeDevice] | None = None,
                        overrides: Mapping[str, Any] | None = None) -> list[ValidationError]:
    """An error per compute device whose activation peak is over its budget, naming the device, the
    estimate, the limit and what to change; [] when all fit or the workflow forces it."""
    if workflow.settings.get(FORCE_KEY) is True:
        return []
    errors = []
    width, height, batch, _ = largest_image(workflow)
    for estimate in device_estimates(workflow, devices, overrides):
        if estimate.budget is None or estimate.peak <= estimate.budget:
            continue
        phase = max(estimate.phases, key=estimate.phases.__getitem__)
        change = {"diffusion": "lower the size or the batch",
                  "te": "shorten the prompts",
                  "vae": f"even the VAE's smallest tiles ({VAE_MIN_TILE_PIXELS} pixels a side) hold the "
                         f"whole batch: lower the batch"}[phase]
        errors.append(ValidationError(
            "too_large",
            f"this job's {PHASE_NAMES[phase]} ({width}x{height} x {batch}) "
            f"need{'' if phase == 'diffusion' else 's'} about "
            f"{estimate.peak / GIB:.1f} GiB on {estimate.device}, over its {estimate.budget / GIB:.1f} GiB "
            f"budget (--max-vram, else its memory); {change}, place that module on another device "
            f"(--backend), or run it anyway with `sluice run --force` (settings.{FORCE_KEY})"))
    return errors


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

"""CLIP's vision tower with its projection (Radford et al. 2021; Dosovitskiy et al. 2021, "An Image is Worth
16x16 Words"): a pre-LayerNorm ViT over 14x14 patches of a 224x224 image, as ComfyUI's CLIP_VISION.

The model's parameter names are transformers' (`CLIPVisionModelWithProjection`): `vision_model.embeddings.
{class_embedding, patch_embedding.weight, position_embedding.weight}`, `vision_model.pre_layrnorm` (sic),
`vision_model.encoder.layers.N.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}`,
`vision_model.post_layernorm` and `visual_projection.weight`. Files come in two key layouts, which
`weight_names` maps onto those names (ComfyUI's comfy/clip_vision.py accepts the same two):

- "hf" (transformers; `clip_vision_g.safetensors`, `CLIP-ViT-H-14-laion2B-s32B-b79K/model.safetensors`):
  the names above, bare or under a prefix; other tensors of a whole CLIP file (its text tower) are ignored.
- "open_clip" (open_clip's `open_clip_pytorch_model.bin` under `visual.`, the SD2.1 unCLIP checkpoints'
  image embedder under `embedder.model.visual.`): `conv1.weight`, `class_embedding`, `positional_embedding`,
  `ln_pre`, `transformer.resblocks.N.{ln_1, attn.in_proj_weight / in_proj_bias (q, k, v stacked), attn.
  out_proj, ln_2, mlp.c_fc, mlp.c_proj}`, `ln_post`, and `proj` ([width, projection], the transpose of
  transformers' visual_projection.weight).

The architecture is read from the shapes; what shapes cannot tell (heads, activation) comes from the width, as
ComfyUI's three configs (clip_vision_config_{vitl,h,g}.json): ViT-L/14 (1024 wide, 24 layers, quick_gelu),
ViT-H/14 (1280, 32, gelu), ViT-bigG/14 (1664, 48, gelu), all with 16 heads. Metadata `sluice.num_heads` and
`sluice.activation` give them for other widths.

`clip_preprocess` is ComfyUI's: the IMAGE is resized (bicubic, antialiased) so that its short side is 224 and
centre-cropped (crop "center"), or squashed to 224x224 (crop "none"), quantised to 8 bits, and normalised
with CLIP's mean and std. The forward pass is the stage list "embeddings", "layers.N", "final"; its outputs
are ComfyUI's CLIP_VISION_OUTPUT: `last_hidden_state` (the last layer, before post_layernorm),
`penultimate_hidden_states` (the second-to-last layer's output) and `image_embeds` (the class token after
post_layernorm, projected).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.memory.runtime import ModuleMemory, torch_device
from engine.models.clip import ACTIVATIONS, HFLayer
from engine.models.staged import Stage, StagedModel, State, run_stages

MEMORY_MODULE = "clip_vision"
LAYOUTS = ("hf", "open_clip")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CROP_MODES = ("center", "none")  # CLIPVisionEncode's crop choices
HF_MARKER = "vision_model.embeddings.patch_embedding.weight"
OPEN_CLIP_MARKERS = ("conv1.weight", "transformer.resblocks.0.attn.in_proj_weight")
# ComfyUI's configs by width: (kind, heads, activation)
KNOWN_WIDTHS = {1024: ("vit_l", 16, "quick_gelu"), 1280: ("vit_h", 16, "gelu"), 1664: ("vit_g", 16, "gelu")}


@dataclass(frozen=True)
class CLIPVisionConfig:
    kind: str  # "vit_l", "vit_h", "vit_g", or "custom"
    width: int  # hidden size: 1024 (L), 1280 (H), 1664 (bigG)
    layers: int  # transformer layers: 24, 32, 48
    heads: int  # attention heads (16 in all three)
    intermediate: int  # MLP hidden size: 4096, 5120, 8192
    projection_dim: int  # image_embeds width: 768, 1024, 1280
    activation: str  # "quick_gelu" (OpenAI's ViT-L) or "gelu" (LAION's ViT-H, bigG)
    image_size: int = 224  # input side in pixels
    patch_size: int = 14  # patch side in pixels
    channels: int = 3  # input channels

    @property
    def positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1  # patches + the class token


def vit_l_config() -> CLIPVisionConfig:
    """OpenAI CLIP ViT-L/14 (SD2.1 unCLIP-L's image embedder; ComfyUI's clip_vision_config_vitl.json)."""
    return CLIPVisionConfig("vit_l", 1024, 24, 16, 4096, 768, "quick_gelu")


def vit_h_config() -> CLIPVisionConfig:
    """LAION CLIP ViT-H/14 (CLIP-ViT-H-14-laion2B-s32B-b79K, SD2.1 unCLIP-H; clip_vision_config_h.json)."""
    return CLIPVisionConfig("vit_h", 1280, 32, 16, 5120, 1024, "gelu")


def vit_g_config() -> CLIPVisionConfig:
    """LAION CLIP ViT-bigG/14 (clip_vision_g.safetensors, SDXL revision; clip_vision_config_g.json)."""
    return CLIPVisionConfig("vit_g", 1664, 48, 16, 8192, 1280, "gelu")


# ---------------------------------------------------------------- key layouts


def find_layout(keys: Sequence[str]) -> tuple[str, str] | None:
    """(layout, prefix) of the CLIP vision tower among `keys`, or None when there is none. An open_clip
    tower is found by its `conv1.weight` beside `transformer.resblocks.0.attn.in_proj_weight`."""
    key_set = set(keys)
    for key in keys:
        if key.endswith(HF_MARKER):
            return "hf", key[: -len(HF_MARKER)]
    for key in keys:
        if key.endswith(OPEN_CLIP_MARKERS[1]):
            prefix = key[: -len(OPEN_CLIP_MARKERS[1])]
            if prefix + OPEN_CLIP_MARKERS[0] in key_set:
                return "open_clip", prefix
    return None


_OPEN_CLIP_ROOT = {  # our name -> the open_clip key (without prefix)
    "vision_model.embeddings.class_embedding": "class_embedding",
    "vision_model.embeddings.patch_embedding.weight": "conv1.weight",
    "vision_model.embeddings.position_embedding.weight": "positional_embedding",
    "vision_model.pre_layrnorm.weight": "ln_pre.weight",
    "vision_model.pre_layrnorm.bias": "ln_pre.bias",
    "vision_model.post_layernorm.weight": "ln_post.weight",
    "vision_model.post_layernorm.bias": "ln_post.bias",
}
_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
                    "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_QKV = ("q_proj", "k_proj", "v_proj")  # their order in open_clip's stacked in_proj


@dataclass(frozen=True)
class FileTensor:
    """Where one parameter comes from: a file key, and how the tensor is cut from it."""

    key: str
    chunk: int | None = None  # the q (0), k (1) or v (2) third of a stacked in_proj tensor
    transpose: bool = False  # open_clip's proj is [width, projection]


def weight_names(keys: Sequence[str], layout: str, prefix: str, layers: int) -> dict[str, FileTensor]:
    """Our parameter name -> its FileTensor, for a tower of `layers` layers in `layout` under `prefix`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CLIP vision key layout {layout!r}; accepted: {', '.join(LAYOUTS)}")
    if layout == "hf":
        ours = [key[len(prefix):] for key in keys if key.startswith(prefix)]
        wanted = [name for name in ours if name.startswith(("vision_model.", "visual_projection."))
                  and name != "vision_model.embeddings.position_ids"]
        return {name: FileTensor(prefix + name) for name in wanted}
    names = {ours: FileTensor(prefix + theirs) for ours, theirs in _OPEN_CLIP_ROOT.items()}
    names["visual_projection.weight"] = FileTensor(prefix + "proj", transpose=True)
    for index in range(layers):
        ours, theirs = f"vision_model.encoder.layers.{index}.", f"{prefix}transformer.resblocks.{index}."
        for our_part, their_part in _OPEN_CLIP_LAYER.items():
            for kind in ("weight", "bias"):
                names[f"{ours}{our_part}.{kind}"] = FileTensor(f"{theirs}{their_part}.{kind}")
        for chunk, projection in enumerate(_QKV):
            names[f"{ours}self_attn.{projection}.weight"] = FileTensor(f"{theirs}attn.in_proj_weight", chunk)
            names[f"{ours}self_attn.{projection}.bias"] = FileTensor(f"{theirs}attn.in_proj_bias", chunk)
    return names


def read_tensor(get: Callable[[str], torch.Tensor], where: FileTensor) -> torch.Tensor:
    """The parameter's tensor from the file's getter (key -> tensor), cut as `where` says."""
    tensor = get(where.key)
    if where.chunk is not None:
        tensor = tensor.chunk(3, dim=0)[where.chunk]
    if where.transpose:
        tensor = tensor.transpose(0, 1)
    return tensor.contiguous()


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str] | None = None,
                       ) -> CLIPVisionConfig:
    """The tower's config from our parameter names' shapes (see the module docstring for heads and
    activation)."""
    metadata = metadata or {}
    try:
        width = shapes["vision_model.embeddings.class_embedding"][0]
        patch_size = shapes["vision_model.embeddings.patch_embedding.weight"][-1]
        channels = shapes["vision_model.embeddings.patch_embedding.weight"][1]
        positions = shapes["vision_model.embeddings.position_embedding.weight"][0]
        intermediate = shapes["vision_model.encoder.layers.0.mlp.fc1.weight"][0]
        projection_dim = shapes["visual_projection.weight"][0]
    except KeyError as error:
        raise ValueError(f"a CLIP vision file needs tensor {error} (in either layout); the file is "
                         f"incomplete or not a CLIP vision tower") from None
    layers = 1 + max(int(name.split(".")[3]) for name in shapes
                     if name.startswith("vision_model.encoder.layers."))
    side = math.isqrt(positions - 1)
    if side * side != positions - 1:
        raise ValueError(f"a CLIP vision tower with {positions} positions is not a square grid plus the "
                         f"class token")
    kind, heads, activation = KNOWN_WIDTHS.get(width, ("custom", 0, ""))
    if "sluice.num_heads" in metadata:
        heads = int(metadata["sluice.num_heads"])
    activation = metadata.get("sluice.activation", activation)
    if heads <= 0 or width % heads:
        raise ValueError(f"cannot tell the heads of a {width}-wide CLIP vision tower; accepted widths: "
                         f"{', '.join(map(str, KNOWN_WIDTHS))}, or metadata sluice.num_heads dividing the "
                         f"width")
    if activation not in ACTIVATIONS:
        raise ValueError(f"CLIP vision activation {activation!r}; accepted: {', '.join(ACTIVATIONS)} "
                         f"(metadata sluice.activation)")
    return CLIPVisionConfig(kind, width, layers, heads, intermediate, projection_dim, activation,
                            side * patch_size, patch_size, channels)


# ---------------------------------------------------------------- preprocessing


def clip_preprocess(image: torch.Tensor, size: int = 224, crop: bool = True) -> torch.Tensor:
    """IMAGE [B, H, W, C] in 0..1 -> pixel values [B, 3, size, size] as ComfyUI's clip_preprocess."""
    image = image[..., :3]
    mean = torch.tensor(CLIP_MEAN, device=image.device, dtype=image.dtype).view(3, 1, 1)
    std = torch.tensor(CLIP_STD, device=image.device, dtype=image.dtype).view(3, 1, 1)
    image = image.movedim(-1, 1)  # (B, 3, H, W)
    height, width = image.shape[2], image.shape[3]
    if (height, width) != (size, size):
        if crop:
            scale = size / min(height, width)
            resized = (round(scale * height), round(scale * width))
        else:
            resized = (size, size)
        image = F.interpolate(image, size=resized, mode="bicubic", antialias=True)
        top, left = (image.shape[2] - size) // 2, (image.shape[3] - size) // 2
        image = image[:, :, top:top + size, left:left + size]
    image = torch.clip(255.0 * image, 0, 255).round() / 255.0  # ComfyUI quantises to 8 bits
    return (image - mean) / std


# ---------------------------------------------------------------- the model


class VisionEmbeddings(nn.Module):
    """Patch embedding (a strided convolution), the class token before the patches, learned positions."""

    def __init__(self, config: CLIPVisionConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.width, dtype=dtype, device=device))
        self.patch_embedding = nn.Conv2d(config.channels, config.width, config.patch_size,
                                         stride=config.patch_size, bias=False, dtype=dtype, device=device)
        self.position_embedding = nn.Embedding(
            config.positions, config.width,
            _weight=torch.empty(config.positions, config.width, dtype=dtype, device=device))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.class_embedding.dtype))  # (B, W, h, w)
        patches = patches.flatten(2).transpose(1, 2)  # (B, h * w, W)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # (B, 1, W)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # (B, 1 + h * w, W)


@dataclass
class CLIPVisionOutput:
    """ComfyUI's CLIP_VISION_OUTPUT (its fields are read by name: `output.image_embeds`)."""

    image_embeds: torch.Tensor  # (B, projection_dim)
    last_hidden_state: torch.Tensor  # (B, positions, width), before post_layernorm
    penultimate_hidden_states: torch.Tensor  # (B, positions, width), the second-to-last layer's output

    def __getitem__(self, key: str) -> torch.Tensor:
        return getattr(self, key)


class CLIPVisionModel(StagedModel):
    """CLIP's vision transformer and projection (transformers' CLIPVisionModelWithProjection)."""

    def __init__(self, config: CLIPVisionConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "meta"):
        super().__init__()
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"unknown CLIP activation {config.activation!r}; "
                             f"accepted: {', '.join(ACTIVATIONS)}")
        if config.width % config.heads:
            raise ValueError(f"CLIP vision width {config.width} is not divisible by heads={config.heads}")
        if config.layers < 2:
            raise ValueError(f"a CLIP vision tower needs 2 layers or more (penultimate_hidden_states); got "
                             f"{config.layers}")
        self.config = config
        self.vision_model = nn.Module()
        self.vision_model.embeddings = VisionEmbeddings(config, dtype, device)
        self.vision_model.pre_layrnorm = nn.LayerNorm(config.width, eps=1e-5, dtype=dtype, device=device)
        self.vision_model.encoder = nn.Module()
        self.vision_model.encoder.layers = nn.ModuleList(
            HFLayer(config, dtype, device) for _ in range(config.layers))  # type: ignore[arg-type]
        self.vision_model.post_layernorm = nn.LayerNorm(config.width, eps=1e-5, dtype=dtype, device=device)
        self.visual_projection = nn.Linear(config.width, config.projection_dim, bias=False, dtype=dtype,
                                           device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_model.embeddings.class_embedding.dtype

    def _build_stages(self) -> list[Stage]:
        vision = self.vision_model
        stages = [Stage("embeddings", (vision.embeddings, vision.pre_layrnorm), self._embed)]
        for index, layer in enumerate(vision.encoder.layers):
            stages.append(Stage(f"layers.{index}", (layer,), self._layer_runner(index, layer)))
        stages.append(Stage("final", (vision.post_layernorm, self.visual_projection), self._finish))
        return stages

    def _embed(self, state: State) -> State:
        state["x"] = self.vision_model.pre_layrnorm(self.vision_model.embeddings(state["pixels"]))
        return state

    def _layer_runner(self, index: int, layer: nn.Module) -> Callable[[State], State]:
        penultimate = self.config.layers - 2

        def run(state: State) -> State:
            state["x"] = layer(state["x"], None)
            if index == penultimate:
                state["penultimate"] = state["x"]
            return state

        return run

    def _finish(self, state: State) -> State:
        pooled = self.vision_model.post_layernorm(state["x"][:, 0])  # (B, W): the class token
        state["image_embeds"] = self.visual_projection(pooled)  # (B, projection_dim)
        return state

    def initial_state(self, pixels: torch.Tensor) -> State:
        """The state the stages start from: preprocessed pixels [B, 3, size, size]."""
        size = self.config.image_size
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (self.config.channels, size, size):
            raise ValueError(f"CLIP vision pixels must be [batch, {self.config.channels}, {size}, {size}], "
                             f"got {tuple(pixels.shape)}")
        return {"pixels": pixels, "penultimate": None}

    @staticmethod
    def output(state: State) -> CLIPVisionOutput:
        return CLIPVisionOutput(state["image_embeds"], state["x"], state["penultimate"])

    def forward(self, pixels: torch.Tensor) -> CLIPVisionOutput:
        """Preprocessed pixels [B, 3, size, size] -> CLIPVisionOutput (module docstring)."""
        return self.output(run_stages(self.stages(), self.initial_state(pixels)))


@dataclass
class CLIPVision:
    """A loaded CLIP vision tower on its compute device (ComfyUI's CLIP_VISION)."""

    model: CLIPVisionModel
    compute_device: str  # Sluice device name, e.g. "cpu", "cuda0"
    params_location: str = "device"  # where the weights live: "device", "cpu" (pinned RAM) or "disk"
    source: Path | None = None
    memory: ModuleMemory | None = None  # set when the memory runtime holds the weights

    @torch.no_grad()
    def encode_image(self, image: torch.Tensor, crop: bool = True) -> CLIPVisionOutput:
        """CLIPVisionEncode: IMAGE [B, H, W, C] in 0..1 -> CLIP_VISION_OUTPUT (float32 tensors on the CPU)."""
        if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] < 3:
            shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise ValueError(f"image: expected an IMAGE batch of shape (B, H, W, 3); got {shape}")
        device = torch_device(self.compute_device)
        pixels = clip_preprocess(image.to(device).float(), self.model.config.image_size, crop)
        model = self.model
        state = model.initial_state(pixels)
        if self.memory is not None and self.memory.holds(0, model):
            state = self.memory.run(0, model, model.stages(), state)
        else:
            state = run_stages(model.stages(), state)
        out = model.output(state)
        return CLIPVisionOutput(*(t.float().cpu() for t in (out.image_embeds, out.last_hidden_state,
                                                             out.penultimate_hidden_states)))

"""CLIP text encoder (Radford et al. 2021, "Learning Transferable Visual Models From Natural Language
Supervision"): a causal pre-LayerNorm transformer over 77 BPE tokens.

Single-file checkpoints store it in one of two key layouts, and the model takes its parameter names
from whichever layout its checkpoint uses (the keys without `component_prefix(config)`):

- "hf" (transformers; SD1 and SDXL CLIP-L under `cond_stage_model.transformer.` and
  `conditioner.embedders.0.transformer.`): `text_model.embeddings.token_embedding.weight`,
  `text_model.encoder.layers.N.self_attn.{q,k,v,out}_proj`, `text_model.final_layer_norm`, and
  optionally `text_projection.weight` (a Linear, [proj, width]).
- "open_clip" (SD2 OpenCLIP-H under `cond_stage_model.model.`, SDXL bigG under
  `conditioner.embedders.1.model.`): `token_embedding.weight`, `positional_embedding`,
  `transformer.resblocks.N.attn.in_proj_weight` (fused q, k, v), `ln_final`, and `text_projection`
  (a matrix, [width, proj], used as `x @ text_projection`).

The forward pass is the stage list "embeddings", "layers.N" (or "resblocks.N"), "final".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import attention
from engine.models.detect import TextEncoderConfig
from engine.models.staged import Stage, StagedModel, State, run_stages

LAYOUTS = ("hf", "open_clip")

# Checkpoint tensors that belong to the text encoder's component but that the model does not use:
# transformers' saved position ids (old SD1 files) and open_clip's contrastive temperature.
UNUSED_CHECKPOINT_KEYS = ("text_model.embeddings.position_ids", "logit_scale")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU approximated as x * sigmoid(1.702 x), the activation OpenAI's CLIP was trained with."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"quick_gelu": quick_gelu, "gelu": F.gelu}


def clip_l_config(key_prefix: str = "cond_stage_model.transformer.text_model.") -> TextEncoderConfig:
    """OpenAI CLIP ViT-L/14 text tower (SD1, SDXL's first encoder); no projection in SD checkpoints."""
    return TextEncoderConfig(kind="clip_l", vocab_size=49408, max_positions=77, width=768, layers=12,
                             heads=12, intermediate=3072, projection_dim=None, activation="quick_gelu",
                             key_prefix=key_prefix, layout="hf")


def openclip_h_config(key_prefix: str = "cond_stage_model.model.") -> TextEncoderConfig:
    """OpenCLIP ViT-H/14 text tower (SD2.x)."""
    return TextEncoderConfig(kind="openclip_h", vocab_size=49408, max_positions=77, width=1024, layers=24,
                             heads=16, intermediate=4096, projection_dim=1024, activation="gelu",
                             key_prefix=key_prefix, layout="open_clip")


def openclip_bigg_config(key_prefix: str = "conditioner.embedders.1.model.") -> TextEncoderConfig:
    """OpenCLIP ViT-bigG/14 text tower (SDXL's second encoder, the SDXL refiner's only one)."""
    return TextEncoderConfig(kind="openclip_g", vocab_size=49408, max_positions=77, width=1280, layers=32,
                             heads=20, intermediate=5120, projection_dim=1280, activation="gelu",
                             key_prefix=key_prefix, layout="open_clip")


def component_prefix(config: TextEncoderConfig) -> str:
    """The checkpoint prefix that the model's parameter names follow: `config.key_prefix` without the
    trailing "text_model." of the hf layout (the projection sits beside `text_model`, not inside)."""
    return config.key_prefix.removesuffix("text_model.") if config.layout == "hf" else config.key_prefix


def missing_key_segment(config: TextEncoderConfig) -> str:
    """"text_model." when an hf-layout file's keys lack it (older transformers wrote SD1 checkpoints as
    `cond_stage_model.transformer.embeddings...`; ComfyUI renames them): the loader inserts it after
    `component_prefix(config)` to get the parameter names. "" for every other file."""
    bare = config.layout == "hf" and not config.key_prefix.endswith("text_model.")
    return "text_model." if bare else ""


def text_encoder_weights(tensors: Mapping[str, torch.Tensor], config: TextEncoderConfig,
                         ) -> dict[str, torch.Tensor]:
    """The encoder's tensors named as its parameters: prefix removed, UNUSED_CHECKPOINT_KEYS dropped."""
    prefix = component_prefix(config)
    selected = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
    if not selected:
        raise KeyError(f"no {config.kind} text encoder tensors under prefix {prefix!r}")
    return {key: value for key, value in selected.items() if key not in UNUSED_CHECKPOINT_KEYS}


def _linear(fan_in: int, fan_out: int, dtype: torch.dtype, device: torch.device | str,
            bias: bool = True) -> nn.Linear:
    return nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype, device=device)


def _layer_norm(width: int, dtype: torch.dtype, device: torch.device | str) -> nn.LayerNorm:
    return nn.LayerNorm(width, eps=1e-5, dtype=dtype, device=device)


def _embedding(count: int, width: int, dtype: torch.dtype, device: torch.device | str) -> nn.Embedding:
    """An uninitialised embedding table [count, width], bound from the checkpoint later: nn.Embedding's own
    random initialisation would import torch._dynamo (1-2 s on the first text encoder of a process)."""
    return nn.Embedding(count, width, _weight=torch.empty(count, width, dtype=dtype, device=device))


class HFAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections (transformers' CLIPAttention)."""

    def __init__(self, config: TextEncoderConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.heads = config.heads
        self.q_proj = _linear(config.width, config.width, dtype, device)
        self.k_proj = _linear(config.width, config.width, dtype, device)
        self.v_proj = _linear(config.width, config.width, dtype, device)
        self.out_proj = _linear(config.width, config.width, dtype, device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads, mask=mask)
        return self.out_proj(out)


class OpenClipAttention(nn.Module):
    """Causal self-attention with one fused [3 * width, width] q, k, v projection (nn.MultiheadAttention)."""

    def __init__(self, config: TextEncoderConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.heads = config.heads
        width = config.width
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width, dtype=dtype, device=device))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * config.width, dtype=dtype, device=device))
        self.out_proj = _linear(config.width, config.width, dtype, device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)  # 3 x (B, T, W)
        return self.out_proj(attention(q, k, v, self.heads, mask=mask))


class HFMLP(nn.Module):
    def __init__(self, config: TextEncoderConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.activation = ACTIVATIONS[config.activation]
        self.fc1 = _linear(config.width, config.intermediate, dtype, device)
        self.fc2 = _linear(config.intermediate, config.width, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class OpenClipMLP(nn.Module):
    def __init__(self, config: TextEncoderConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.activation = ACTIVATIONS[config.activation]
        self.c_fc = _linear(config.width, config.intermediate, dtype, device)
        self.c_proj = _linear(config.intermediate, config.width, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.activation(self.c_fc(x)))


class HFLayer(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, config: TextEncoderConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer_norm1 = _layer_norm(config.width, dtype, device)
        self.self_attn = HFAttention(config, dtype, device)
        self.layer_norm2 = _layer_norm(config.width, dtype, device)
        self.mlp = HFMLP(config, dtype, device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class OpenClipResBlock(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: TextEncoderConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.ln_1 = _layer_norm(config.width, dtype, device)
        self.attn = OpenClipAttention(config, dtype, device)
        self.ln_2 = _layer_norm(config.width, dtype, device)
        self.mlp = OpenClipMLP(config, dtype, device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class _RootParameters(nn.Module):
    """An unregistered view of some of the root model's own parameters, so that a stage can own them.

    Names are looked up at call time, so parameters rebound by `bind_weights` are seen.
    """

    def __init__(self, root: nn.Module, names: tuple[str, ...]):
        super().__init__()
        object.__setattr__(self, "root", root)  # a plain attribute: registering the root would make a cycle
        self.names = names

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for name in self.names:
            yield getattr(self.root, name)


class CLIPTextModel(StagedModel):
    """CLIP text transformer in the "hf" or "open_clip" key layout; see the module docstring."""

    def __init__(self, config: TextEncoderConfig, layout: str | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta"):
        super().__init__()
        layout = config.layout if layout is None else layout
        if layout not in LAYOUTS:
            raise ValueError(f"unknown CLIP key layout {layout!r}; accepted: {', '.join(LAYOUTS)}")
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"unknown CLIP activation {config.activation!r}; "
                             f"accepted: {', '.join(ACTIVATIONS)}")
        if config.width % config.heads != 0:
            raise ValueError(f"CLIP width {config.width} is not divisible by heads={config.heads}")
        self.config = config
        self.layout = layout
        width, proj = config.width, config.projection_dim
        if layout == "hf":
            self.text_model = nn.Module()
            self.text_model.embeddings = nn.Module()
            self.text_model.embeddings.token_embedding = _embedding(config.vocab_size, width, dtype, device)
            self.text_model.embeddings.position_embedding = _embedding(config.max_positions, width, dtype,
                                                                       device)
            self.text_model.encoder = nn.Module()
            self.text_model.encoder.layers = nn.ModuleList(
                HFLayer(config, dtype, device) for _ in range(config.layers))
            self.text_model.final_layer_norm = _layer_norm(width, dtype, device)
            if proj is not None:
                self.text_projection = _linear(width, proj, dtype, device, bias=False)
        else:
            self.token_embedding = _embedding(config.vocab_size, width, dtype, device)
            self.positional_embedding = nn.Parameter(
                torch.empty(config.max_positions, width, dtype=dtype, device=device))
            self.transformer = nn.Module()
            self.transformer.resblocks = nn.ModuleList(
                OpenClipResBlock(config, dtype, device) for _ in range(config.layers))
            self.ln_final = _layer_norm(width, dtype, device)
            if proj is not None:
                self.text_projection = nn.Parameter(torch.empty(width, proj, dtype=dtype, device=device))

    # The two layouts name the same parts differently; these accessors hide that from the stages.

    def _token_embedding(self) -> nn.Embedding:
        return self.text_model.embeddings.token_embedding if self.layout == "hf" else self.token_embedding

    def _position_weight(self) -> torch.Tensor:
        if self.layout == "hf":
            return self.text_model.embeddings.position_embedding.weight
        return self.positional_embedding

    def _blocks(self) -> nn.ModuleList:
        return self.text_model.encoder.layers if self.layout == "hf" else self.transformer.resblocks

    def _final_norm(self) -> nn.LayerNorm:
        return self.text_model.final_layer_norm if self.layout == "hf" else self.ln_final

    def _project(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.config.projection_dim is None:
            return pooled
        if self.layout == "hf":
            return self.text_projection(pooled)
        return pooled @ self.text_projection  # (B, W) @ (W, P)

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding vectors of `tokens` [B, T] -> [B, T, W], for callers that override some positions."""
        return self._token_embedding()(tokens)

    def stages(self) -> list[Stage]:
        if self.layout == "hf":
            embedding_modules: tuple[nn.Module, ...] = (self.text_model.embeddings,)
            block_prefix = "layers"
            final_modules: tuple[nn.Module, ...] = (self.text_model.final_layer_norm,)
            if self.config.projection_dim is not None:
                final_modules += (self.text_projection,)
        else:
            embedding_modules = (self.token_embedding, _RootParameters(self, ("positional_embedding",)))
            block_prefix = "resblocks"
            final_modules = (self.ln_final,)
            if self.config.projection_dim is not None:
                final_modules += (_RootParameters(self, ("text_projection",)),)
        stages = [Stage("embeddings", embedding_modules, self._embed)]
        for index, block in enumerate(self._blocks()):
            stages.append(Stage(f"{block_prefix}.{index}", (block,), self._block_runner(index, block)))
        stages.append(Stage("final", final_modules, self._finish))
        return stages

    def _embed(self, state: State) -> State:
        tokens = state["tokens"]
        embeds = state["token_embeds"]
        if embeds is None:
            embeds = self._token_embedding()(tokens)
        length = tokens.shape[1]
        state["x"] = embeds.to(self._position_weight().dtype) + self._position_weight()[:length]  # (B, T, W)
        state["mask"] = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()  # causal
        return state

    def _block_runner(self, index: int, block: nn.Module) -> Callable[[State], State]:
        def run(state: State) -> State:
            if index > state["last_layer"]:
                return state  # nothing after this layer is read
            state["x"] = block(state["x"], state["mask"])
            if index == state["hidden_layer"]:
                state["hidden"] = state["x"]
            return state

        return run

    def _finish(self, state: State) -> State:
        norm = self._final_norm()
        hidden = state["hidden"]
        state["hidden"] = norm(hidden) if state["norm_hidden"] else hidden
        state["pooled"] = None
        if state["return_pooled"]:
            # Pooled output: the final-normed last layer at the end-of-text token, which has the largest
            # id (49407) of the vocabulary; argmax returns its first occurrence when padding repeats it.
            tokens = state["tokens"]
            last = norm(state["x"])
            eos_positions = tokens.argmax(dim=-1)
            pooled = last[torch.arange(tokens.shape[0], device=tokens.device), eos_positions]  # (B, W)
            state["pooled"] = self._project(pooled)
        return state

    def initial_state(self, tokens: torch.Tensor, clip_skip: int = 1, return_pooled: bool = False,
                      norm_hidden: bool = True, token_embeds: torch.Tensor | None = None) -> State:
        """The state the stages start from; see `forward` for the arguments."""
        layers = self.config.layers
        if not 1 <= clip_skip <= layers:
            raise ValueError(f"clip_skip {clip_skip} is out of range; accepted: 1 (last layer) to {layers}")
        if tokens.ndim != 2 or not 1 <= tokens.shape[1] <= self.config.max_positions:
            raise ValueError(f"tokens must be [batch, length <= {self.config.max_positions}], "
                             f"got shape {tuple(tokens.shape)}")
        if token_embeds is not None and token_embeds.shape != (*tokens.shape, self.config.width):
            raise ValueError(f"token_embeds must have shape {(*tokens.shape, self.config.width)}, "
                             f"got {tuple(token_embeds.shape)}")
        hidden_layer = layers - clip_skip
        return {"tokens": tokens, "token_embeds": token_embeds, "hidden_layer": hidden_layer,
                "last_layer": layers - 1 if return_pooled else hidden_layer, "norm_hidden": norm_hidden,
                "return_pooled": return_pooled}

    def forward(self, tokens: torch.Tensor, clip_skip: int = 1, return_pooled: bool = False,
                norm_hidden: bool = True, token_embeds: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encode `tokens` [B, T] -> (hidden [B, T, W], pooled [B, proj or W] or None).

        `clip_skip` picks the layer whose output is `hidden`: 1 = last, 2 = penultimate (ComfyUI's
        CLIPSetLastLayer -clip_skip). `norm_hidden` applies the final LayerNorm to it. `pooled` is the
        projected (when the checkpoint has a projection) end-of-text feature of the last layer.
        `token_embeds` [B, T, W] replaces the token embedding lookup (textual inversion).
        """
        state = run_stages(self.stages(), self.initial_state(tokens, clip_skip, return_pooled, norm_hidden,
                                                             token_embeds))
        return state["hidden"], state["pooled"]

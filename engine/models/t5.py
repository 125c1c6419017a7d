"""T5 v1.1 text encoder (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
Text-to-Text Transformer"; v1.1: gated-GELU feed-forward, no parameter sharing with a decoder), the
encoder half only, as FLUX.1 and SD3 read it: T5-XXL over SentencePiece tokens, no positional embedding,
a relative position bias added to the unscaled attention scores, RMS layer norms.

Parameter names are transformers' `T5EncoderModel` keys, which ComfyUI's `t5xxl_fp16.safetensors` and
`t5xxl_fp8_e4m3fn.safetensors` use: `shared.weight` (the token embedding; some files name it
`encoder.embed_tokens.weight`, some carry both), `encoder.block.N.layer.0.SelfAttention.{q,k,v,o}.weight`
(block 0 also `relative_attention_bias.weight`, [buckets, heads]),
`encoder.block.N.layer.0.layer_norm.weight`, `encoder.block.N.layer.1.DenseReluDense.{wi_0,wi_1,wo}.weight`,
`encoder.block.N.layer.1.layer_norm.weight` and `encoder.final_layer_norm.weight`. Files inside full
checkpoints put a prefix before them (`text_encoders.t5xxl.transformer.`); `t5_key_map` finds it and names
the file key of each parameter.

The forward pass is the stage list "embed", "encoder.block.N", "final_norm". Block 0 computes the relative
position bias (with the attention mask folded in) once and leaves it in the state; the other blocks reuse it.

Half precision: T5's residual stream grows past float16's range (65504) and its feed-forward output does
too (transformers keeps `wo` in float32 for that reason, `_keep_in_fp32_modules`; ComfyUI computes the
whole encoder in float32). Here the residual stream and the layer norms are float32 whatever the weights'
dtype; the projections run in the weights' dtype, except that with float16 weights the gated activation
and `wo` run in float32. The output is float32 (as ComfyUI's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.staged import Stage, StagedModel, State, run_stages
from engine.quant.modules import float_weight

FEED_FORWARD_PROJECTIONS = ("gated-gelu",)
EMBEDDING_KEYS = ("shared.weight", "encoder.embed_tokens.weight")  # the embedding's names, preferred first
_BLOCK_KEY = re.compile(r"^(?P<prefix>.*?)encoder\.block\.(?P<index>\d+)\.")
_FIRST_QUERY = "encoder.block.0.layer.0.SelfAttention.q.weight"


@dataclass(frozen=True)
class T5Config:
    vocab_size: int = 32128  # rows of the token embedding (32100 SentencePiece pieces, padded to 32128)
    d_model: int = 4096  # width of the residual stream
    d_kv: int = 64  # width of one attention head
    d_ff: int = 10240  # width of the gated feed-forward's hidden layer
    num_layers: int = 24  # encoder blocks
    num_heads: int = 64  # attention heads; heads * d_kv need not equal d_model
    relative_attention_num_buckets: int = 32  # buckets of relative distance, half for each direction
    relative_attention_max_distance: int = 128  # distance from which all distances share the last bucket
    feed_forward_proj: str = "gated-gelu"  # T5 v1.1: gelu_new(x W_0) * (x W_1), gelu_new = GELU's tanh form
    layer_norm_epsilon: float = 1e-6  # added to the mean square in the RMS norms


def t5_xxl_config() -> T5Config:
    """T5 v1.1 XXL's encoder (google/t5-v1_1-xxl), FLUX.1's and SD3's second text encoder."""
    return T5Config()


# ---------------------------------------------------------------------------------------------- keys


def t5_prefix(keys: Iterable[str]) -> str:
    """The prefix before `encoder.block.0.layer.0.SelfAttention.q.weight` in `keys` ("" in plain files)."""
    keys = list(keys)
    prefixes = sorted({key[: -len(_FIRST_QUERY)] for key in keys if key.endswith(_FIRST_QUERY)})
    if len(prefixes) == 1:
        return prefixes[0]
    if prefixes:
        raise ValueError(f"several T5 encoders in one file, under prefixes {prefixes}; pass the one to use")
    sample = ", ".join(sorted(keys)[:3]) or "none"
    raise KeyError(f"not a T5 encoder: no key '<prefix>{_FIRST_QUERY}' (keys start: {sample})")


def t5_key_map(keys: Iterable[str], prefix: str | None = None) -> dict[str, str]:
    """Our parameter name -> the file's key, for a T5 encoder whose tensors are named `keys`.

    `prefix` is found with `t5_prefix` when not given. `shared.weight` maps to the file's `shared.weight`,
    or to `encoder.embed_tokens.weight` where the file has only that. Keys of the file that the encoder
    does not read (a decoder, other models of a full checkpoint) are left out. Raises KeyError naming the
    first missing key.
    """
    keys = set(keys)
    prefix = t5_prefix(keys) if prefix is None else prefix
    embedding = _embedding_key(keys, prefix)
    mapping = {EMBEDDING_KEYS[0]: prefix + embedding}
    for name in _block_parameter_names(_layer_count(keys, prefix)):
        if prefix + name not in keys:
            raise KeyError(f"T5 encoder key {prefix + name!r} is missing")
        mapping[name] = prefix + name
    return mapping


def _layer_count(keys: Iterable[str], prefix: str) -> int:
    matches = (_BLOCK_KEY.match(key) for key in keys)
    indices = sorted({int(m["index"]) for m in matches if m and m["prefix"] == prefix})
    if not indices or indices != list(range(len(indices))):
        raise KeyError(f"T5 encoder blocks '{prefix}encoder.block.N' are not numbered 0..N-1: {indices}")
    return len(indices)


def _embedding_key(keys: set[str], prefix: str) -> str:
    """The file's name of the token embedding, without the prefix."""
    for name in EMBEDDING_KEYS:
        if prefix + name in keys:
            return name
    shared, embed_tokens = (prefix + name for name in EMBEDDING_KEYS)
    raise KeyError(f"T5 encoder key {shared!r} (or {embed_tokens!r}) is missing")


def _block_parameter_names(num_layers: int) -> list[str]:
    """The encoder's parameter names after the embedding, in order."""
    names = []
    for index in range(num_layers):
        block = f"encoder.block.{index}.layer."
        names += [f"{block}0.SelfAttention.{p}.weight" for p in ("q", "k", "v", "o")]
        if index == 0:
            names.append(f"{block}0.SelfAttention.relative_attention_bias.weight")
        names.append(f"{block}0.layer_norm.weight")
        names += [f"{block}1.DenseReluDense.{p}.weight" for p in ("wi_0", "wi_1", "wo")]
        names.append(f"{block}1.layer_norm.weight")
    return [*names, "encoder.final_layer_norm.weight"]


def t5_config_from_shapes(shapes: Mapping[str, tuple[int, ...]], prefix: str | None = None) -> T5Config:
    """The encoder's config from tensor names and shapes (HF layout, under `prefix`; found when None).

    Raises KeyError naming the first missing key, ValueError for a T5 v1.0 (ungated) feed-forward or a
    shape that does not fit the others.
    """
    prefix = t5_prefix(shapes) if prefix is None else prefix
    if prefix + "encoder.block.0.layer.1.DenseReluDense.wi.weight" in shapes:
        raise ValueError("T5 v1.0 feed-forward (DenseReluDense.wi) is not supported; accepted: "
                         f"{', '.join(FEED_FORWARD_PROJECTIONS)} (T5 v1.1: wi_0 and wi_1)")
    key_map = t5_key_map(shapes, prefix)
    block = prefix + "encoder.block.0.layer."
    vocab, width = shapes[key_map[EMBEDDING_KEYS[0]]]
    buckets, heads = shapes[block + "0.SelfAttention.relative_attention_bias.weight"]
    inner = shapes[block + "0.SelfAttention.q.weight"][0]
    d_ff = shapes[block + "1.DenseReluDense.wi_0.weight"][0]
    if inner % heads != 0:
        raise ValueError(f"T5 attention width {inner} ({block}0.SelfAttention.q.weight) is not divisible by "
                         f"{heads} heads (relative_attention_bias)")
    config = T5Config(vocab_size=vocab, d_model=width, d_kv=inner // heads, d_ff=d_ff,
                      num_layers=_layer_count(shapes, prefix), num_heads=heads,
                      relative_attention_num_buckets=buckets)
    for name, tensor in T5Encoder(config).state_dict().items():
        if tuple(shapes[key_map[name]]) != tuple(tensor.shape):
            raise ValueError(f"T5 encoder key {key_map[name]!r} has shape {tuple(shapes[key_map[name]])}, "
                             f"expected {tuple(tensor.shape)} from the other keys")
    return config


# ---------------------------------------------------------------------------------------------- layers


def relative_position_buckets(query_length: int, key_length: int, num_buckets: int, max_distance: int,
                              device: torch.device) -> torch.Tensor:
    """Bidirectional T5 buckets of (key - query) distances, (Lq, Lk) long (Mesh TensorFlow's rule).

    Half the buckets are for keys after the query; in each half, distances below half of it have a bucket
    each, larger ones share logarithmically wider buckets up to `max_distance`, beyond which all share one.
    """
    query = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
    key = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
    relative = key - query  # (Lq, Lk)
    half = num_buckets // 2
    buckets = (relative > 0).long() * half
    distance = relative.abs()
    max_exact = half // 2
    # Same operations, in the same order, as the reference, so that float rounding picks the same buckets.
    log_bucket = max_exact + (torch.log(distance.clamp(min=1).float() / max_exact)
                              / math.log(max_distance / max_exact) * (half - max_exact)).long()
    log_bucket = log_bucket.clamp(max=half - 1)
    return buckets + torch.where(distance < max_exact, distance, log_bucket)


class T5LayerNorm(nn.Module):
    """RMS norm without mean or bias (Zhang & Sennrich 2019), computed in float32: x / rms(x) * weight."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight.float()  # (B, T, W) float32


def _embedding(count: int, width: int, dtype: torch.dtype, device: torch.device | str) -> nn.Embedding:
    """An uninitialised table [count, width], bound from the checkpoint later (nn.Embedding's own random
    initialisation imports torch._dynamo: 1-2 s on a process's first load)."""
    return nn.Embedding(count, width, _weight=torch.empty(count, width, dtype=dtype, device=device))


def _linear(fan_in: int, fan_out: int, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    return nn.Linear(fan_in, fan_out, bias=False, dtype=dtype, device=device)


class T5SelfAttention(nn.Module):
    """Bidirectional attention without 1/sqrt(d) scaling; the position bias (+ mask) adds to the scores."""

    def __init__(self, config: T5Config, has_relative_bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        inner = config.num_heads * config.d_kv
        self.heads = config.num_heads
        self.q = _linear(config.d_model, inner, dtype, device)
        self.k = _linear(config.d_model, inner, dtype, device)
        self.v = _linear(config.d_model, inner, dtype, device)
        self.o = _linear(inner, config.d_model, dtype, device)
        if has_relative_bias:
            self.relative_attention_bias = _embedding(config.relative_attention_num_buckets, config.num_heads,
                                                      dtype, device)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (B, T, W) and bias (B or 1, heads, T, T) in the weights' dtype -> (B, T, W) in that dtype."""
        batch, length, _ = x.shape
        q, k, v = (p(x).view(batch, length, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # (B, heads, T, d_kv)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)  # (B, heads, T, d_kv)
        return self.o(out.transpose(1, 2).reshape(batch, length, -1))  # (B, T, W)


class T5GatedFeedForward(nn.Module):
    """gelu_new(x W_0) * (x W_1), then W_o; in float32 from the product on when the weights are float16."""

    def __init__(self, config: T5Config, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.wi_0 = _linear(config.d_model, config.d_ff, dtype, device)
        self.wi_1 = _linear(config.d_model, config.d_ff, dtype, device)
        self.wo = _linear(config.d_ff, config.d_model, dtype, device)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, linear = self.wi_0(x), self.wi_1(x)  # (B, T, d_ff)
        weight = getattr(self.wo, "weight", None)  # None once a row split has sharded W_o
        if self.dtype == torch.float16 and weight is not None:  # the product and W_o's output outgrow fp16
            hidden = F.gelu(gate.float(), approximate="tanh") * linear.float()
            return F.linear(hidden, float_weight(self.wo, torch.float32))  # (B, T, W) float32
        return self.wo(F.gelu(gate, approximate="tanh") * linear)  # (B, T, W)


class T5AttentionLayer(nn.Module):
    def __init__(self, config: T5Config, has_relative_bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.SelfAttention = T5SelfAttention(config, has_relative_bias, dtype, device)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, dtype, device)


class T5FeedForwardLayer(nn.Module):
    def __init__(self, config: T5Config, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.DenseReluDense = T5GatedFeedForward(config, dtype, device)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, dtype, device)


class T5Block(nn.Module):
    """Pre-norm block on a float32 residual stream: x + attn(norm(x)), then + ff(norm(x))."""

    def __init__(self, config: T5Config, has_relative_bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.layer = nn.ModuleList([T5AttentionLayer(config, has_relative_bias, dtype, device),
                                    T5FeedForwardLayer(config, dtype, device)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        attention, feed_forward = self.layer
        dtype = attention.layer_norm.weight.dtype  # the weights' (norms are never row-sharded)
        x = x + attention.SelfAttention(attention.layer_norm(x).to(dtype), bias).float()
        x = x + feed_forward.DenseReluDense(feed_forward.layer_norm(x).to(dtype)).float()
        return x  # (B, T, W) float32


# ---------------------------------------------------------------------------------------------- model


class T5Encoder(StagedModel):
    """T5 v1.1 encoder; see the module docstring for names, stages and precision."""

    def __init__(self, config: T5Config, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "meta"):
        super().__init__()
        if config.feed_forward_proj not in FEED_FORWARD_PROJECTIONS:
            raise ValueError(f"unknown T5 feed_forward_proj {config.feed_forward_proj!r}; accepted: "
                             f"{', '.join(FEED_FORWARD_PROJECTIONS)}")
        self.config = config
        self.shared = _embedding(config.vocab_size, config.d_model, dtype, device)
        self.encoder = nn.Module()
        self.encoder.block = nn.ModuleList(T5Block(config, index == 0, dtype, device)
                                           for index in range(config.num_layers))
        self.encoder.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, dtype, device)

    def _build_stages(self) -> list[Stage]:
        stages = [Stage("embed", (self.shared,), self._embed)]
        for index, block in enumerate(self.encoder.block):
            stages.append(Stage(f"encoder.block.{index}", (block,), self._block_runner(index, block)))
        stages.append(Stage("final_norm", (self.encoder.final_layer_norm,), self._final_norm))
        return stages

    def _embed(self, state: State) -> State:
        state["hidden"] = self.shared(state["tokens"]).float()  # (B, T, W) float32
        return state

    def _position_bias(self, block: T5Block, state: State) -> torch.Tensor:
        """(1 or B, heads, T, T) in the weights' dtype: the relative position bias, masked keys at its min."""
        attention = block.layer[0].SelfAttention
        length = state["tokens"].shape[1]
        config = self.config
        buckets = relative_position_buckets(length, length, config.relative_attention_num_buckets,
                                            config.relative_attention_max_distance, state["tokens"].device)
        bias = attention.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # (1, heads, T, T)
        dtype = attention.relative_attention_bias.weight.dtype
        bias = bias.to(dtype)
        mask = state["attention_mask"]
        if mask is not None:
            bias = bias.masked_fill(~mask[:, None, None, :], torch.finfo(dtype).min)  # (B, heads, T, T)
        return bias

    def _block_runner(self, index: int, block: T5Block) -> Callable[[State], State]:
        def run(state: State) -> State:
            if index == 0:
                state["position_bias"] = self._position_bias(block, state)
            state["hidden"] = block(state["hidden"], state["position_bias"])
            return state

        return run

    def _final_norm(self, state: State) -> State:
        state["hidden"] = self.encoder.final_layer_norm(state["hidden"])  # (B, T, W) float32
        state["position_bias"] = None
        return state

    def initial_state(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> State:
        """The state the stages start from; see `forward` for the arguments."""
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be [batch, length >= 1], got shape {tuple(tokens.shape)}")
        if attention_mask is not None:
            if attention_mask.shape != tokens.shape:
                raise ValueError(f"attention_mask must have the tokens' shape {tuple(tokens.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(device=tokens.device, dtype=torch.bool)
        return {"tokens": tokens, "attention_mask": attention_mask, "hidden": None, "position_bias": None}

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encode `tokens` [B, T] -> hidden [B, T, d_model] float32 (after the final norm).

        `attention_mask` [B, T] (1 or True = attend) hides keys from every query; FLUX in ComfyUI passes none
        (its padding is attended to).
        """
        return run_stages(self.stages(), self.initial_state(tokens, attention_mask))["hidden"]

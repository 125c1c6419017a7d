"""torch tensors to GGML tensor bytes, vectorised over blocks in PyTorch on the tensor's device.

The arithmetic is ggml's reference quantiser (ggml-quants.c `quantize_row_*_ref`) step by step in float32, as
gguf-py's `gguf.quants.quantize` performs it, so the bytes are identical to gguf's (tests/engine/quant check
this). Rounding: Q8_0 rounds half away from zero (C `roundf`); the other legacy types add 0.5 (Q4_1, Q5_1)
or 8.5 / 16.5 (Q4_0, Q5_0) and truncate, then clamp. The K types (gguf-py has no quantiser for them) are
engine.quant.kquants, and IQ4_NL / IQ4_XS engine.quant.iquants, both byte-identical to ggml's C reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from engine.quant import iquants, kquants
from engine.quant.types import GGML_TYPES, UnsupportedQuantTypeError, ggml_type

QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q6_K", "Q5_K", "Q4_K", "Q3_K",
               "Q2_K", "IQ4_NL", "IQ4_XS")


def quantize(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """`x` (any floating dtype and shape whose last dim is whole `qtype` blocks) as GGML `qtype` bytes:
    uint8 (rows, row_bytes), rows being the product of x's leading dims (1 for a scalar), on x's device."""
    t = ggml_type(qtype, accepted=QUANTIZABLE)
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        x = x.reshape(1)
    if x.shape[-1] % t.block_size:
        raise ValueError(f"cannot quantise a tensor of shape {tuple(x.shape)} to {t.name}: its last dim "
                         f"must be a multiple of {t.block_size}")
    values = x.reshape(-1, x.shape[-1]).to(torch.float32)
    if t.name == "F32":
        packed = values.contiguous().view(torch.uint8)
    elif t.name == "F16":
        packed = values.to(torch.float16).view(torch.uint8)
    elif t.name == "BF16":
        packed = _bf16_bits(values).view(torch.uint8)
    else:
        packed = QUANTIZERS[t.name](values.reshape(-1, t.block_size))
    return packed.reshape(values.shape[0], -1)


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 to bfloat16 as ggml_compute_fp32_to_bf16: round to nearest even; a NaN keeps its sign and top
    mantissa bits and becomes quiet (torch's own cast makes every NaN 0x7FC0)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    quiet_nan = ((bits & 0xFFFF0000) | (64 << 16)) >> 16
    return torch.where(is_nan, quiet_nan, rounded).to(torch.int32).to(torch.int16)


def _half_bytes(d: torch.Tensor) -> torch.Tensor:
    """float32 (n, 1) to its fp16 bytes (n, 2)."""
    return d.to(torch.float16).view(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, 0 where d is 0."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each block, with its sign (the first such value): (n, 1)."""
    return torch.gather(blocks, 1, blocks.abs().argmax(dim=1, keepdim=True))


def _min_max(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's first smallest and first largest value, (n, 1) each: ggml's loop keeps the first of equal
    values, which decides the sign of a zero (amin/amax pick a zero's sign by reduction order)."""
    return (torch.gather(blocks, 1, blocks.argmin(dim=1, keepdim=True)),
            torch.gather(blocks, 1, blocks.argmax(dim=1, keepdim=True)))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(n, 32) values below 16 (or 32: bit 4 is dropped) to 16 bytes: element i low, element i+16 high."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 values (n, 32) as 4 bytes, element i at bit i (little-endian uint32)."""
    bit = (q >> 4).reshape(-1, 4, 8).to(torch.int32) << torch.arange(8, device=q.device, dtype=torch.int32)
    return bit.sum(dim=-1).to(torch.uint8)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    scaled = blocks * _inverse(d)
    magnitude = scaled.abs()
    whole = magnitude.floor()
    q = torch.sign(scaled) * (whole + torch.floor(2 * (magnitude - whole)))  # roundf: half away from zero
    return torch.cat((_half_bytes(d), q.to(torch.int8).view(torch.uint8)), dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(blocks) / -8
    q = torch.trunc(blocks * _inverse(d) + 8.5).to(torch.uint8).clamp(0, 15)
    return torch.cat((_half_bytes(d), _pack_nibbles(q)), dim=1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    low, high = _min_max(blocks)
    d = (high - low) / 15
    q = torch.trunc((blocks - low) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 15)
    return torch.cat((_half_bytes(d), _half_bytes(low), _pack_nibbles(q)), dim=1)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(blocks) / -16
    q = torch.trunc(blocks * _inverse(d) + 16.5).to(torch.uint8).clamp(0, 31)
    return torch.cat((_half_bytes(d), _pack_high_bits(q), _pack_nibbles(q)), dim=1)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    low, high = _min_max(blocks)
    d = (high - low) / 31
    q = torch.trunc((blocks - low) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 31)
    return torch.cat((_half_bytes(d), _half_bytes(low), _pack_high_bits(q), _pack_nibbles(q)), dim=1)


QUANTIZERS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q6_K": kquants.quantize_q6_k,
    "Q5_K": kquants.quantize_q5_k,
    "Q4_K": kquants.quantize_q4_k,
    "Q3_K": kquants.quantize_q3_k,
    "Q2_K": kquants.quantize_q2_k,
    "IQ4_NL": iquants.quantize_iq4_nl,
    "IQ4_XS": iquants.quantize_iq4_xs,
}


# ---------------------------------------------------------------- which tensors to quantise (--type, rules)

# stable-diffusion.cpp's ModelLoader::tensor_should_be_converted: tensors never converted, by name
KEEP_SUFFIXES = (".bias", ".scale", ".weight_scale")
KEEP_SUBSTRINGS = (
    "img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.",  # FLUX
    "x_embedder.", "t_embedder.", "y_embedder.", "pos_embed", "context_embedder.",  # MMDiT (SD3)
    "time_embed.", "label_emb.",  # UNet
    "embedding",
)


def tensor_type_rules(type_name: str | None = None, rules: str = "") -> Callable[[str, tuple[int, ...]],
                                                                               str | None]:
    """stable-diffusion.cpp's `--type T` and `--tensor-type-rules "regex=type,..."` as a function of a
    tensor's key and torch shape giving the GGML type to convert it to, or None to keep it as stored.

    The first rule whose regex matches anywhere in the key (re.search, as sd.cpp's std::regex_search) gives
    the type, else `type_name`. Kept whatever the rules say, as in sd.cpp: rows that are not whole blocks of
    the type; keys ending in .bias, .scale, .weight_scale; FLUX's img_in./txt_in./time_in./vector_in./
    guidance_in./final_layer., MMDiT's x_/t_/y_embedder., pos_embed, context_embedder., the UNet's
    time_embed. and label_emb., and any key containing "embedding". Also kept (ComfyUI-GGUF's rule, not
    sd.cpp's): tensors of fewer than 2 dims, which are the norms' weights and scalars.
    Types are spelled as ggml does (q8_0, q4_K, f16, bf16, f32), in any case."""
    default = _writable_type(type_name, "--type") if type_name is not None else None
    parsed = _parse_rules(rules)

    def target(key: str, shape: tuple[int, ...]) -> str | None:
        chosen = next((rule_type for pattern, rule_type in parsed if pattern.search(key)), default)
        if chosen is None or len(shape) < 2 or shape[-1] % GGML_TYPES[chosen].block_size:
            return None
        if key.endswith(KEEP_SUFFIXES) or any(part in key for part in KEEP_SUBSTRINGS):
            return None
        return chosen

    return target


def _writable_type(name: str, where: str) -> str:
    try:
        return ggml_type(name, accepted=QUANTIZABLE).name
    except UnsupportedQuantTypeError as exc:
        raise UnsupportedQuantTypeError(f"{where}: {exc}") from None


def _parse_rules(rules: str) -> list[tuple[re.Pattern[str], str]]:
    parsed = []
    for item in rules.split(","):
        if not item:
            continue
        pattern, equals, name = item.rpartition("=")
        if not equals or not pattern:
            raise ValueError(f"--tensor-type-rules item {item!r} is not REGEX=TYPE "
                             f"(e.g. '^vae\\.=f16,attn=q8_0')")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"--tensor-type-rules item {item!r}: bad regex ({exc})") from None
        parsed.append((compiled, _writable_type(name, f"--tensor-type-rules item {item!r}")))
    return parsed

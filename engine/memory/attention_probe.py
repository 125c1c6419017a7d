"""Flash attention on/off/auto per module and device (reference/000, "Flash attention").

The models call PyTorch's SDPA; this module only decides which SDPA backends a module's run may use:
"on" leaves every backend allowed (PyTorch prefers its flash kernel where it applies), "off" allows every
backend except FLASH_ATTENTION. "auto" is decided once per compute device and dtype and cached:

- CPU: on without timing, if the flash kernel runs the probe shape at all (reference/000: auto enables the
  CPU without a benchmark);
- CUDA (and other GPUs): a probe over two self-attention shapes (512 tokens, head size 64; 1024 tokens,
  head size 128; four heads each) checks that flash matches ordinary (math) attention, warms both up, then
  alternates five synchronized measurements per shape (stopping new pairs after one second of measured
  time); flash is chosen when the sum of its median times is at least 5 % lower. Any failure selects off.
  The GPU decision is kept in the profile cache (profile_cache.py): a later process reads it instead of
  timing (a failed probe is not kept).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.memory import profile_cache

log = logging.getLogger("sluice.attention")

PROBE_SHAPES = ((512, 64), (1024, 128))  # (tokens, head size), four heads each
PROBE_HEADS = 4
MEASUREMENTS = 5
MIN_GAIN = 0.05  # flash must be at least 5 % faster (sum of medians)
MEASURE_LIMIT_S = 1.0
PROBE = "flash_attention"  # the profile cache's name for this probe's decision
PROBE_DETAILS = {"shapes": PROBE_SHAPES, "heads": PROBE_HEADS, "min_gain": MIN_GAIN}  # in its cache key
WITHOUT_FLASH = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

_decisions: dict[tuple[str, torch.dtype], bool] = {}
_lock = threading.Lock()


def _inputs(device: torch.device, dtype: torch.dtype, tokens: int, head_dim: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(tokens + head_dim)
    shape = (3, 1, PROBE_HEADS, tokens, head_dim)  # q, k, v of (B, heads, L, d)
    return torch.randn(shape, generator=generator).to(device, dtype)


def _run(qkv: torch.Tensor, backends: list[SDPBackend]) -> torch.Tensor:
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])


def _flash_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the flash kernel accepts the probe shapes and agrees with math attention."""
    for tokens, head_dim in PROBE_SHAPES:
        qkv = _inputs(device, dtype, tokens, head_dim)
        flash = _run(qkv, [SDPBackend.FLASH_ATTENTION]).float()
        ordinary = _run(qkv, [SDPBackend.MATH]).float()
        if not torch.allclose(flash, ordinary, atol=2e-2, rtol=2e-2):
            return False
    return True


def _timed(device: torch.device, work: Callable[[], torch.Tensor]) -> float:
    """Seconds one call of `work` takes on `device`, synchronized (CUDA events on CUDA)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    began = time.perf_counter()
    work()
    if device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter() - began


def interleaved_medians(device: torch.device, runs: Mapping[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds of each named run: one warm-up each, then MEASUREMENTS interleaved rounds (no new
    round once MEASURE_LIMIT_S of measured time has passed). Shared by the flash and convolution probes."""
    for work in runs.values():
        _timed(device, work)
    times: dict[str, list[float]] = {name: [] for name in runs}
    measured = 0.0
    for _ in range(MEASUREMENTS):
        if measured > MEASURE_LIMIT_S:
            break
        for name, work in runs.items():
            seconds = _timed(device, work)
            times[name].append(seconds)
            measured += seconds
    return {name: statistics.median(values) for name, values in times.items()}


def benchmark_flash(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(sum of flash medians, sum of ordinary medians) in seconds over the probe shapes."""
    flash_total = ordinary_total = 0.0
    for tokens, head_dim in PROBE_SHAPES:
        qkv = _inputs(device, dtype, tokens, head_dim)
        medians = interleaved_medians(device, {"flash": lambda t=qkv: _run(t, [SDPBackend.FLASH_ATTENTION]),
                                               "ordinary": lambda t=qkv: _run(t, [SDPBackend.MATH])})
        flash_total += medians["flash"]
        ordinary_total += medians["ordinary"]
    return flash_total, ordinary_total


def flash_attention_enabled(device: torch.device | str, mode: str = "auto",
                            dtype: torch.dtype = torch.float16) -> bool:
    """The decision for one module on `device`: on/off as given; auto probed once per device and dtype."""
    if mode not in ("on", "off", "auto"):
        raise ValueError(f"flash attention mode {mode!r}; accepted: on, off, auto")
    if mode != "auto":
        return mode == "on"
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else dtype
    key = (str(device), dtype)
    with _lock:
        if key in _decisions:
            return _decisions[key]
        timed = device.type != "cpu"
        cached = profile_cache.read_probe(PROBE, device, dtype, **PROBE_DETAILS) if timed else None
        if isinstance(cached, bool):
            enabled, reason = cached, "measured by an earlier process (profile cache)"
        else:
            try:
                enabled = _flash_runs(device, dtype)
                reason = ("the flash kernel runs the probe" if enabled
                          else "flash output differs from ordinary")
                if enabled and timed:
                    flash, ordinary = benchmark_flash(device, dtype)
                    enabled = flash <= (1 - MIN_GAIN) * ordinary
                    reason = (f"flash {flash * 1e3:.3f} ms vs ordinary {ordinary * 1e3:.3f} ms "
                              f"(sum of medians over {len(PROBE_SHAPES)} shapes)")
                if timed:
                    profile_cache.write_probe(PROBE, device, dtype, enabled, **PROBE_DETAILS)
            except (RuntimeError, NotImplementedError) as error:  # unsupported kernel, allocation failure
                enabled, reason = False, f"probe failed: {error}"  # not cached: it may pass next time
        _decisions[key] = enabled
    log.info("flash attention on %s (%s): %s; %s", device, dtype, "on" if enabled else "off", reason)
    return enabled


def attention_backends(enabled: bool) -> AbstractContextManager:
    """The SDPA context of a module run: every backend when flash is enabled, all but flash otherwise."""
    return nullcontext() if enabled else sdpa_kernel(WITHOUT_FLASH)


def clear_decisions() -> None:
    with _lock:
        _decisions.clear()

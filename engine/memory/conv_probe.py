"""Direct convolution on/off/auto per module and device (reference/000, "Direct convolution").

stable-diffusion.cpp's --conv-direct chooses GGML's implicit-GEMM convolution over im2col. PyTorch already
runs convolutions through cuDNN's implicit-GEMM kernels; what it leaves open is whether cuDNN autotunes
them (`torch.backends.cudnn.benchmark`: time every algorithm at a shape's first call, then keep the
fastest). That is this flag's PyTorch equivalent: "on" autotunes a module's convolutions, "off" uses cuDNN's
heuristics. Channels-last layouts are not used: the weights stream from NCHW arenas, and converting them on
every call would cost more than it saves.

"auto" is decided once per compute device and dtype and cached, as reference/000 describes: other devices
than CUDA default to off; on CUDA a probe over two convolution shapes (a UNet's 3x3 at 64x64 with 320
channels, a VAE decoder's 3x3 at 256x256 with 128) checks that both settings agree, warms both up (the
autotuning happens there), then alternates up to five synchronized measurements per shape (attention_probe's
`interleaved_medians`); autotuning is chosen when the sum of its median times is at least 5 % lower. Any
failure selects off. The decision is kept in the profile cache (profile_cache.py): a later process reads it
instead of timing (a failed probe is not kept).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from engine.memory import profile_cache
from engine.memory.attention_probe import interleaved_medians

log = logging.getLogger("sluice.conv")

PROBE_SHAPES = ((2, 320, 64), (1, 128, 256))  # (batch, channels, side) of a 3x3 convolution
MIN_GAIN = 0.05
PROBE = "conv_direct"  # the profile cache's name for this probe's decision
PROBE_DETAILS = {"shapes": PROBE_SHAPES, "min_gain": MIN_GAIN}  # in its cache key

_decisions: dict[tuple[str, torch.dtype], bool] = {}
_lock = threading.Lock()


@contextmanager
def conv_backends(enabled: bool | None) -> Iterator[None]:
    """cuDNN autotuning on (True) or off (False) for the calls inside; None leaves the setting alone."""
    if enabled is None:
        yield
        return
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


def conv_direct_enabled(device: torch.device | str, mode: str = "auto", dtype: torch.dtype = torch.float16
                        ) -> bool:
    """The decision for one module on `device`: on/off as given; auto probed once per CUDA device, dtype."""
    if mode not in ("on", "off", "auto"):
        raise ValueError(f"direct convolution mode {mode!r}; accepted: on, off, auto")
    if mode != "auto":
        return mode == "on"
    device = torch.device(device)
    if device.type != "cuda":
        return False  # reference/000: backends without an implicit-GEMM check default to off
    key = (str(device), dtype)
    with _lock:
        if key not in _decisions:
            cached = profile_cache.read_probe(PROBE, device, dtype, **PROBE_DETAILS)
            if isinstance(cached, bool):
                _decisions[key] = cached
                log.info("--conv-direct auto on %s (%s): %s (measured by an earlier process, profile cache)",
                         device, dtype, "on" if cached else "off")
                return cached
            try:
                tuned, heuristic = _benchmark(device, dtype)
                _decisions[key] = tuned <= (1 - MIN_GAIN) * heuristic
                log.info("--conv-direct auto on %s (%s): %s (autotuned %.3f ms vs heuristic %.3f ms)", device,
                         dtype, "on" if _decisions[key] else "off", tuned * 1e3, heuristic * 1e3)
                profile_cache.write_probe(PROBE, device, dtype, _decisions[key], **PROBE_DETAILS)
            except Exception as error:  # noqa: BLE001 - reference/000: a failed probe selects off
                log.info("--conv-direct auto on %s: probe failed (%s); off", device, error)
                _decisions[key] = False  # not cached: it may pass next time
        return _decisions[key]


def _benchmark(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(sum of median seconds with autotuning, without) over PROBE_SHAPES; raises if the outputs differ."""
    tuned_total = heuristic_total = 0.0
    for batch, channels, side in PROBE_SHAPES:
        generator = torch.Generator().manual_seed(channels + side)
        x = torch.randn(batch, channels, side, side, generator=generator).to(device, dtype)
        weight = (torch.randn(channels, channels, 3, 3, generator=generator) / (9 * channels) ** 0.5
                  ).to(device, dtype)

        def conv(tuned: bool, x: torch.Tensor = x, weight: torch.Tensor = weight) -> torch.Tensor:
            with conv_backends(tuned):  # the first autotuned call of a shape times every algorithm
                return F.conv2d(x, weight, padding=1)

        if not torch.allclose(conv(True).float(), conv(False).float(), atol=2e-2, rtol=2e-2):
            raise RuntimeError("autotuned and heuristic convolutions disagree")
        medians = interleaved_medians(device, {"tuned": lambda: conv(True), "heuristic": lambda: conv(False)})
        tuned_total += medians["tuned"]
        heuristic_total += medians["heuristic"]
    return tuned_total, heuristic_total


def clear_decisions() -> None:
    with _lock:
        _decisions.clear()

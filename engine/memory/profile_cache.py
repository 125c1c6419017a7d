"""Measured probes and stage profiles kept on disk, so that a new process plans and runs like a warm one.

What a process measures on its first calls, and keeps here (issue 21, "the first image fast"):

- attention_probe.py: whether flash attention is at least 5% faster, per GPU and dtype (timed SDPA calls);
- conv_probe.py: whether cuDNN autotuning is at least 5% faster, per CUDA device and dtype;
- stream_model.py: the pinned host-to-device copy rate of a CUDA device;
- segments.py: a module's stage profile per input shape, what its timed eager calls measure (two on CUDA,
  one elsewhere): the workspace bytes, and each stage's seconds and workspace peak. With a cached profile a
  shape's first call is planned as the first untimed call would be, no call is timed, and on CUDA the
  second call can already be captured as a graph.

Each entry is one JSON file, `DIR/KIND/HASH.json`, holding its key and its value; HASH is the SHA-256 of
the key. A key names what the measurement depends on: the device (`device_identity`: its name and total
memory, the torch, CUDA and driver versions) and, for a stage profile, the model (`model_identity`: its
stage names with their parameters' shapes and dtypes), the input shapes and the SDPA and cuDNN settings of
the call. Files are written under a temporary name and renamed, so a reader never sees half a file. A file
that cannot be read or parsed, whose key differs or whose value does not fit is ignored with a warning,
and a failed write is a warning: the cache never fails a run.

The folder comes from engine/settings.py's `cache_dir` (`SLUICE_CACHE`, the settings file's `cache_dir`,
else ~/.cache/sluice); `SLUICE_CACHE=off` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.settings import SettingsError, cache_dir

if TYPE_CHECKING:
    from engine.models.staged import Stage

log = logging.getLogger("sluice.cache")

FORMAT = 1  # part of every key: bump it when a value's meaning changes
MAX_ENTRY_CHARS = 16 * 1024 * 1024  # a stage profile of the largest model is a few hundred KiB

_identities: dict[str, dict[str, Any]] = {}  # str(device) -> device_identity


class ProfileCache:
    """JSON entries under `directory` (None: the cache is off, every lookup misses, nothing is written)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._warned: set[str] = set()  # files (or the folder) already warned about, once each
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def path(self, kind: str, key: Mapping[str, Any]) -> Path:
        if self.directory is None:
            raise ValueError("the profile cache is off; it has no files")
        digest = hashlib.sha256(_canonical(key).encode()).hexdigest()
        return self.directory / kind / f"{digest}.json"

    def get(self, kind: str, key: Mapping[str, Any]) -> Any | None:
        """The value stored for `key`, or None (off, absent, unreadable, or stored under another key)."""
        if self.directory is None:
            return None
        path = self.path(kind, key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            self.warn(path, f"cannot read {path} ({error}); measuring instead")
            return None
        try:  # the cache's own files: json.loads (10x faster than load_json's checks), within a size limit
            if len(text) > MAX_ENTRY_CHARS:
                raise ValueError(f"{len(text)} characters, over the {MAX_ENTRY_CHARS} an entry may have")
            entry = json.loads(text)
        except (ValueError, RecursionError) as error:
            self.warn(path, f"{path} is not valid JSON ({error}); measuring instead")
            return None
        if not isinstance(entry, dict) or "value" not in entry or entry.get("key") != _as_stored(key):
            self.warn(path, f"{path} does not hold an entry for its key; measuring instead")
            return None
        return entry["value"]

    def put(self, kind: str, key: Mapping[str, Any], value: Any) -> None:
        """Store `value` (JSON-serialisable) for `key`: written to a temporary file, then renamed."""
        if self.directory is None:
            return
        path = self.path(kind, key)
        text = json.dumps({"key": _as_stored(key), "value": value}, indent=1) + "\n"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                    file.write(text)
                os.replace(temporary, path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as error:
            self.warn(str(self.directory), f"cannot write to the profile cache {self.directory} ({error}); "
                                            f"measured profiles are not kept")

    def warn(self, what: str | Path, message: str) -> None:
        """Log `message` as a warning, once per file (or folder) `what`."""
        with self._lock:
            if str(what) in self._warned:
                return
            self._warned.add(str(what))
        log.warning("profile cache: %s", message)


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def _as_stored(key: Mapping[str, Any]) -> Any:
    """`key` as it reads back from a file (tuples become lists)."""
    return json.loads(_canonical(key))


# ------------------------------------------------------------------------------------------ the process cache

_default: ProfileCache | None = None
_default_lock = threading.Lock()


def default_cache() -> ProfileCache:
    """The process's cache, in the folder engine/settings.py's `cache_dir` names (resolved on first use; a bad
    settings file turns it off with a warning)."""
    global _default
    with _default_lock:
        if _default is None:
            try:
                _default = ProfileCache(cache_dir())
            except SettingsError as error:
                log.warning("profile cache off: %s", error)
                _default = ProfileCache(None)
        return _default


def set_default_cache(cache: ProfileCache | None) -> ProfileCache | None:
    """Replace the process's cache (tests, benchmarks that must measure); None resolves it again on next
    use. Returns the previous one."""
    global _default
    with _default_lock:
        previous, _default = _default, cache
        return previous


# ------------------------------------------------------------------------------------------ keys

def device_identity(device: torch.device | str) -> dict[str, Any]:
    """What a measurement on `device` depends on beyond the model: the device's name and total memory, and
    the torch, CUDA (or HIP) and driver versions. Read once per device and process."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = str(device)
    if name not in _identities:
        identity: dict[str, Any] = {"type": device.type, "torch": torch.__version__}
        if device.type == "cuda":
            properties = torch.cuda.get_device_properties(device)
            identity.update(name=properties.name, total_memory=properties.total_memory,
                            capability=f"{properties.major}.{properties.minor}",
                            cuda=torch.version.cuda, hip=torch.version.hip, driver=_driver_version())
        elif device.type == "cpu":
            import psutil

            identity.update(name=platform.processor() or platform.machine(), cores=os.cpu_count(),
                            threads=torch.get_num_threads(), total_memory=psutil.virtual_memory().total)
        _identities[name] = identity
    return dict(_identities[name])


def _driver_version() -> str:
    """The NVIDIA kernel driver's version (e.g. 570.124.06), else CUDA's driver API version, else
    'unknown'."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        import ctypes

        version = ctypes.c_int()
        library = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
        if library.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"cuda api {version.value}"
    except (OSError, AttributeError):
        pass
    return "unknown"


def model_identity(stages: Sequence[Stage]) -> str:
    """A hash of the stages' names and their modules' parameter and buffer names, shapes and dtypes: the
    same for every checkpoint of one architecture and dtype."""
    digest = hashlib.sha256()
    for stage in stages:
        digest.update(f"stage {stage.name}\n".encode())
        for module in stage.modules:
            for name, tensor in (*module.named_parameters(), *module.named_buffers()):
                digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
    return digest.hexdigest()


def backend_settings() -> dict[str, bool]:
    """The SDPA backends and cuDNN autotuning in force now (the runtime sets them around a module's run):
    they change a call's kernels, so its times and workspace."""
    cuda = torch.backends.cuda
    return {"flash_sdp": cuda.flash_sdp_enabled(), "mem_efficient_sdp": cuda.mem_efficient_sdp_enabled(),
            "math_sdp": cuda.math_sdp_enabled(), "cudnn_sdp": cuda.cudnn_sdp_enabled(),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}


def probe_key(probe: str, device: torch.device | str, dtype: torch.dtype, **details: Any) -> dict[str, Any]:
    """The key of a probe's result on `device` for `dtype`; `details` are the probe's own settings (its
    shapes, its threshold), so that changing them measures again."""
    return {"format": FORMAT, "probe": probe, "device": device_identity(device), "dtype": str(dtype),
            **{name: repr(value) for name, value in details.items()}}


# ------------------------------------------------------------------------------------------ stage profiles

STAGE_PROFILE = "stage_profile"


@dataclass(frozen=True)
class CachedProfile:
    """What a module's timed calls of one input shape measured (segments.py's `_workspace`, `_seconds` and
    `profile.workspace`)."""

    workspace: int  # bytes the plan reserves for the call's workspace
    seconds: list[float]  # per stage
    peaks: list[int]  # per stage: workspace bytes at its peak
    pool_excess: int = 0  # bytes its CUDA graph's pool reserved beyond the plan's workspace (segments.py)


def stage_profile_key(device: torch.device, stages: Sequence[Stage], signature: tuple, timed_calls: int
                      ) -> dict[str, Any]:
    return {"format": FORMAT, "device": device_identity(device), "model": model_identity(stages),
            "stages": len(stages), "inputs": repr(signature), "backends": backend_settings(),
            "timed_calls": timed_calls}


def read_stage_profile(cache: ProfileCache, key: Mapping[str, Any]) -> CachedProfile | None:
    """The profile stored for `key`, or None; a stored value of the wrong form is ignored with a warning."""
    value = cache.get(STAGE_PROFILE, key)
    if value is None:
        return None
    count = key["stages"]
    try:
        profile = CachedProfile(int(value["workspace"]), [float(s) for s in value["seconds"]],
                                [int(p) for p in value["peaks"]], int(value.get("pool_excess", 0)))
        if (len(profile.seconds) != count or len(profile.peaks) != count or profile.workspace < 0
                or profile.pool_excess < 0):
            raise ValueError(f"{len(profile.seconds)} times, {len(profile.peaks)} peaks, workspace "
                             f"{profile.workspace} for {count} stages")
    except (KeyError, TypeError, ValueError) as error:
        path = cache.path(STAGE_PROFILE, key)
        cache.warn(path, f"{path} holds no stage profile ({error}); measuring instead")
        return None
    return profile


def write_stage_profile(cache: ProfileCache, key: Mapping[str, Any], profile: CachedProfile) -> None:
    cache.put(STAGE_PROFILE, key, {"workspace": profile.workspace, "seconds": profile.seconds,
                                   "peaks": profile.peaks, "pool_excess": profile.pool_excess})


# ------------------------------------------------------------------------------------------ probes

PROBE = "probe"


def read_probe(probe: str, device: torch.device, dtype: torch.dtype, **details: Any) -> Any | None:
    """The process cache's result of `probe` on `device` for `dtype` (see `probe_key`), or None."""
    cache = default_cache()
    if not cache.enabled:
        return None
    return cache.get(PROBE, probe_key(probe, device, dtype, **details))


def write_probe(probe: str, device: torch.device, dtype: torch.dtype, value: Any, **details: Any) -> None:
    cache = default_cache()
    if cache.enabled:
        cache.put(PROBE, probe_key(probe, device, dtype, **details), value)

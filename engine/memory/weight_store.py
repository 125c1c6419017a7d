"""The weight store: each parameter's home, its compute-device replica, pinning and eviction.

Homes (reference/000, "Runtime backend vs. parameter backend"):
- "device": the tensor lives on the compute device for good (tracked in the device ledger at load);
- "cpu": the tensor lives in RAM, page-locked in the background after load when the compute device is
  CUDA (`_pin_in_background`). A model's cpu-home weights share one host arena in the order their stages
  read them (registration order for other models), each at an ALIGN-byte boundary, so the weights of
  consecutive stages are one contiguous span that a segment runner copies in a single transfer
  (`host_span`);
- "disk": nothing is kept; each copy re-reads the tensor from a source (e.g. a safetensors reader),
  through a reusable pinned staging buffer on CUDA.

A replica is the compute-device copy of a cpu or disk weight. Replicas stay resident across calls while
they fit; `evict_until_fits` makes room in the order of reference/001: idle workspaces first, then
segment weights from the last segment backward, then the least recently used. Pinned replicas are never
evicted. Every copy publishes a "transfer" event (direction h2d = RAM to the compute device, disk2h =
file to RAM; `seconds` is host time, which for an asynchronous CUDA copy is the time to enqueue it) and
every eviction an "eviction" event.

Models are built on the `meta` device; `register_model` records for each parameter the module that
owns it, and `bind_stage_weights` / `unbind_stage_weights` swap the owner's `_parameters` entry between
the replica and a meta placeholder, so a stage computes on store-owned tensors. A replica stays bound
until it is evicted, so a module whose weights stay resident runs with no per-call binding work; tensors
that are valid only while a segment computes (a segment runner's stream buffer) are assigned into the
places that `places` lists, which get their resting parameter back after. Parameter objects are made once
per tensor and reused. Keys are `"<module>/<parameter name>"`; the source is called with the parameter
name (the checkpoint key).
RAM held by cpu homes is not tracked by a ledger here; only compute-device memory is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from engine import telemetry
from engine.devices import device_name
from engine.memory.file_reads import FileSpan, read_spans
from engine.memory.ledger import DeviceLedger
from engine.models.staged import Stage, StagedModel

log = logging.getLogger("sluice.memory")
Source = Callable[[str], torch.Tensor]  # checkpoint key -> tensor, e.g. safe_open(path, "pt").get_tensor
HOMES = ("device", "cpu", "disk")
ALIGN = 256  # bytes: the arena and stream-buffer offset of every weight, enough for any dtype's alignment


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _arena_offsets(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> byte offset in the model's arena: in the order the stages read them (a stage's norm
    beside the projection it feeds, so a run of stages is one span), then the parameters no stage reads."""
    ordered: dict[int, nn.Parameter] = {}
    for stage in model.stages() if isinstance(model, StagedModel) else []:
        ordered.update((id(p), p) for p in stage.parameters())
    ordered.update((id(p), p) for p in model.parameters() if id(p) not in ordered)
    offsets, cursor = {}, 0
    for key, parameter in ordered.items():
        offsets[key] = cursor
        cursor += aligned(parameter.numel() * parameter.element_size())
    return offsets


class WeightStoreError(ValueError):
    """A weight that is unknown to the store, or a source tensor that does not match its parameter."""


@dataclass(eq=False)
class _Weight:
    key: str  # "<module>/<name>"
    module: str  # memory-runtime module: diffusion, te, vae, ...
    name: str  # parameter name in the model = checkpoint key given to the source
    places: list[tuple[nn.Module, str]]  # (module, attribute) whose _parameters entry is this weight
    home: str  # "device", "cpu" or "disk"
    device: torch.device  # compute device
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    order: int  # registration order, a stable tie-breaker
    home_tensor: torch.Tensor | None = None  # device home: on the device; cpu home: in (pinned) RAM
    host_offset: int | None = None  # cpu home: byte offset in the model's host arena
    source: Source | None = None  # disk home
    replica: torch.Tensor | None = None  # compute-device copy of a cpu or disk home
    replica_parameter: nn.Parameter | None = None
    resting: nn.Parameter | None = None  # what the owners hold when nothing is bound: home tensor or meta
    pins: int = 0
    group: _Group | None = None  # replica: the weights sharing its device buffer
    segment: int | None = None  # index in the current segment plan, None when not in one
    last_used: int = 0
    bound: bool = False  # the owner's parameter currently is the replica


@dataclass(eq=False)
class _Group:
    """Replicas copied together into one device buffer: they leave the device together."""

    members: list[_Weight]


class _HostPin:
    """Page-locks a host tensor in a background thread with cudaHostRegister, and unlocks it on release."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.registered = False
        self._thread = threading.Thread(target=self._register, name="sluice-pin", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        if self.tensor.numel() == 0:
            return
        code = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), 0)
        self.registered = int(code) == 0
        if not self.registered:
            log.warning("could not page-lock %.1f MiB of weights in RAM (CUDA error %s): their copies to the "
                        "GPU stay synchronous", self.tensor.numel() / 2**20, int(code))

    def wait(self) -> None:
        self._thread.join()

    def release(self) -> None:
        self.wait()
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False


@dataclass
class _Staging:
    buffer: torch.Tensor  # pinned uint8
    event: torch.cuda.Event | None = None  # recorded after the last copy out of the buffer


class WeightStore:
    def __init__(
        self, ledgers: Mapping[str, DeviceLedger] | DeviceLedger, bus: telemetry.EventBus | None = None
    ) -> None:
        """`ledgers` maps device names (cpu, cuda0, ...) to their ledgers; a single ledger is one device."""
        self.ledgers = {ledgers.device_name: ledgers} if isinstance(ledgers, DeviceLedger) else dict(ledgers)
        self.bus = bus or telemetry.bus
        self._weights: dict[str, _Weight] = {}
        self._key_of: dict[tuple[int, str], str] = {}  # (id(owner module), attribute) -> key
        self._staging: dict[torch.device, list[_Staging]] = {}
        # id()s of a stage's modules -> (the modules, kept so the ids stay theirs, and the stage's keys)
        self._stage_keys: dict[tuple[int, ...], tuple[tuple[nn.Module, ...], list[str]]] = {}
        self._arenas: dict[str, torch.Tensor] = {}  # module -> its cpu-home weights' host arena (uint8)
        self._pins_pending: dict[str, _HostPin] = {}  # module -> the page-locking of its arena (CUDA)
        self._offloaded: dict[str, int] = {}  # module -> bytes of its cpu and disk homes
        self._replicas: dict[str, int] = {}  # module -> bytes of its replicas now
        self.copies = 0  # counts replica groups copied in (a captured call must copy none)
        self._pins = 0  # pins held now, over every weight
        self._evictable_cache: tuple[tuple, list[_Weight]] | None = None  # (state it was found in, replicas)
        self._clock = 0
        self.generation = 0  # counts evictions: a runner whose weights were all bound at generation g
        # knows they still are while the generation is g

    def ledger(self, device: torch.device | str) -> DeviceLedger:
        name = device_name(device)
        if name not in self.ledgers:
            raise WeightStoreError(f"no ledger for device {name!r}; the store has: {', '.join(self.ledgers)}")
        return self.ledgers[name]

    def register_model(
        self, module: str, model: nn.Module, home: str, device: torch.device | str, source: Source
    ) -> list[str]:
        """Give every parameter of `model` a home and return their keys (in model order).

        `device` is the compute device. "device" and "cpu" homes read `source` once now; "disk" keeps only
        `source`. Parameters not on the device afterwards are meta placeholders until a stage binds them.
        A parameter shared by several modules (tied weights) is one weight under its first name. On any
        error nothing of `model` stays registered.
        """
        if home not in HOMES:
            raise WeightStoreError(f"unknown weight home {home!r}; accepted: {', '.join(HOMES)}")
        device = torch.device(device)
        keys: list[str] = []
        key_of_parameter: dict[int, str] = {}
        originals: list[tuple[nn.Module, str, nn.Parameter]] = []
        arena = self._new_arena(model, device, home) if home in ("cpu", "device") else None
        offsets = _arena_offsets(model)
        spans: list[tuple[torch.Tensor, FileSpan]] = []  # homes whose bytes are read from the file at the end
        try:
            for owner_name, owner in model.named_modules():
                for attribute, parameter in list(owner._parameters.items()):
                    if parameter is None:
                        continue
                    originals.append((owner, attribute, parameter))
                    key = key_of_parameter.get(id(parameter))
                    if key is None:
                        name = f"{owner_name}.{attribute}" if owner_name else attribute
                        slot = None if arena is None else (arena, offsets[id(parameter)])
                        key = self._add(module, name, owner, attribute, parameter, home, device, source, slot,
                                        spans)
                        key_of_parameter[id(parameter)] = key
                        keys.append(key)
                    else:
                        self._weights[key].places.append((owner, attribute))
                    self._key_of[(id(owner), attribute)] = key
                    owner._parameters[attribute] = self._resting_parameter(self._weights[key])
            read_spans(spans)
        except BaseException:
            for owner, attribute, parameter in originals:
                owner._parameters[attribute] = parameter
                self._key_of.pop((id(owner), attribute), None)
            for key in keys:
                del self._weights[key]
                if home == "device":
                    self.ledger(device).release(module, "weights", key)
            raise
        if arena is not None and home == "cpu":
            self._arenas[module] = arena
            if device.type == "cuda":
                self._pin_in_background(module, arena)
        if home != "device":
            self._offloaded[module] = self._offloaded.get(module, 0) + sum(self.nbytes(k) for k in keys)
        return keys

    def missing_bytes(self, module: str) -> int:
        """Bytes of `module`'s cpu and disk weights that have no replica on the device now (O(1))."""
        return self._offloaded.get(module, 0) - self._replicas.get(module, 0)

    def replica_bytes(self, module: str) -> int:
        """Bytes of `module`'s replicas on the device now (O(1))."""
        return self._replicas.get(module, 0)

    @staticmethod
    def _new_arena(model: nn.Module, device: torch.device, home: str) -> torch.Tensor:
        """One buffer for every distinct parameter of `model`: on the device for a device home, else in RAM
        (pinned after registration when the compute device is CUDA: `_pin_in_background`). One allocation:
        the caching allocators would round each tensor up (the host one to a power of two, the device one by
        up to a megabyte)."""
        unique = {id(p): p for p in model.parameters()}.values()
        total = sum(aligned(p.numel() * p.element_size()) for p in unique)
        if home == "device":
            return torch.empty(total, dtype=torch.uint8, device=device)
        return torch.empty(total, dtype=torch.uint8)

    def _pin_in_background(self, module: str, arena: torch.Tensor) -> None:
        """Page-lock a cpu-home arena in a background thread (cudaHostRegister, its exact size). Pinning took
        4 s for SDXL's text encoders at a 1 GiB budget on the H200 (torch's pinned allocator rounding 1.4 GB
        up to 2 GB), which the first image then does not wait for: until it is done, copies out of the arena
        are synchronous (correct, slower), and a CUDA graph capture waits for it (`wait_pinned`), since a
        graph may not copy from pageable memory."""
        pin = _HostPin(arena)
        self._pins_pending[module] = pin
        weakref.finalize(self, pin.release).atexit = False  # at exit the process's pages go anyway

    def wait_pinned(self, module: str | None = None) -> None:
        """Wait until the arenas of `module` (of every module when None) are page-locked, or failed to be."""
        pending = [self._pins_pending[module]] if module in self._pins_pending else (
            list(self._pins_pending.values()) if module is None else [])
        for pin in pending:
            pin.wait()

    def _add(
        self,
        module: str,
        name: str,
        owner: nn.Module,
        attribute: str,
        parameter: nn.Parameter,
        home: str,
        device: torch.device,
        source: Source,
        slot: tuple[torch.Tensor, int] | None = None,
        spans: list[tuple[torch.Tensor, FileSpan]] | None = None,
    ) -> str:
        """Register one weight; a device or cpu home is filled now from `source`, or, when the source tells
        where the tensor lies in its file and `spans` is given, appended to `spans` to be read with the
        others (file_reads.read_spans)."""
        key = f"{module}/{name}"
        if key in self._weights:
            raise WeightStoreError(f"weight {key!r} is already registered")
        nbytes = parameter.numel() * parameter.element_size()
        weight = _Weight(
            key,
            module,
            name,
            [(owner, attribute)],
            home,
            device,
            parameter.shape,
            parameter.dtype,
            nbytes,
            len(self._weights),
        )
        if home == "device":
            self.ledger(device).allocate(module, "weights", key, nbytes)
            try:
                arena, offset = slot
                weight.home_tensor = _typed_view(arena, offset, weight.dtype, weight.shape)
                self._fill(weight, source, spans)
            except BaseException:
                self.ledger(device).release(module, "weights", key)
                raise
        elif home == "cpu":
            arena, offset = slot
            weight.home_tensor = _typed_view(arena, offset, weight.dtype, weight.shape)
            self._fill(weight, source, spans)
            weight.host_offset = offset
        else:
            weight.source = source
        weight.resting = self._resting_parameter(weight)
        self._weights[key] = weight
        return key

    def stage_keys(self, stage: Stage) -> list[str]:
        """Keys of the parameters `stage` reads, in module order, each once."""
        cached = self._stage_keys.get(tuple(map(id, stage.modules)))
        if cached is not None and cached[0] == stage.modules:
            return list(cached[1])
        keys: dict[str, None] = {}
        for top in stage.modules:
            for owner in top.modules():
                for attribute, parameter in owner._parameters.items():
                    if parameter is None:
                        continue
                    key = self._key_of.get((id(owner), attribute))
                    if key is None:
                        raise WeightStoreError(
                            f"parameter {attribute!r} of {type(owner).__name__} in stage "
                            f"{stage.name!r} is not registered in the weight store"
                        )
                    keys[key] = None
        self._stage_keys[tuple(map(id, stage.modules))] = (stage.modules, list(keys))
        return list(keys)

    def _weight(self, key: str) -> _Weight:
        if key not in self._weights:
            raise WeightStoreError(f"unknown weight key {key!r}; keys look like '<module>/<parameter name>'")
        return self._weights[key]

    def nbytes(self, key: str) -> int:
        return self._weight(key).nbytes

    def home(self, key: str) -> str:
        return self._weight(key).home

    def module_of(self, key: str) -> str:
        return self._weight(key).module

    def host_span(self, key: str) -> tuple[torch.Tensor, int] | None:
        """(host arena, byte offset) of a cpu-home weight; None for device and disk homes."""
        weight = self._weight(key)
        if weight.host_offset is None:
            return None
        return self._arenas[weight.module], weight.host_offset

    def read_host(self, key: str) -> torch.Tensor:
        """The weight's host tensor: the cpu home itself, or a fresh read of a disk home (a disk2h event)."""
        weight = self._weight(key)
        if weight.home == "disk":
            return self._read(weight, weight.source)
        if weight.home == "cpu":
            return weight.home_tensor
        raise WeightStoreError(f"weight {key!r} lives on the device; it has no host copy")

    def layout(self, key: str) -> tuple[torch.dtype, torch.Size, int]:
        """(dtype, shape, bytes) of a weight."""
        weight = self._weight(key)
        return weight.dtype, weight.shape, weight.nbytes

    def is_bound(self, key: str) -> bool:
        """Whether the owners hold the device tensor now (device home, or a bound replica)."""
        weight = self._weight(key)
        return weight.home == "device" or weight.bound

    def places(self, key: str) -> list[tuple[dict, str, nn.Parameter]]:
        """(owner's `_parameters`, attribute, resting parameter) of every place of a weight: a runner binds a
        tensor valid for one segment by assigning there, and puts the resting parameter back after."""
        weight = self._weight(key)
        return [(owner._parameters, attribute, weight.resting) for owner, attribute in weight.places]

    def is_resident(self, key: str) -> bool:
        """Whether the weight is on its compute device now (device home, or a replica)."""
        weight = self._weight(key)
        return weight.home == "device" or weight.replica is not None

    def set_segments(self, segment_of_key: Mapping[str, int | None]) -> None:
        """Record each key's segment index in the current plan (the eviction order reads it); None = in no
        resident segment of it (evicted least recently used first)."""
        for key, index in segment_of_key.items():
            self._weight(key).segment = index

    def evictable_bytes(self, device: torch.device | str) -> int:
        """Bytes eviction could free on `device` now: unpinned replicas and idle workspaces."""
        device = torch.device(device)
        ledger = self.ledger(device)
        replicas = sum(w.nbytes for w in self._evictable_weights(device))
        return replicas + sum(nbytes for _, _, nbytes in ledger.idle_workspaces())

    def acquire(
        self, keys: Iterable[str], device: torch.device | str, stream: torch.cuda.Stream | None = None
    ) -> dict[str, torch.Tensor]:
        """Compute-device tensors for `keys`, copying what is missing (asynchronously on `stream` on CUDA).

        Room is made by eviction first; a copy that still does not fit raises BudgetExceeded before torch
        allocates anything.
        """
        device = torch.device(device)
        weights = [self._weight(key) for key in dict.fromkeys(keys)]
        for weight in weights:
            if weight.device != device:
                raise WeightStoreError(f"weight {weight.key!r} computes on {weight.device}, not on {device}")
            self._clock += 1
            weight.last_used = self._clock
        missing = [w for w in weights if w.home != "device" and w.replica is None]
        ledger = self.ledger(device)
        needed = sum(w.nbytes for w in missing)
        if missing and not ledger.would_fit(needed):
            self.evict_until_fits(needed, device, protect={w.key for w in weights})
        allocated: list[_Weight] = []
        try:
            for weight in missing:
                ledger.allocate(weight.module, "weights", weight.key, weight.nbytes)
                allocated.append(weight)
            if missing:
                self._copy_group(missing, device, stream)
        except BaseException:
            for weight in allocated:
                ledger.release(weight.module, "weights", weight.key)
                if weight.replica is not None:
                    self._replicas[weight.module] -= weight.nbytes
                weight.replica = weight.replica_parameter = weight.group = None
            raise
        return {w.key: w.home_tensor if w.home == "device" else w.replica for w in weights}

    def _copy_group(
        self, missing: list[_Weight], device: torch.device, stream: torch.cuda.Stream | None
    ) -> None:
        """Copy `missing` into one new device buffer, in host-arena order, neighbours in one transfer."""
        cuda = device.type == "cuda"
        order = sorted(missing, key=lambda w: (w.host_offset is None, w.host_offset or 0, w.order))
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            buffer = torch.empty(sum(aligned(w.nbytes) for w in order), dtype=torch.uint8, device=device)
        group = _Group(order)
        self.copies += 1
        runs: list[list] = []  # [arena, host offset, buffer offset, bytes]
        cursor = 0
        for weight in order:
            view = _typed_view(buffer, cursor, weight.dtype, weight.shape)
            if weight.home == "cpu":
                arena = self._arenas[weight.module]
                last = runs[-1] if runs else None
                follows = last and last[0] is arena and last[1] + last[3] == weight.host_offset
                if follows and last[2] + last[3] == cursor:
                    last[3] += aligned(weight.nbytes)
                else:
                    runs.append([arena, weight.host_offset, cursor, aligned(weight.nbytes)])
            else:
                self._copy_disk_weight(weight, view, stream)
            weight.replica, weight.group = view, group
            self._replicas[weight.module] = self._replicas.get(weight.module, 0) + weight.nbytes
            weight.replica_parameter = nn.Parameter(view, requires_grad=False)
            cursor += aligned(weight.nbytes)
        start = time.perf_counter()
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for arena, host, offset, nbytes in runs:
                buffer[offset : offset + nbytes].copy_(arena[host : host + nbytes], non_blocking=cuda)
        seconds = time.perf_counter() - start
        copied = [w for w in order if w.home == "cpu"]
        total = sum(w.nbytes for w in copied) or 1
        for weight in copied:
            self._publish_transfer(weight, "h2d", seconds * weight.nbytes / total, stream)

    def _copy_disk_weight(
        self, weight: _Weight, view: torch.Tensor, stream: torch.cuda.Stream | None
    ) -> None:
        """Re-read a disk-home weight into its replica (through a pinned staging buffer on CUDA)."""
        host = self._read(weight, weight.source)
        if weight.device.type != "cuda":
            view.copy_(host)
            return
        start = time.perf_counter()
        staged, slot = self._stage(weight, host)
        with torch.cuda.stream(stream):
            view.copy_(staged, non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record()
        self._publish_transfer(weight, "h2d", time.perf_counter() - start, stream)

    def pin(self, keys: Iterable[str]) -> None:
        """Protect the keys' replicas from eviction (counted: pin twice, unpin twice)."""
        for key in keys:
            self._weight(key).pins += 1
            self._pins += 1

    def unpin(self, keys: Iterable[str]) -> None:
        for key in keys:
            weight = self._weight(key)
            if weight.pins == 0:
                raise WeightStoreError(f"weight {key!r} is not pinned")
            weight.pins -= 1
            self._pins -= 1

    def evict_until_fits(self, nbytes: int, device: torch.device | str, protect: Collection[str] = ()) -> int:
        """Free room for `nbytes` on `device` (reference/001 order); returns the bytes freed.

        Order: idle workspaces, then replicas with a segment index from the last segment backward, then
        other replicas least recently used first. Stops as soon as the ledger says `nbytes` fits.
        """
        device = torch.device(device)
        ledger = self.ledger(device)
        deficit = nbytes - ledger.available()  # every byte released below is available again
        if log.isEnabledFor(logging.DEBUG):
            log.debug("evicting for %d bytes on %s (%d short): %s", nbytes, device, deficit,
                      "".join(traceback.format_stack(limit=6)[:-1]).replace("\n", " | "))
        freed = 0
        for module, key, size in ledger.idle_workspaces():
            if freed >= deficit:
                return freed
            freed += ledger.release(module, "workspace", key)
            self.bus.publish(
                "eviction",
                device=ledger.device_name,
                module=module,
                key=key,
                bytes=size,
                allocation="workspace",
                reason="idle_workspace",
                segment=None,
            )
        candidates = self._evictable_weights(device, protect)
        in_plan = sorted(
            (w for w in candidates if w.segment is not None), key=lambda w: (-w.segment, -w.order)
        )
        others = sorted((w for w in candidates if w.segment is None), key=lambda w: w.last_used)
        for weight, reason in [(w, "last_segment") for w in in_plan] + [(w, "lru") for w in others]:
            if freed >= deficit:
                break
            freed += self._evict(weight, reason)
        return freed

    def release_keys(self, keys: Iterable[str], reason: str = "replan") -> int:
        """Drop the unpinned replicas of `keys` (a new plan streams them); returns the bytes freed."""
        weights = [self._weight(k) for k in keys]
        return sum(self._evict(w, reason) for w in weights if w.replica is not None and self._evictable(w))

    def release_module(self, module: str) -> int:
        """Drop every unpinned replica of `module` (end of its phase); returns the bytes freed."""
        return sum(
            self._evict(w, "module_done")
            for w in list(self._weights.values())
            if w.module == module and w.replica is not None and self._evictable(w)
        )

    def bind_stage_weights(self, stage: Stage, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make the tensors (from `acquire`) the parameters of the stage's modules."""
        keys = self.stage_keys(stage)
        missing = [key for key in keys if key not in tensors]
        if missing:
            raise WeightStoreError(f"no tensor given for {missing[0]!r} of stage {stage.name!r}")
        self.bind_keys(keys, tensors)

    def bind_keys(self, keys: Iterable[str], tensors: Mapping[str, torch.Tensor]) -> None:
        """Bind the given device tensors (from `acquire`) in every place of each key; replicas stay bound."""
        for key in keys:
            weight = self._weights[key]
            tensor = tensors[key]
            if weight.home == "device" and tensor is weight.home_tensor:
                parameter = weight.resting
            elif weight.replica is tensor:
                parameter = weight.replica_parameter
                weight.bound = True
            else:
                parameter = nn.Parameter(tensor, requires_grad=False)
            for owner, attribute in weight.places:
                owner._parameters[attribute] = parameter

    def unbind_stage_weights(self, stage: Stage) -> None:
        """Put the stage's parameters back to their resting state (device home tensor, else meta)."""
        for key in self.stage_keys(stage):
            self._rest(self._weights[key])

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Bytes per module: home on device, replicas resident, replicas pinned, not on the device."""
        modules: dict[str, dict[str, int]] = {}
        for weight in self._weights.values():
            row = modules.setdefault(
                weight.module, {"device_home": 0, "replica": 0, "pinned": 0, "offloaded": 0}
            )
            if weight.home == "device":
                row["device_home"] += weight.nbytes
            elif weight.replica is None:
                row["offloaded"] += weight.nbytes
            else:
                row["pinned" if weight.pins else "replica"] += weight.nbytes
        return modules

    def _resting_parameter(self, weight: _Weight) -> nn.Parameter:
        if weight.home == "device":
            return nn.Parameter(weight.home_tensor, requires_grad=False)
        return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)

    def _rest(self, weight: _Weight) -> None:
        self.generation += 1
        for owner, attribute in weight.places:
            owner._parameters[attribute] = weight.resting
        weight.bound = False

    def _members(self, weight: _Weight) -> list[_Weight]:
        return weight.group.members if weight.group is not None else [weight]

    def _evictable_weights(self, device: torch.device, protect: Collection[str] = ()) -> list[_Weight]:
        """Every replica on `device` that eviction may drop now (each buffer checked once). Without
        `protect` the answer is kept until a copy, an eviction or a pin changes it: a runner asks before
        every call."""
        state = (device, self.generation, self.copies, self._pins)
        if not protect and self._evictable_cache is not None and self._evictable_cache[0] == state:
            return list(self._evictable_cache[1])
        verdict: dict[int, bool] = {}
        out = []
        for weight in self._weights.values():
            if weight.replica is None or weight.device != device:
                continue
            group = id(weight.group) if weight.group is not None else id(weight)
            if group not in verdict:
                verdict[group] = self._evictable(weight, protect)
            if verdict[group]:
                out.append(weight)
        if not protect:
            self._evictable_cache = (state, out)
        return list(out)

    def _evictable(self, weight: _Weight, protect: Collection[str] = ()) -> bool:
        """An unpinned, unprotected replica whose buffer-mates are unpinned and unprotected too."""
        return weight.replica is not None and not any(
            m.pins or m.key in protect for m in self._members(weight)
        )

    def _evict(self, weight: _Weight, reason: str) -> int:
        """Drop the replica of `weight` and of every weight sharing its buffer; returns the bytes freed."""
        if weight.replica is None:
            return 0
        freed = 0
        others = sorted((m for m in self._members(weight) if m is not weight), key=lambda m: -m.order)
        for member in [weight, *others]:
            self.generation += 1
            if member.bound:
                self._rest(member)
            member.replica = member.replica_parameter = member.group = None
            self._replicas[member.module] -= member.nbytes
            ledger = self.ledger(member.device)
            freed += ledger.release(member.module, "weights", member.key)
            self.bus.publish(
                "eviction",
                device=ledger.device_name,
                module=member.module,
                key=member.key,
                bytes=member.nbytes,
                allocation="weights",
                reason=reason,
                segment=member.segment,
            )
        return freed

    def _fill(self, weight: _Weight, source: Source,
              spans: list[tuple[torch.Tensor, FileSpan]] | None) -> None:
        """Fill the home tensor of `weight` now, or leave it to the bulk read of `spans` when its source
        knows where its bytes are (a `file_span(name)` method, see formats.CheckpointReader.file_span)."""
        locate = getattr(source, "file_span", None)
        span = locate(weight.name) if spans is not None and locate is not None else None
        if span is None:
            weight.home_tensor.copy_(self._read(weight, source))
            return
        if tuple(span.shape) != tuple(weight.shape):
            raise WeightStoreError(f"tensor {weight.name!r} has shape {tuple(span.shape)}, the model expects "
                                   f"{tuple(weight.shape)}")
        spans.append((weight.home_tensor, span))

    def _read(self, weight: _Weight, source: Source) -> torch.Tensor:
        """The tensor of `weight` from its source, checked against the parameter and cast to its dtype."""
        start = time.perf_counter()
        try:
            tensor = source(weight.name)
        except KeyError:
            raise WeightStoreError(f"the source of {weight.module!r} has no tensor {weight.name!r}") from None
        if tuple(tensor.shape) != tuple(weight.shape):
            raise WeightStoreError(
                f"tensor {weight.name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(weight.shape)}"
            )
        tensor = tensor.to(weight.dtype)
        if weight.home == "disk":
            self._publish_transfer(weight, "disk2h", time.perf_counter() - start, None)
        return tensor

    def _stage(self, weight: _Weight, host: torch.Tensor) -> tuple[torch.Tensor, _Staging]:
        """Copy `host` into one of two reusable pinned buffers, waiting until its previous copy finished."""
        slots = self._staging.setdefault(weight.device, [])
        if len(slots) < 2:
            slots.append(_Staging(torch.empty(weight.nbytes, dtype=torch.uint8).pin_memory()))
        slot = slots.pop(0)
        slots.append(slot)
        if slot.event is not None:
            slot.event.synchronize()
        if slot.buffer.numel() < weight.nbytes:
            slot.buffer = torch.empty(weight.nbytes, dtype=torch.uint8).pin_memory()
        view = slot.buffer[: weight.nbytes].view(weight.dtype).view(weight.shape)
        view.copy_(host)
        return view, slot

    def _publish_transfer(
        self, weight: _Weight, direction: str, seconds: float, stream: torch.cuda.Stream | None
    ) -> None:
        self.bus.publish(
            "transfer",
            device=device_name(weight.device),
            module=weight.module,
            key=weight.key,
            bytes=weight.nbytes,
            direction=direction,
            seconds=seconds,
            stream=None if stream is None else str(stream),
        )


def _typed_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """A `dtype` tensor of `shape` over bytes [offset, offset + its size) of the uint8 `buffer`."""
    nbytes = shape.numel() * dtype.itemsize
    return buffer[offset : offset + nbytes].view(dtype).view(shape)

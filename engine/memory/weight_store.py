"""The weight store: each parameter's home, its compute-device replica, pinning and eviction.

Homes (reference/000, "Runtime backend vs. parameter backend"):
- "device": the tensor lives on the compute device for good (tracked in the device ledger at load);
- "cpu": the tensor lives in RAM, pinned once at load when the compute device is CUDA;
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
the replica and a meta placeholder, so a stage computes on store-owned tensors. Keys are
`"<module>/<parameter name>"`; the source is called with the parameter name (the checkpoint key).
RAM held by cpu homes is not tracked by a ledger here; only compute-device memory is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from engine import telemetry
from engine.devices import device_name
from engine.memory.ledger import DeviceLedger
from engine.models.staged import Stage

Source = Callable[[str], torch.Tensor]  # checkpoint key -> tensor, e.g. safe_open(path, "pt").get_tensor
HOMES = ("device", "cpu", "disk")


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
    source: Source | None = None  # disk home
    replica: torch.Tensor | None = None  # compute-device copy of a cpu or disk home
    pins: int = 0
    segment: int | None = None  # index in the current segment plan, None when not in one
    last_used: int = 0
    bound: bool = False  # the owner's parameter currently is the replica


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
        self._clock = 0

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
        try:
            for owner_name, owner in model.named_modules():
                for attribute, parameter in list(owner._parameters.items()):
                    if parameter is None:
                        continue
                    originals.append((owner, attribute, parameter))
                    key = key_of_parameter.get(id(parameter))
                    if key is None:
                        name = f"{owner_name}.{attribute}" if owner_name else attribute
                        key = self._add(module, name, owner, attribute, parameter, home, device, source)
                        key_of_parameter[id(parameter)] = key
                        keys.append(key)
                    else:
                        self._weights[key].places.append((owner, attribute))
                    self._key_of[(id(owner), attribute)] = key
                    owner._parameters[attribute] = self._resting_parameter(self._weights[key])
        except BaseException:
            for owner, attribute, parameter in originals:
                owner._parameters[attribute] = parameter
                self._key_of.pop((id(owner), attribute), None)
            for key in keys:
                del self._weights[key]
                if home == "device":
                    self.ledger(device).release(module, "weights", key)
            raise
        return keys

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
    ) -> str:
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
                weight.home_tensor = self._read(weight, source).to(device)
            except BaseException:
                self.ledger(device).release(module, "weights", key)
                raise
        elif home == "cpu":
            tensor = self._read(weight, source).contiguous()
            weight.home_tensor = tensor.pin_memory() if device.type == "cuda" else tensor
        else:
            weight.source = source
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

    def is_resident(self, key: str) -> bool:
        """Whether the weight is on its compute device now (device home, or a replica)."""
        weight = self._weight(key)
        return weight.home == "device" or weight.replica is not None

    def set_segments(self, segment_of_key: Mapping[str, int]) -> None:
        """Record each key's segment index in the current plan (the eviction order reads it)."""
        for key, index in segment_of_key.items():
            self._weight(key).segment = index

    def evictable_bytes(self, device: torch.device | str) -> int:
        """Bytes eviction could free on `device` now: unpinned replicas and idle workspaces."""
        device = torch.device(device)
        ledger = self.ledger(device)
        replicas = sum(
            w.nbytes
            for w in self._weights.values()
            if w.replica is not None and w.pins == 0 and w.device == device
        )
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
        for weight in missing:
            ledger.allocate(weight.module, "weights", weight.key, weight.nbytes)
            try:
                weight.replica = self._copy_in(weight, stream)
            except BaseException:
                ledger.release(weight.module, "weights", weight.key)
                raise
        return {w.key: w.home_tensor if w.home == "device" else w.replica for w in weights}

    def pin(self, keys: Iterable[str]) -> None:
        """Protect the keys' replicas from eviction (counted: pin twice, unpin twice)."""
        for key in keys:
            self._weight(key).pins += 1

    def unpin(self, keys: Iterable[str]) -> None:
        for key in keys:
            weight = self._weight(key)
            if weight.pins == 0:
                raise WeightStoreError(f"weight {key!r} is not pinned")
            weight.pins -= 1

    def evict_until_fits(self, nbytes: int, device: torch.device | str, protect: Collection[str] = ()) -> int:
        """Free room for `nbytes` on `device` (reference/001 order); returns the bytes freed.

        Order: idle workspaces, then replicas with a segment index from the last segment backward, then
        other replicas least recently used first. Stops as soon as the ledger says `nbytes` fits.
        """
        device = torch.device(device)
        ledger = self.ledger(device)
        deficit = nbytes - ledger.available()  # every byte released below is available again
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
        candidates = [
            w
            for w in self._weights.values()
            if w.replica is not None and w.pins == 0 and w.device == device and w.key not in protect
        ]
        in_plan = sorted(
            (w for w in candidates if w.segment is not None), key=lambda w: (-w.segment, -w.order)
        )
        others = sorted((w for w in candidates if w.segment is None), key=lambda w: w.last_used)
        for weight, reason in [(w, "last_segment") for w in in_plan] + [(w, "lru") for w in others]:
            if freed >= deficit:
                break
            freed += self._evict(weight, reason)
        return freed

    def release_module(self, module: str) -> int:
        """Drop every unpinned replica of `module` (end of its phase); returns the bytes freed."""
        return sum(
            self._evict(w, "module_done")
            for w in list(self._weights.values())
            if w.module == module and w.replica is not None and w.pins == 0
        )

    def bind_stage_weights(self, stage: Stage, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make the tensors (from `acquire`) the parameters of the stage's modules."""
        for key in self.stage_keys(stage):
            weight = self._weights[key]
            if key not in tensors:
                raise WeightStoreError(f"no tensor given for {key!r} of stage {stage.name!r}")
            bound = nn.Parameter(tensors[key], requires_grad=False)
            for owner, attribute in weight.places:
                owner._parameters[attribute] = bound
            weight.bound = True

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
        resting = self._resting_parameter(weight)
        for owner, attribute in weight.places:
            owner._parameters[attribute] = resting
        weight.bound = False

    def _evict(self, weight: _Weight, reason: str) -> int:
        if weight.bound:
            self._rest(weight)
        weight.replica = None
        ledger = self.ledger(weight.device)
        freed = ledger.release(weight.module, "weights", weight.key)
        self.bus.publish(
            "eviction",
            device=ledger.device_name,
            module=weight.module,
            key=weight.key,
            bytes=weight.nbytes,
            allocation="weights",
            reason=reason,
            segment=weight.segment,
        )
        return freed

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

    def _copy_in(self, weight: _Weight, stream: torch.cuda.Stream | None) -> torch.Tensor:
        """A new compute-device replica of a cpu or disk weight."""
        host = weight.home_tensor if weight.home == "cpu" else self._read(weight, weight.source)
        start = time.perf_counter()
        if weight.device.type != "cuda":
            replica = host.clone() if weight.home == "cpu" else host.contiguous()
            if weight.home == "cpu":
                self._publish_transfer(weight, "h2d", time.perf_counter() - start, None)
            return replica
        staging = self._stage(weight, host) if weight.home == "disk" else None
        with torch.cuda.stream(stream):  # a no-op context when stream is None
            replica = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            replica.copy_(staging[0] if staging else host, non_blocking=True)
            if staging:
                staging[1].event = torch.cuda.Event()
                staging[1].event.record()
        self._publish_transfer(weight, "h2d", time.perf_counter() - start, stream)
        return replica

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

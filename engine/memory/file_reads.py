"""Read many tensors' bytes straight out of a checkpoint file into the tensors that will hold them.

A weight store registering a model with its weights on the GPU (or in RAM) used to read each tensor through
the file's reader (a copy out of the page cache into a new host tensor), cast it, and copy it to its home:
a pageable, synchronous copy per tensor. SDXL's 6.5 GiB loaded at about 2 GB/s so on the H200, most of the
first image's time. Here the bytes of every tensor whose place in the file is known (`FileSpan`) go:

- to a RAM home: read by `os.preadv` straight into the home tensor (one copy, no GIL), several at once;
- to a GPU home: read into a few reusable page-locked buffers by worker threads, each buffer copied to the
  device on a side stream while the next ones are read, straight into the home tensor's bytes when the file
  stores the home's dtype, else through a small device buffer and cast on the GPU.

The buffers are allocated once per process (page-locking is slow, about 2.5 GB/s) and reused.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

PIECE_BYTES = 16 * 2**20  # one page-locked buffer; a tensor larger than this is read in several pieces
# page-locked buffers, so reads run ahead of the copies to the GPU: on the H200 host an SDXL file (6.46 GiB,
# page cache) moved at 15.1 GB/s with 8 x 16 MiB and 8 x 32 MiB, 10.9 GB/s with 4 x 32 MiB
PIECES_IN_FLIGHT = 8
GAP_BYTES = 2**20  # tensors this close in the file are read in one piece, the bytes between them included
READ_THREADS = max(1, min(8, os.cpu_count() or 1))


class FileReadError(ValueError):
    """A file that ends before a tensor its header promised, or cannot be read."""


@dataclass(frozen=True)
class FileSpan:
    """Where one tensor's bytes lie in a file, and how they are stored."""

    path: Path
    offset: int  # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class _Part:
    target: torch.Tensor  # the home tensor (contiguous)
    span: FileSpan
    begin: int  # bytes [begin, end) of the tensor
    end: int
    at: int  # where those bytes start in the piece


@dataclass
class _Piece:
    path: Path
    start: int  # file offset of the piece's first byte
    stop: int
    parts: list[_Part] = field(default_factory=list)


def read_spans(targets: Sequence[tuple[torch.Tensor, FileSpan]]) -> None:
    """Fill each target tensor with the tensor stored at its span (cast to the target's dtype). The targets
    are contiguous and of the span's shape; those on a CUDA device and those in RAM may be mixed."""
    for target, span in targets:
        if tuple(target.shape) != tuple(span.shape) or not target.is_contiguous():
            raise ValueError(f"target of shape {tuple(target.shape)} (contiguous {target.is_contiguous()}) "
                             f"cannot take the tensor of shape {span.shape} at byte {span.offset} of "
                             f"{span.path}")
    on_host = [(t, s) for t, s in targets if t.device.type == "cpu"]
    on_gpu = [(t, s) for t, s in targets if t.device.type == "cuda"]
    others = [t.device for t, _ in targets if t.device.type not in ("cpu", "cuda")]
    if others:
        raise ValueError(f"cannot read file spans into a tensor on {others[0]}; accepted: cpu, cuda")
    with _Files() as files, ThreadPoolExecutor(READ_THREADS, thread_name_prefix="sluice-read") as pool:
        if on_host:
            for future in [pool.submit(_read_to_host, files, t, s) for t, s in on_host]:
                future.result()
        devices = {t.device for t, _ in on_gpu}
        for device in sorted(devices, key=str):
            _read_to_gpu(files, pool, [(t, s) for t, s in on_gpu if t.device == device], device)


class _Files:
    """Open file descriptors by path, shared by the reading threads (`os.preadv` keeps no position)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                try:
                    self._fds[path] = os.open(path, os.O_RDONLY)
                except OSError as error:
                    raise FileReadError(f"cannot open {path}: {error.strerror}") from None
            return self._fds[path]

    def read_into(self, path: Path, offset: int, buffer: memoryview) -> None:
        fd, done = self.fd(path), 0
        while done < len(buffer):
            try:
                count = os.preadv(fd, [buffer[done:]], offset + done)
            except OSError as error:
                raise FileReadError(f"cannot read {path} at byte {offset + done}: {error.strerror}") from None
            if count == 0:
                raise FileReadError(f"{path} ends at byte {offset + done}, before the {len(buffer)} bytes "
                                    f"from byte {offset} that its header promises; the file is truncated")
            done += count

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _read_to_host(files: _Files, target: torch.Tensor, span: FileSpan) -> None:
    if target.dtype == span.dtype:
        files.read_into(span.path, span.offset, _byte_view(target))
        return
    stored = torch.empty(span.nbytes, dtype=torch.uint8)
    files.read_into(span.path, span.offset, _byte_view(stored))
    target.copy_(stored.view(span.dtype).view(span.shape))


def _pieces(targets: Sequence[tuple[torch.Tensor, FileSpan]]) -> list[_Piece]:
    """The targets' bytes cut into pieces of at most PIECE_BYTES of one file each, in file order; a piece
    boundary inside a tensor falls on an element boundary."""
    pieces: list[_Piece] = []
    piece: _Piece | None = None
    for target, span in sorted(targets, key=lambda item: (str(item[1].path), item[1].offset)):
        element = span.dtype.itemsize
        done = 0
        while done < span.nbytes:
            at = span.offset + done
            adjacent = piece is not None and piece.path == span.path and 0 <= at - piece.stop <= GAP_BYTES
            room = PIECE_BYTES - (at - piece.start) if adjacent else 0
            take = min(span.nbytes - done, room) // element * element
            if take == 0:
                piece = _Piece(span.path, at, at)
                pieces.append(piece)
                take = min(span.nbytes - done, PIECE_BYTES // element * element)
            piece.parts.append(_Part(target, span, done, done + take, at - piece.start))
            piece.stop = at + take
            done += take
    return pieces


_buffers: dict[str, list[torch.Tensor]] = {}  # device name -> the page-locked buffers, made once
_buffers_lock = threading.Lock()


def _pinned_buffers() -> list[torch.Tensor]:
    with _buffers_lock:
        if "pinned" not in _buffers:
            whole = torch.empty(PIECES_IN_FLIGHT * PIECE_BYTES, dtype=torch.uint8, pin_memory=True)
            _buffers["pinned"] = list(whole.split(PIECE_BYTES))
        return _buffers["pinned"]


def _read_to_gpu(files: _Files, pool: ThreadPoolExecutor, targets: Sequence[tuple[torch.Tensor, FileSpan]],
                 device: torch.device) -> None:
    pieces = _pieces(targets)
    if not pieces:
        return
    buffers = _pinned_buffers()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the targets were allocated on the current one
    copied: list[torch.cuda.Event | None] = [None] * len(buffers)  # after the last copy out of each buffer

    def read(index: int) -> int:
        slot = index % len(buffers)
        if copied[slot] is not None:
            copied[slot].synchronize()  # the buffer's previous piece reached the GPU
        piece = pieces[index]
        files.read_into(piece.path, piece.start, _byte_view(buffers[slot][: piece.stop - piece.start]))
        return slot

    reads: dict[int, Future[int]] = {i: pool.submit(read, i) for i in range(min(len(buffers), len(pieces)))}
    try:
        with torch.cuda.stream(stream):
            for index, piece in enumerate(pieces):
                slot = reads.pop(index).result()
                host = buffers[slot]
                for part in piece.parts:
                    _copy_part(part, host[part.at: part.at + part.end - part.begin])
                event = torch.cuda.Event()
                event.record(stream)
                copied[slot] = event
                if index + len(buffers) < len(pieces):
                    reads[index + len(buffers)] = pool.submit(read, index + len(buffers))
    finally:
        for future in reads.values():  # after a failure: let the reads in flight end before the buffers go
            future.exception()
        stream.synchronize()


def _copy_part(part: _Part, host: torch.Tensor) -> None:
    """Queue the copy of one part from its page-locked bytes into its target, on the current stream."""
    target, span = part.target, part.span
    if target.dtype == span.dtype:
        target.reshape(-1).view(torch.uint8)[part.begin: part.end].copy_(host, non_blocking=True)
        return
    element = span.dtype.itemsize
    stored = torch.empty(part.end - part.begin, dtype=torch.uint8, device=target.device)
    stored.copy_(host, non_blocking=True)
    target.reshape(-1)[part.begin // element: part.end // element].copy_(stored.view(span.dtype))

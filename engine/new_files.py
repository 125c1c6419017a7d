"""Every file Sluice creates (images, checkpoints, downloads, uploads) appears whole or not at all, and never
over an existing file.

The bytes go to a hidden file beside the target (`.NAME.partial-XXXXXX`), which is then hard-linked to the
target's name: the link fails with FileExistsError when the name is taken, so nothing is replaced, and the
name never shows a half-written file, whatever stops the process. A failed write removes the hidden file.
File systems without hard links (FAT, some network shares) fall back to an exclusive create of the name,
written from the same chunks.

A CLI that must exit at once (a second Ctrl+C: `os._exit`) first calls `wait_for_writes`, so a file being
written is finished rather than left behind as a hidden partial one.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

PARTIAL_MARK = ".partial-"  # in the hidden file's name: `.sluice_00001_.png.partial-k3j9x2`
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}

_writes = threading.Condition()
_writing = 0
_closing = False


def create_file(path: str | os.PathLike[str], chunks: Iterable[bytes | memoryview] | bytes) -> Path:
    """Write `chunks` (or one bytes object) as the new file `path`; FileExistsError if the name exists."""
    path = Path(path)
    if isinstance(chunks, (bytes, bytearray, memoryview)):
        chunks = (chunks,)
    _begin_write()
    try:
        fd, partial = tempfile.mkstemp(prefix=f".{path.name}{PARTIAL_MARK}", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as file:
                for chunk in chunks:
                    file.write(chunk)
            try:
                os.link(partial, path)
            except OSError as error:
                if isinstance(error, FileExistsError) or error.errno not in _NO_HARD_LINKS:
                    raise
                _copy_exclusively(partial, path)
        finally:
            os.unlink(partial)
    finally:
        _end_write()
    return path


def wait_for_writes(timeout: float) -> bool:
    """Let the files being written finish (at most `timeout` seconds) and start no new ones: the process is
    about to exit. True when none was left unfinished."""
    global _closing
    with _writes:
        _closing = True
        return _writes.wait_for(lambda: _writing == 0, timeout)


def _begin_write() -> None:
    global _writing
    with _writes:
        while _closing:  # the process exits in a moment: a file begun now would be cut off
            _writes.wait()
        _writing += 1


def _end_write() -> None:
    global _writing
    with _writes:
        _writing -= 1
        _writes.notify_all()


def _copy_exclusively(source: str, path: Path) -> None:
    """The fallback without hard links: an exclusive create of `path`, removed again if the copy fails."""
    with open(source, "rb") as data, open(path, "xb") as file:  # "x": never overwrites nor follows a link
        try:
            while block := data.read(1 << 24):
                file.write(block)
        except BaseException:
            file.close()
            os.unlink(path)
            raise

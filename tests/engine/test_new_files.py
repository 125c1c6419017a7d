"""engine/new_files.py: a created file appears whole or not at all, never over another, and a CLI's
immediate exit lets a file being written finish."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import new_files
from engine.new_files import PARTIAL_MARK, create_file, wait_for_writes

ROOT = Path(__file__).resolve().parents[2]


def _leftovers(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if PARTIAL_MARK in name)


def test_created_file_holds_every_chunk_and_no_partial_file_remains(tmp_path: Path) -> None:
    path = create_file(tmp_path / "a.bin", [b"head", memoryview(b"-body-"), b"tail"])
    assert path.read_bytes() == b"head-body-tail"
    assert _leftovers(tmp_path) == []


def test_existing_file_and_symbolic_link_are_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "taken.png").write_bytes(b"mine")
    with pytest.raises(FileExistsError):
        create_file(tmp_path / "taken.png", b"theirs")
    assert (tmp_path / "taken.png").read_bytes() == b"mine"
    target = tmp_path / "elsewhere.txt"
    target.write_bytes(b"keep")
    (tmp_path / "link.png").symlink_to(target)
    with pytest.raises(FileExistsError):
        create_file(tmp_path / "link.png", b"theirs")
    assert target.read_bytes() == b"keep"
    assert _leftovers(tmp_path) == []


def test_failed_write_leaves_neither_the_name_nor_a_partial_file(tmp_path: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"first half"
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        create_file(tmp_path / "image.png", chunks())
    assert os.listdir(tmp_path) == []


def test_file_system_without_hard_links_gets_an_exclusive_copy(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(source: str, target: str) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    assert create_file(tmp_path / "a.png", [b"x" * 100, b"y"]).read_bytes() == b"x" * 100 + b"y"
    with pytest.raises(FileExistsError):
        create_file(tmp_path / "a.png", b"other")
    assert (tmp_path / "a.png").read_bytes() == b"x" * 100 + b"y"
    assert _leftovers(tmp_path) == []


def test_waiting_for_writes_lets_the_file_in_progress_finish(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(new_files, "_closing", False)  # restored after the test: later writes must not block
    started, release = threading.Event(), threading.Event()

    def chunks() -> Iterator[bytes]:
        yield b"begun "
        started.set()
        release.wait(10)
        yield b"and finished"

    writer = threading.Thread(target=create_file, args=(tmp_path / "slow.png", chunks()))
    writer.start()
    assert started.wait(10)
    assert wait_for_writes(0.05) is False  # still being written
    release.set()
    assert wait_for_writes(10) is True
    writer.join(10)
    assert (tmp_path / "slow.png").read_bytes() == b"begun and finished"


def test_immediate_exit_of_the_cli_finishes_the_png_being_written(tmp_path: Path) -> None:
    """A second Ctrl+C (app.cli.leave_interrupted, os._exit) while an image is written: the file is whole."""
    script = f"""
import sys, threading, time
sys.path.insert(0, {str(ROOT)!r})
from app.cli import leave_interrupted
from engine.new_files import create_file
started = threading.Event()
def chunks():
    yield b"a" * 1000
    started.set()
    time.sleep(0.5)
    yield b"b" * 1000
threading.Thread(target=create_file, args=({str(tmp_path / "out.png")!r}, chunks())).start()
started.wait(10)
leave_interrupted()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result.stderr
    assert (tmp_path / "out.png").read_bytes() == b"a" * 1000 + b"b" * 1000
    assert _leftovers(tmp_path) == []

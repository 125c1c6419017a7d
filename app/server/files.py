"""The server's three folders (ComfyUI's `type`: output, input, temp) and the only ways a request reaches a
file in them: `view_path` for GET /view and `save_upload` for the uploads.

Every name from a request is checked before it touches the file system: a file name is one path component
(no separators, no "..", no NUL byte), a subfolder is relative and never climbs out, and the resolved path,
symbolic links followed, must stay inside the folder. A bad file name is a 400, a subfolder or link that
leads out a 403 (ComfyUI's codes), a missing file a 404; names longer than the file system takes, subfolders
over MAX_SUBFOLDER_CHARS or MAX_SUBFOLDER_DEPTH, and paths the file system refuses (a file where a folder
should be, a loop of links) are a 400. Uploads never replace a file, except in the input
folder when the request asks (`overwrite`), and then they replace the entry itself, never a link's target.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from pathlib import Path, PurePosixPath

from engine.new_files import create_file
from engine.settings import Settings
from nodes.image import input_dir, preview_dir

FOLDER_TYPES = ("output", "input", "temp")
ANNOTATIONS = {f" [{name}]": name for name in FOLDER_TYPES}  # ComfyUI's "name.png [output]" form
MAX_NAME_BYTES = 255  # a file or folder name (the file systems' NAME_MAX)
MAX_SUBFOLDER_CHARS = 1024
MAX_SUBFOLDER_DEPTH = 64
UNUSABLE_PATH = (errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EEXIST)  # the request's


class PathRefused(Exception):
    """A request path the server will not use; `status` is the HTTP code (400, 403 or 404)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def folder_of(type_name: str, settings: Settings) -> Path:
    """The folder of a ComfyUI file type: output (the output folder), input (LoadImage's), temp (previews)."""
    if type_name == "output":
        return settings.output_dir
    if type_name == "input":
        return input_dir(settings)
    if type_name == "temp":
        return preview_dir()
    raise PathRefused(400, f"unknown type {type_name!r}; accepted: {', '.join(FOLDER_TYPES)}")


def split_annotation(filename: str) -> tuple[str, str | None]:
    """'image.png [input]' -> ('image.png', 'input'); a name without a type suffix -> (name, None)."""
    for suffix, type_name in ANNOTATIONS.items():
        if filename.endswith(suffix):
            return filename[: -len(suffix)], type_name
    return filename, None


def check_file_name(name: str) -> str:
    """`name` when it is one plain path component, else PathRefused(400) saying what is wrong."""
    if not name:
        raise PathRefused(400, "the file name is empty")
    if "\0" in name:
        raise PathRefused(400, "the file name contains a NUL byte")
    if "/" in name or "\\" in name:
        raise PathRefused(400, f"file name {name!r} contains a path separator; give the folder as subfolder")
    if name in (".", "..") or name.startswith(".."):
        raise PathRefused(400, f"file name {name!r} is not a file name")
    if len(os.fsencode(name)) > MAX_NAME_BYTES:
        raise PathRefused(400, f"the file name is {len(os.fsencode(name))} bytes long; at most "
                               f"{MAX_NAME_BYTES} are accepted")
    return name


def _unusable(error: OSError, what: str) -> PathRefused:
    """A path the file system refuses (too long, a file where a folder should be, a loop of links)."""
    return PathRefused(400, f"{what} cannot be used: {error.strerror}")


def subfolder_path(folder: Path, subfolder: str) -> Path:
    """`folder / subfolder` after checking that the subfolder cannot lead outside `folder` (PathRefused 403;
    a NUL byte is a 400). The result may not exist yet."""
    if "\0" in subfolder:
        raise PathRefused(400, "the subfolder contains a NUL byte")
    if not subfolder:
        return folder
    relative = PurePosixPath(subfolder.replace("\\", "/"))
    if relative.is_absolute() or (len(subfolder) > 1 and subfolder[1] == ":"):
        raise PathRefused(403, f"subfolder {subfolder!r} is an absolute path; give a path inside the folder")
    if ".." in relative.parts:
        raise PathRefused(403, f"subfolder {subfolder!r} contains '..'; give a path inside the folder")
    if len(subfolder) > MAX_SUBFOLDER_CHARS or len(relative.parts) > MAX_SUBFOLDER_DEPTH or any(
            len(os.fsencode(part)) > MAX_NAME_BYTES for part in relative.parts):
        raise PathRefused(400, f"the subfolder ({len(subfolder)} characters, {len(relative.parts)} levels) "
                               f"is too long; accepted: at most {MAX_SUBFOLDER_CHARS} characters, "
                               f"{MAX_SUBFOLDER_DEPTH} levels and {MAX_NAME_BYTES} bytes a folder name")
    path = folder.joinpath(*relative.parts)
    _check_inside(folder, path, f"subfolder {subfolder!r}")
    return path


def _check_inside(folder: Path, path: Path, what: str) -> None:
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise PathRefused(403, f"{what} leads outside the folder (through a symbolic link)")


def view_path(filename: str, subfolder: str, type_name: str | None, settings: Settings) -> Path:
    """The existing file GET /view serves, or PathRefused (400 bad name or type, 403 outside, 404 missing)."""
    name, annotated = split_annotation(filename)
    folder = folder_of(annotated or type_name or "output", settings)
    path = subfolder_path(folder, subfolder) / check_file_name(name)
    _check_inside(folder, path, f"file {name!r}")
    try:
        found = path.is_file()
    except OSError as error:
        if error.errno not in UNUSABLE_PATH:
            raise
        raise _unusable(error, f"file {name!r} in subfolder {subfolder!r}") from None
    if not found:
        raise PathRefused(404, f"no file {name!r} in subfolder {subfolder!r}")
    return path


def free_name(folder: Path, name: str) -> str:
    """`name`, or 'stem (1).ext', 'stem (2).ext', ... : the first that no entry of `folder` has."""
    stem, extension = os.path.splitext(name)
    candidate, counter = name, 1
    while os.path.lexists(folder / candidate):
        candidate = f"{stem} ({counter}){extension}"
        counter += 1
    return candidate


def _same_content(path: Path, data: bytes) -> bool:
    if not path.is_file() or path.is_symlink() or path.stat().st_size != len(data):
        return False
    return hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()


def save_upload(folder: Path, subfolder: str, filename: str, data: bytes, overwrite: bool) -> str:
    """Write an uploaded file into `folder/subfolder`; returns the name it was saved under.

    Without `overwrite` an existing file is never replaced: a file with the same bytes is reused (ComfyUI's
    duplicate check), else the upload gets the first free 'name (N).ext'. With `overwrite` the entry is
    replaced atomically (a symbolic link is replaced, never written through)."""
    name = check_file_name(filename)
    target_folder = subfolder_path(folder, subfolder)
    try:
        return _write_upload(folder, target_folder, subfolder, name, data, overwrite)
    except OSError as error:
        if error.errno not in UNUSABLE_PATH:
            raise
        raise _unusable(error, f"file {name!r} in subfolder {subfolder!r}") from None


def _write_upload(folder: Path, target_folder: Path, subfolder: str, name: str, data: bytes,
                  overwrite: bool) -> str:
    target_folder.mkdir(parents=True, exist_ok=True)
    _check_inside(folder, target_folder, f"subfolder {subfolder!r}")
    if overwrite:
        if (target_folder / name).is_dir() and not (target_folder / name).is_symlink():
            raise PathRefused(400, f"{name!r} is a folder in the upload folder")
        fd, temporary = tempfile.mkstemp(prefix=".upload-", dir=target_folder)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(temporary, target_folder / name)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
        return name
    if _same_content(target_folder / name, data):
        return name
    while True:
        candidate = free_name(target_folder, name)
        try:
            create_file(target_folder / candidate, data)  # never replaces nor follows links
            return candidate
        except FileExistsError:  # another upload took the name in between
            continue


def image_names(folder: Path, extensions: tuple[str, ...]) -> list[str]:
    """The image files of `folder` and its subfolders as sorted relative posix paths (LoadImage's list)."""
    names = []
    for directory, subdirs, files in os.walk(folder):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for file in files:
            if file.lower().endswith(extensions) and not file.startswith("."):
                names.append((Path(directory) / file).relative_to(folder).as_posix())
    return sorted(names)

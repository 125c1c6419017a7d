"""Where Sluice finds models, writes images and loads plugins.

Each path is resolved in this order: command-line flag > environment (`SLUICE_MODELS`, `SLUICE_OUTPUT`,
`SLUICE_PLUGINS`) > settings file (JSON at `SLUICE_SETTINGS` or `~/.config/sluice/settings.json`) >
default (`./models`, `./output`, no plugins). The models folder has ComfyUI's layout, so an existing
ComfyUI models folder works as it is. The cache of measured probes and stage profiles
(engine/memory/profile_cache.py) is at `cache_dir()`.

The settings file may also hold default memory settings, `"memory": {"max_vram": "6", "params_backend": "cpu",
...}` (the keys of a workflow's settings["memory"], engine/placement.py's MemorySettings): they apply below a
workflow's own settings and the command-line flags (`with_memory_defaults`).
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from engine.jsonfile import JsonInputError, read_json_file

# Unicode categories an output prefix may not hold: control characters, line and paragraph separators.
CONTROL_CATEGORIES = ("Cc", "Zl", "Zp")
MAX_PREFIX_FOLDERS = 32  # folders an output prefix may nest; 2,000 made mkdir recurse past Python's limit
MAX_PREFIX_NAME_BYTES = 200  # UTF-8 bytes of each part of a prefix: "_00001_.safetensors" must fit in 255

# Model kind -> folder names under the models root (ComfyUI's layout, with its legacy aliases).
MODEL_FOLDERS: dict[str, tuple[str, ...]] = {
    "checkpoints": ("checkpoints",),
    "diffusion_models": ("diffusion_models", "unet"),
    "text_encoders": ("text_encoders", "clip"),
    "vae": ("vae",),
    "loras": ("loras",),
    "upscale_models": ("upscale_models",),
    "embeddings": ("embeddings",),
    "vae_approx": ("vae_approx",),
    "controlnet": ("controlnet", "t2i_adapter"),
    "clip_vision": ("clip_vision",),
    "gligen": ("gligen",),
}
MODEL_EXTENSIONS = (".safetensors", ".ckpt", ".pt", ".pth", ".gguf", ".bin")

PATH_KEYS = ("models_root", "output_dir", "plugins_dir")
MEMORY_KEY = "memory"  # the settings file's default memory settings
ENV_VARS = {"models_root": "SLUICE_MODELS", "output_dir": "SLUICE_OUTPUT", "plugins_dir": "SLUICE_PLUGINS"}
DEFAULTS: dict[str, str | None] = {"models_root": "models", "output_dir": "output", "plugins_dir": None}
CACHE_ENV = "SLUICE_CACHE"
CACHE_OFF = "off"  # as SLUICE_CACHE or the settings file's cache_dir: no cache


class SettingsError(ValueError):
    """A bad settings file, model name, model kind or output prefix."""


def resources_dir() -> Path:
    """The repository's resources folder (default workflows, tokenizer data, icons)."""
    return Path(__file__).resolve().parents[1] / "resources"


def embedded_models_dir() -> Path:
    """The models folder that ships with Sluice (ComfyUI layout): the embedded shapes model."""
    return resources_dir() / "models"


def default_settings_file(env: Mapping[str, str] = os.environ) -> Path:
    """`SLUICE_SETTINGS` if set, else `~/.config/sluice/settings.json`."""
    if env.get("SLUICE_SETTINGS"):
        return Path(env["SLUICE_SETTINGS"]).expanduser()
    return Path.home() / ".config" / "sluice" / "settings.json"


@dataclass
class Settings:
    models_root: Path  # ComfyUI-layout models folder (checkpoints/, diffusion_models/, vae/, ...)
    output_dir: Path  # where saved images go; output_path never leaves it
    plugins_dir: Path | None  # user node plugins; None = no plugins
    extra: dict[str, Any] = field(default_factory=dict)  # other keys of the settings file, kept on save
    embedded_models: bool = True  # also search resources/models (the embedded model) after models_root

    def memory_defaults(self) -> dict[str, Any]:
        """The settings file's default memory settings (empty when it has none)."""
        return dict(self.extra.get(MEMORY_KEY) or {})

    def model_dirs(self, kind: str) -> list[Path]:
        """The folders searched for models of `kind`, in search order (they may not exist)."""
        if kind not in MODEL_FOLDERS:
            raise SettingsError(f"unknown model kind {kind!r}; accepted: {', '.join(MODEL_FOLDERS)}")
        folders = [self.models_root / folder for folder in MODEL_FOLDERS[kind]]
        if self.embedded_models:
            folders += [embedded_models_dir() / folder for folder in MODEL_FOLDERS[kind]]
        return folders

    def list_models(self, kind: str, extensions: Sequence[str] = MODEL_EXTENSIONS) -> list[str]:
        """Model files of `kind` as sorted relative posix paths, searched recursively in every folder."""
        suffixes = tuple(e.lower() for e in extensions)
        names: set[str] = set()
        for folder in self.model_dirs(kind):
            for path in _walk_files(folder):
                if path.name.lower().endswith(suffixes):
                    names.add(path.relative_to(folder).as_posix())
        return sorted(names)

    def resolve_model(self, kind: str, name: str) -> Path:
        """The file of model `name` (a relative path as list_models returns it) in the folders of `kind`."""
        folders = self.model_dirs(kind)
        relative = _safe_relative(name, f"model name {name!r}")
        for folder in folders:
            candidate = folder / relative
            if candidate.is_file():
                return candidate
        available = self.list_models(kind)
        shown = ", ".join(available[:10])
        if len(available) > 10:
            shown += f", ... ({len(available) - 10} more)"
        searched = ", ".join(str(f) for f in folders)
        raise SettingsError(f"model {name!r} ({kind}) not found; searched: {searched}; "
                            f"available: {shown or 'no model files there'}")

    def output_path(self, prefix: str, extension: str) -> Path:
        """A new file path `prefix_00001_.ext` under output_dir; never an existing file, never outside."""
        relative = _output_prefix_path(prefix)
        root = self.output_dir.resolve()
        folder = root / relative.parent
        if not folder.resolve().is_relative_to(root):
            raise SettingsError(f"output prefix {prefix!r} leads outside the output folder {root} "
                                f"(through a symbolic link)")
        folder.mkdir(parents=True, exist_ok=True)
        if not folder.resolve().is_relative_to(root):
            raise SettingsError(f"output prefix {prefix!r} leads outside the output folder {root}")
        suffix = extension if extension.startswith(".") else f".{extension}"
        stem = relative.name
        pattern = re.compile(re.escape(stem) + r"_(\d+)_" + re.escape(suffix) + "$")
        used = [int(m.group(1)) for entry in os.listdir(folder) if (m := pattern.match(entry))]
        counter = max(used, default=0) + 1
        while os.path.lexists(path := folder / f"{stem}_{counter:05d}_{suffix}"):
            counter += 1
        return path


def _output_prefix_path(prefix: str) -> PurePosixPath:
    """`prefix` ('folder/name') as a relative path; SettingsError when it is not one output_path accepts."""
    if isinstance(prefix, str) and (bad := next(
            (c for c in prefix if unicodedata.category(c) in CONTROL_CATEGORIES), None)) is not None:
        raise SettingsError(f"output prefix {_shown(prefix)} contains the control character {bad!r}; "
                            f"expected printable text such as 'portraits/img'")
    relative = _safe_relative(prefix, f"output prefix {_shown(prefix)}")
    if relative.name in ("", ".") or prefix.endswith(("/", "\\")):
        raise SettingsError(f"output prefix {_shown(prefix)} has no file name part (e.g. 'portraits/img')")
    if len(relative.parts) - 1 > MAX_PREFIX_FOLDERS:
        raise SettingsError(f"output prefix {_shown(prefix)} nests {len(relative.parts) - 1} folders; "
                            f"accepted: at most {MAX_PREFIX_FOLDERS}")
    for part in relative.parts:
        try:
            size = len(part.encode("utf-8"))
        except UnicodeEncodeError:
            raise SettingsError(f"output prefix {_shown(prefix)} is not valid Unicode (an unpaired "
                                f"surrogate); expected printable text such as 'portraits/img'") from None
        if size > MAX_PREFIX_NAME_BYTES:
            raise SettingsError(f"output prefix {_shown(prefix)} has a name of {size} bytes; accepted: "
                                f"folder and file names of at most {MAX_PREFIX_NAME_BYTES} bytes (UTF-8)")
    return relative


def _shown(text: str) -> str:
    """`text` quoted, cut to 80 characters for a message."""
    return repr(text) if len(text) <= 80 else repr(text[:80]) + f"... ({len(text)} characters)"


def output_prefix_problem(prefix: str) -> str | None:
    """What is wrong with `prefix` as an output prefix (control characters, empty, absolute, '..', no file
    name part), or None; checked without touching the output folder (validation runs it)."""
    try:
        _output_prefix_path(prefix)
    except SettingsError as error:
        return str(error)
    return None


def output_dir_problem(folder: Path) -> str | None:
    """What stops Sluice from writing into the output folder `folder` (a file or device in its place, a
    folder this user cannot write, a parent that is not a folder), or None; makes nothing. Validation runs it
    before a job that saves files, so a bad `--output` fails before sampling, not after."""
    accepted = "accepted: a folder this user can write, or a path where one can be made"
    where = f"output folder {folder} (--output, SLUICE_OUTPUT or the settings file's output_dir)"
    if folder.exists():
        if not folder.is_dir():
            return f"{where} is not a folder; {accepted}"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"{where} is not writable by this user; {accepted}"
        return None
    parent = folder.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{where} cannot be made: {parent} is not a folder; {accepted}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{where} cannot be made: {parent} is not writable by this user; {accepted}"
    return None


def _walk_files(folder: Path) -> list[Path]:
    """Files under `folder`, following symbolic links to folders once each; hidden entries skipped."""
    files: list[Path] = []
    seen: set[str] = set()
    for directory, subdirs, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:
            subdirs[:] = []
            continue
        seen.add(real)
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        files.extend(Path(directory) / f for f in filenames if not f.startswith("."))
    return files


def _safe_relative(name: str, what: str) -> PurePosixPath:
    """`name` as a relative path that cannot climb out of the folder it is joined to."""
    if not isinstance(name, str) or not name.strip():
        raise SettingsError(f"{what} is empty; expected a relative path such as 'folder/file'")
    if "\0" in name:
        raise SettingsError(f"{what} contains a NUL character")
    path = PurePosixPath(name.replace("\\", "/"))  # workflows written on Windows use backslashes
    if path.is_absolute() or re.match(r"^[A-Za-z]:", name):
        raise SettingsError(f"{what} is an absolute path; expected a path relative to its folder")
    if ".." in path.parts:
        raise SettingsError(f"{what} contains '..'; expected a path inside its folder")
    return path


def _read_settings_file(path: Path) -> dict[str, Any]:
    if path.exists() and not path.is_file():
        raise SettingsError(f"settings file {path} is not a regular file (a folder, FIFO or device); "
                            f"accepted: a JSON file, or no file at that path")
    if not path.is_file():
        return {}
    try:
        data = read_json_file(path, "settings file")
    except JsonInputError as error:
        raise SettingsError(str(error)) from None
    if not isinstance(data, dict):
        raise SettingsError(f"settings file {path} must hold a JSON object, got {type(data).__name__}")
    for key in PATH_KEYS:
        if data.get(key) is not None and not isinstance(data[key], str):
            raise SettingsError(f"settings file {path}: {key} must be a path string or null, "
                                f"got {data[key]!r}")
    memory = data.get(MEMORY_KEY)
    if memory is not None and (not isinstance(memory, dict) or not all(
            isinstance(value, (str, bool)) for value in memory.values())):
        raise SettingsError(f"settings file {path}: {MEMORY_KEY} must be an object of memory settings "
                            f"such as {{\"max_vram\": \"6\", \"params_backend\": \"cpu\"}}, got {memory!r}")
    return data


def with_memory_defaults(workflow_memory: Mapping[str, Any] | None,
                         settings: Settings | None) -> dict[str, Any]:
    """A workflow's settings["memory"] over the settings file's defaults: what a run of it uses."""
    defaults = settings.memory_defaults() if settings is not None else {}
    return {**defaults, **(workflow_memory or {})}


def cache_dir(env: Mapping[str, str] = os.environ, settings_file: str | Path | None = None) -> Path | None:
    """The folder of the profile cache, or None when it is off: `SLUICE_CACHE` > the settings file's
    `cache_dir` (relative to the file) > `$XDG_CACHE_HOME/sluice` > `~/.cache/sluice`. The value `off` (or
    null in the file) turns the cache off."""
    file = Path(settings_file).expanduser() if settings_file is not None else default_settings_file(env)
    if env.get(CACHE_ENV):
        value, base = env[CACHE_ENV], Path.cwd()
    elif "cache_dir" in (stored := _read_settings_file(file)):
        value, base = stored["cache_dir"], file.parent
        if value is not None and not isinstance(value, str):
            raise SettingsError(f"settings file {file}: cache_dir must be a path string, 'off' or null, "
                                f"got {value!r}")
    elif env.get("XDG_CACHE_HOME"):
        value, base = str(Path(env["XDG_CACHE_HOME"]) / "sluice"), Path.cwd()
    else:
        value, base = str(Path.home() / ".cache" / "sluice"), Path.cwd()
    if value is None or value.strip().lower() == CACHE_OFF:
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).absolute()


def load_settings(models_root: str | Path | None = None, output_dir: str | Path | None = None,
                  plugins_dir: str | Path | None = None, env: Mapping[str, str] = os.environ,
                  settings_file: str | Path | None = None) -> Settings:
    """Settings from flags > environment > settings file > defaults. File paths are relative to the file."""
    file = Path(settings_file).expanduser() if settings_file is not None else default_settings_file(env)
    stored = _read_settings_file(file)
    flags = {"models_root": models_root, "output_dir": output_dir, "plugins_dir": plugins_dir}
    resolved: dict[str, Path | None] = {}
    for key in PATH_KEYS:
        if flags[key] is not None and str(flags[key]) != "":
            value, base = Path(flags[key]), Path.cwd()
        elif env.get(ENV_VARS[key]):
            value, base = Path(env[ENV_VARS[key]]), Path.cwd()
        elif stored.get(key):
            value, base = Path(stored[key]), file.parent
        elif DEFAULTS[key] is not None:
            value, base = Path(DEFAULTS[key]), Path.cwd()
        else:
            resolved[key] = None
            continue
        value = value.expanduser()
        resolved[key] = value if value.is_absolute() else (base / value).absolute()
    extra = {k: v for k, v in stored.items() if k not in PATH_KEYS}
    return Settings(resolved["models_root"], resolved["output_dir"], resolved["plugins_dir"], extra)


def save_settings(settings: Settings, path: str | Path) -> None:
    """Write `settings` as the JSON settings file at `path` (atomically, creating its folder)."""
    path = Path(path).expanduser()
    data: dict[str, Any] = dict(settings.extra)
    data["models_root"] = str(settings.models_root)
    data["output_dir"] = str(settings.output_dir)
    data["plugins_dir"] = str(settings.plugins_dir) if settings.plugins_dir is not None else None
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)

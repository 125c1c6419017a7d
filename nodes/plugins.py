"""User node plugins: `*.py` files and package folders in the one folder the user configured.

Each plugin is imported on its own under a private module name (`sluice_plugins.<name>`), without touching
sys.path, and must expose `NODE_TYPES = (ClassA, ...)`. A plugin that fails to import, lacks NODE_TYPES
or declares invalid or duplicate types is reported as a PluginFailure; the others still load.
Entries whose names start with "." or "_" are skipped (rename a plugin to `_name.py` to disable it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from nodes.registry import NodeRegistry, RegistryError

PLUGIN_PACKAGE = "sluice_plugins"


@dataclass(frozen=True)
class PluginFailure:
    path: Path  # the plugin file or package folder
    message: str  # what went wrong, with the exception type and the plugin's line when known

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def plugin_paths(folder: Path) -> list[Path]:
    """The plugin files and package folders directly inside `folder`, sorted by name."""
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_file() and entry.suffix == ".py":
            found.append(entry)
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            found.append(entry)
    return found


def load_plugins(folder: str | Path, registry: NodeRegistry) -> list[PluginFailure]:
    """Register the node types of every plugin in `folder`; returns the failures, one per plugin."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return [PluginFailure(folder, "the plugins folder does not exist or is not a folder")]
    failures = []
    for path in plugin_paths(folder):
        failure = load_plugin(path, registry)
        if failure is not None:
            failures.append(failure)
    return failures


def load_plugin(path: Path, registry: NodeRegistry) -> PluginFailure | None:
    """Import one plugin file or package and register its NODE_TYPES; a PluginFailure when it cannot."""
    module_name = _module_name(path)
    try:
        module = _import_isolated(path, module_name)
    except (Exception, SystemExit) as error:
        return PluginFailure(path, f"failed to import: {_describe(error, path)}")
    if getattr(module, "NODE_TYPES", None) is None:
        _forget(module_name)
        return PluginFailure(path, "has no NODE_TYPES; expected NODE_TYPES = (NodeClass, ...)")
    try:
        registry.register_module(module, source=str(path))
    except RegistryError as error:
        _forget(module_name)
        return PluginFailure(path, str(error))
    return None


def _module_name(path: Path) -> str:
    """A private module name per plugin path, so two folders' `nodes.py` never collide."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    safe_stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    return f"{PLUGIN_PACKAGE}.{safe_stem}_{digest}"


def _import_isolated(path: Path, module_name: str) -> ModuleType:
    if path.is_dir():  # a package: relative imports inside it resolve through submodule_search_locations
        spec = importlib.util.spec_from_file_location(module_name, path / "__init__.py",
                                                      submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot create an import spec for {path}")
    _ensure_namespace()
    _forget(module_name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        _forget(module_name)
        raise
    return module


def _ensure_namespace() -> None:
    """The parent module of all plugins, so their names are proper dotted module names."""
    if PLUGIN_PACKAGE not in sys.modules:
        namespace = ModuleType(PLUGIN_PACKAGE, "Sluice user plugins, loaded by nodes.plugins")
        namespace.__path__ = []  # a package with no folder: nothing is ever found through it by name
        sys.modules[PLUGIN_PACKAGE] = namespace


def _forget(module_name: str) -> None:
    """Drop a plugin module and its submodules from sys.modules."""
    for name in [n for n in sys.modules if n == module_name or n.startswith(module_name + ".")]:
        del sys.modules[name]


def _describe(error: BaseException, path: Path) -> str:
    """`ExceptionType: message`, with the plugin's line that raised it when the traceback shows one."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, SyntaxError):
        return text
    root = str(path.resolve())
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if str(Path(frame.filename).resolve()).startswith(root)]
    if frames:
        frame = frames[-1]
        text += f" (at {Path(frame.filename).name} line {frame.lineno})"
    return text

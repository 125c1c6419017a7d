"""The node registry: every node type Sluice knows, by type name.

Built-in node modules are listed in BUILTIN_MODULES; each exposes `NODE_TYPES = (ClassA, ClassB, ...)`.
`default_registry(settings)` registers them and then the user's plugins. `registry.get` is the lookup
the engine's validation and executor take.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from engine.graph.spec import Input, NodeType, Output

if TYPE_CHECKING:
    from nodes.plugins import PluginFailure

# Built-in node modules, registered in this order. A module listed here but not written yet is skipped.
BUILTIN_MODULES: tuple[str, ...] = (
    "nodes.utility",
    "nodes.loaders",
    "nodes.gguf",
    "nodes.conditioning",
    "nodes.latent",
    "nodes.latent_ops",
    "nodes.sampling",
    "nodes.custom_sampling",
    "nodes.inpaint",
    "nodes.image",
    "nodes.image_ops",
    "nodes.masks",
    "nodes.upscale",
    "nodes.preview",
    "nodes.lora",
    "nodes.flux",
    "nodes.model_patches",
    "nodes.controlnet",
    "nodes.clip_vision",
    "nodes.gligen",
)


class RegistryError(ValueError):
    """A node type that cannot be registered (invalid declaration or duplicate type name)."""


def check_node_type(cls: Any) -> None:
    """Raise RegistryError naming the problem when `cls` is not a valid node type declaration."""
    if not isinstance(cls, type) or not issubclass(cls, NodeType) or cls is NodeType:
        raise RegistryError(f"{cls!r} is not a subclass of engine.graph.spec.NodeType")
    name = cls.__name__
    if not isinstance(cls.type_name, str) or not cls.type_name.strip():
        raise RegistryError(f"node type {name} has an empty type_name")
    if not isinstance(cls.inputs, tuple) or not all(isinstance(i, Input) for i in cls.inputs):
        raise RegistryError(f"node type {cls.type_name}: inputs must be a tuple of Input")
    if not isinstance(cls.outputs, tuple) or not all(isinstance(o, Output) for o in cls.outputs):
        raise RegistryError(f"node type {cls.type_name}: outputs must be a tuple of Output")
    input_names = [i.name for i in cls.inputs]
    repeated = sorted({n for n in input_names if input_names.count(n) > 1})
    if repeated:
        raise RegistryError(f"node type {cls.type_name}: input names repeated: {', '.join(repeated)}")
    if not callable(getattr(cls, "run", None)):
        raise RegistryError(f"node type {cls.type_name}: run is not a method")


class NodeRegistry:
    """Node types by type name, each remembered with the module or file it came from."""

    def __init__(self) -> None:
        self._types: dict[str, type[NodeType]] = {}
        self._sources: dict[str, str] = {}
        self.plugin_failures: list[PluginFailure] = []  # filled by default_registry

    def register(self, cls: type[NodeType], source: str | None = None) -> type[NodeType]:
        """Add `cls`; a duplicate type name is an error naming both sources. Returns `cls`."""
        check_node_type(cls)
        source = source or cls.__module__
        name = cls.type_name
        if name in self._types:
            raise RegistryError(f"node type {name!r} from {source} is already registered from "
                                f"{self._sources[name]}")
        self._types[name] = cls
        self._sources[name] = source
        return cls

    def register_all(self, classes: Iterable[Any], source: str) -> list[type[NodeType]]:
        """Register every class, or none when one is invalid or a duplicate (an error says which)."""
        classes = list(classes)
        names: dict[str, Any] = {}
        for cls in classes:
            check_node_type(cls)
            if cls.type_name in names:
                raise RegistryError(f"node type {cls.type_name!r} is declared twice in {source}")
            if cls.type_name in self._types:
                raise RegistryError(f"node type {cls.type_name!r} from {source} is already registered from "
                                    f"{self._sources[cls.type_name]}")
            names[cls.type_name] = cls
        return [self.register(cls, source) for cls in classes]

    def register_module(self, module: ModuleType, source: str | None = None) -> list[type[NodeType]]:
        """Register the module's NODE_TYPES tuple."""
        source = source or module.__name__
        node_types = getattr(module, "NODE_TYPES", None)
        if node_types is None:
            raise RegistryError(f"{source} has no NODE_TYPES; expected NODE_TYPES = (NodeClass, ...)")
        if not isinstance(node_types, (tuple, list)):
            raise RegistryError(f"{source}: NODE_TYPES must be a tuple of node classes, "
                                f"got {type(node_types).__name__}")
        return self.register_all(node_types, source)

    def get(self, name: str) -> type[NodeType] | None:
        return self._types.get(name)

    def source_of(self, name: str) -> str | None:
        return self._sources.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._types

    def __len__(self) -> int:
        return len(self._types)

    def __iter__(self) -> Iterator[type[NodeType]]:
        return iter(self.types())

    def types(self) -> list[type[NodeType]]:
        """Every registered type, sorted by type name."""
        return [self._types[name] for name in sorted(self._types)]

    def categories(self) -> dict[str, list[type[NodeType]]]:
        """Category -> its types (sorted by type name), categories sorted by name."""
        grouped: dict[str, list[type[NodeType]]] = {}
        for cls in self.types():
            grouped.setdefault(cls.category, []).append(cls)
        return {category: grouped[category] for category in sorted(grouped)}


def _import_builtin(module_name: str) -> ModuleType | None:
    """The module, or None when it does not exist; any other import error propagates."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            return None
        raise


def default_registry(settings: Any = None) -> NodeRegistry:
    """The built-in node types, then the plugins of `settings.plugins_dir` (failures in plugin_failures).

    A built-in module that defines `configure(settings)` is given the settings (model folders for choices).
    """
    from nodes.plugins import load_plugins

    registry = NodeRegistry()
    for module_name in BUILTIN_MODULES:
        module = _import_builtin(module_name)
        if module is not None:
            registry.register_module(module)
            if settings is not None and hasattr(module, "configure"):  # e.g. model choices list its folder
                module.configure(settings)
    plugins_dir = getattr(settings, "plugins_dir", None)
    if plugins_dir is not None:
        registry.plugin_failures = load_plugins(plugins_dir, registry)
    return registry

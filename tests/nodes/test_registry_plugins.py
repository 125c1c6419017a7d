import sys
import textwrap
from pathlib import Path

import pytest

from engine.graph.spec import INT, NodeType, Output, int_input
from engine.settings import Settings
from nodes.plugins import PLUGIN_PACKAGE, load_plugins
from nodes.registry import BUILTIN_MODULES, NodeRegistry, RegistryError, _import_builtin, default_registry

GOOD_PLUGIN = """
from engine.graph.spec import INT, NodeType, Output, int_input

class PluginDouble(NodeType):
    category = "test/plugins"
    inputs = (int_input("value", 2),)
    outputs = (Output("INT", INT),)

    def run(self, ctx, value):
        return (2 * value,)

NODE_TYPES = (PluginDouble,)
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


class Answer(NodeType):
    category = "test"
    inputs = (int_input("value", 42),)
    outputs = (Output("INT", INT),)

    def run(self, ctx, value):
        return (value,)


def test_register_get_contains_and_categories():
    registry = NodeRegistry()
    registry.register(Answer)
    assert registry.get("Answer") is Answer and "Answer" in registry
    assert registry.get("Missing") is None and "Missing" not in registry
    assert registry.types() == [Answer]
    assert registry.categories() == {"test": [Answer]}


def test_duplicate_type_name_names_both_sources():
    registry = NodeRegistry()
    registry.register(Answer, source="first_module")
    with pytest.raises(RegistryError) as caught:
        registry.register(Answer, source="second_module")
    assert "'Answer'" in str(caught.value)
    assert "first_module" in str(caught.value) and "second_module" in str(caught.value)


def test_non_node_classes_and_bad_declarations_are_rejected():
    registry = NodeRegistry()
    with pytest.raises(RegistryError, match="not a subclass"):
        registry.register(int)

    class RepeatedInputs(NodeType):
        inputs = (int_input("a", 0), int_input("a", 1))

    with pytest.raises(RegistryError, match="repeated: a"):
        registry.register(RepeatedInputs)


def test_default_registry_has_the_utility_primitives():
    registry = default_registry()
    assert BUILTIN_MODULES[0] == "nodes.utility"
    for name in ("PrimitiveInt", "PrimitiveFloat", "PrimitiveString", "PrimitiveBoolean"):
        assert name in registry
    assert registry.get("PrimitiveFloat")().run(None, value=3) == (3.0,)
    assert registry.plugin_failures == []


def test_missing_builtin_module_is_skipped_but_a_broken_one_raises(tmp_path, monkeypatch):
    assert _import_builtin("nodes.not_written_yet") is None
    write(tmp_path, "sluice_broken_builtin.py", "import sluice_package_that_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="sluice_package_that_does_not_exist"):
        _import_builtin("sluice_broken_builtin")


def test_plugins_load_in_isolation_and_failures_name_their_files(tmp_path):
    folder = tmp_path / "plugins"
    write(folder, "good.py", GOOD_PLUGIN)
    write(folder, "syntax.py", "def broken(:\n    pass\n")
    write(folder, "raises.py", "x = 1\nraise RuntimeError('plugin exploded')\n")
    write(folder, "empty.py", "VALUE = 1\n")
    write(folder, "_disabled.py", "raise RuntimeError('must not be imported')\n")
    registry = default_registry(Settings(tmp_path / "m", tmp_path / "o", folder))
    assert "PluginDouble" in registry
    assert registry.get("PluginDouble")().run(None, value=5) == (10,)
    assert registry.source_of("PluginDouble") == str(folder / "good.py")
    failures = {failure.path.name: failure.message for failure in registry.plugin_failures}
    assert sorted(failures) == ["empty.py", "raises.py", "syntax.py"]
    assert "SyntaxError" in failures["syntax.py"]
    assert "RuntimeError: plugin exploded" in failures["raises.py"] and "line 2" in failures["raises.py"]
    assert "NODE_TYPES" in failures["empty.py"]
    assert not any(name.startswith(PLUGIN_PACKAGE) and "raises" in name for name in sys.modules)


def test_plugin_with_invalid_or_duplicate_types_registers_nothing(tmp_path):
    folder = tmp_path / "plugins"
    write(folder, "a_clash.py", GOOD_PLUGIN + """
class Extra(NodeType):
    type_name = "PrimitiveInt"

NODE_TYPES = (PluginDouble, Extra)
""")
    write(folder, "b_not_a_node.py", "NODE_TYPES = (int,)\n")
    registry = default_registry(Settings(tmp_path / "m", tmp_path / "o", folder))
    failures = {failure.path.name: failure.message for failure in registry.plugin_failures}
    assert "PrimitiveInt" in failures["a_clash.py"] and "nodes.utility" in failures["a_clash.py"]
    assert "PluginDouble" not in registry  # all or nothing per plugin
    assert "not a subclass" in failures["b_not_a_node.py"]


def test_package_plugin_with_relative_import_loads(tmp_path):
    folder = tmp_path / "plugins"
    write(folder, "pack/__init__.py", "from .nodes import NODE_TYPES\n")
    write(folder, "pack/nodes.py", GOOD_PLUGIN)
    write(folder, "not_a_package/helper.py", GOOD_PLUGIN)  # no __init__.py: not a plugin
    registry = NodeRegistry()
    assert load_plugins(folder, registry) == []
    assert [t.type_name for t in registry.types()] == ["PluginDouble"]


def test_plugins_do_not_see_each_other_through_sys_path(tmp_path):
    folder = tmp_path / "plugins"
    write(folder, "helper_lib.py", GOOD_PLUGIN)
    write(folder, "user.py", "import helper_lib\nNODE_TYPES = ()\n")
    failures = load_plugins(folder, NodeRegistry())
    assert [f.path.name for f in failures] == ["user.py"]
    assert "ModuleNotFoundError" in failures[0].message


def test_missing_plugins_folder_is_reported(tmp_path):
    failures = load_plugins(tmp_path / "nope", NodeRegistry())
    assert len(failures) == 1 and "does not exist" in str(failures[0])

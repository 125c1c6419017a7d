"""Which of ComfyUI's official templates (the comfyui-workflow-templates-json package, test-only) Sluice
imports and validates: every node type known, and no validation error but the model files the template names
(absent here). README.md lists them under "ComfyUI's official templates"; this test keeps that list true."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.graph.comfy import from_comfy_ui
from engine.graph.errors import WorkflowError
from engine.graph.validate import validate
from nodes.registry import default_registry

README = Path(__file__).parents[3] / "README.md"
README_HEADING = "## ComfyUI's official templates"


def templates_dir() -> Path:
    package = pytest.importorskip("comfyui_workflow_templates_json",
                                  reason="comfyui-workflow-templates-json (a dev extra) is not installed")
    return Path(package.__file__).parent / "templates"


def validating_templates() -> tuple[list[str], int]:
    """(names of the templates that import with known node types and validate but for model files, number of
    workflow files)."""
    registry = default_registry()
    names, workflows = [], 0
    for path in sorted(templates_dir().glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
            continue  # the package's index and options files
        workflows += 1
        try:
            workflow, _ = from_comfy_ui(data, registry.get)
        except WorkflowError:
            continue
        if any(registry.get(node.type) is None for node in workflow.nodes.values()):
            continue
        model_file_errors = True
        for error in validate(workflow, registry.get):
            node_type = registry.get(workflow.nodes[error.node_id].type) if error.node_id else None
            widget = node_type.input_named(error.input_name) if node_type and error.input_name else None
            if widget is None or not callable(widget.choices):  # a model list's choices are a callable
                model_file_errors = False
        if model_file_errors:
            names.append(path.name)
    return names, workflows


def readme_list() -> list[str]:
    text = README.read_text(encoding="utf-8")
    assert README_HEADING in text
    section = text.split(README_HEADING, 1)[1].split("\n## ", 1)[0]
    return sorted(re.findall(r"^- `([^`]+\.json)`", section, flags=re.MULTILINE))


def test_the_readme_lists_exactly_the_templates_that_validate():
    names, workflows = validating_templates()
    assert "sdxl_revision_text_prompts.json" in names  # CLIPVisionLoader, unCLIPConditioning on SDXL
    assert readme_list() == names
    assert f"{len(names)} of the {workflows} workflows" in README.read_text(encoding="utf-8")

"""POST /prompt's checks: a ComfyUI API prompt becomes the Sluice workflow the engine thread runs, or
ComfyUI's error shape listing every problem.

As in ComfyUI, a node without `class_type` or of an unknown type rejects the whole prompt ("invalid_prompt"),
as does a prompt without output nodes ("prompt_no_outputs"). Otherwise each output node is checked with its
ancestors (Sluice's validation: missing inputs, links of the wrong type, values outside their range or
choices, cycles); every problem is reported under its node in `node_errors` with the outputs that depend on
it. Outputs whose ancestors are sound run, the others are left out; when none is sound the prompt is
refused ("prompt_outputs_failed_validation"). Widget values are converted as ComfyUI converts them ("20" to
an INT, 1 to a FLOAT, {"__value__": [...]} to the list). LoadImage's file names must name a file inside the
input folder (or, with ComfyUI's " [output]" / " [temp]" suffix, inside that folder) and come as values, not
through links; the server passes the node the checked path, so a prompt never reads a file outside the
server's folders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from app.server.files import PathRefused, split_annotation, view_path
from app.server.schema import LARGE_CHOICE_LIST, UPLOAD_INPUTS, input_config
from engine.graph.comfy import Lookup, from_comfy_api
from engine.graph.document import Workflow, id_sort_key
from engine.graph.errors import ValidationError, WorkflowError
from engine.graph.spec import BOOLEAN, COMBO, FLOAT, INT, SEED, STRING, Input, NodeType
from engine.graph.validate import build_graph, validate
from engine.settings import Settings


@dataclass
class CheckedPrompt:
    workflow: Workflow  # what runs: the sound output nodes and their ancestors
    outputs: list[str]  # the output nodes that run (ComfyUI's outputs_to_execute)
    node_errors: dict[str, Any] = field(default_factory=dict)  # problems of the outputs left out


class PromptRejected(Exception):
    """A prompt that cannot run; `error` and `node_errors` are ComfyUI's 400 body."""

    def __init__(self, error: dict[str, Any], node_errors: dict[str, Any] | None = None) -> None:
        super().__init__(error["message"])
        self.error = error
        self.node_errors = node_errors or {}


def error_entry(type_name: str, message: str, details: str = "", **extra_info: Any) -> dict[str, Any]:
    """One error in ComfyUI's shape."""
    return {"type": type_name, "message": message, "details": details, "extra_info": extra_info}


def check_prompt(prompt: Any, lookup: Lookup, settings: Settings, preview_method: str = "auto",
                 targets: list[str] | None = None) -> CheckedPrompt:
    """The workflow to run for `prompt` (only the output nodes in `targets` when given), or PromptRejected."""
    classes = _node_classes(prompt, lookup)
    conversion_errors: dict[str, list[dict[str, Any]]] = {}
    prompt = {node_id: _converted_node(node_id, raw, classes[node_id], conversion_errors)
              for node_id, raw in prompt.items()}
    try:
        workflow, _warnings = from_comfy_api(prompt, lookup)
    except WorkflowError as error:
        raise PromptRejected(error_entry("invalid_prompt", "Cannot execute because the prompt is malformed.",
                                         str(error))) from None
    workflow.settings["preview"] = {"method": preview_method}
    outputs = [node_id for node_id in sorted(workflow.nodes, key=id_sort_key) if classes[node_id].output_node
               and (targets is None or node_id in targets)]
    if not outputs:
        raise PromptRejected(error_entry("prompt_no_outputs", "Prompt has no outputs"))
    errors: dict[str, list[dict[str, Any]]] = {key: list(value) for key, value in conversion_errors.items()}
    unconverted = {(node_id, entry["extra_info"]["input_name"])
                   for node_id, entries in conversion_errors.items() for entry in entries}
    for problem in validate(workflow, lookup):
        if problem.node_id is not None and problem.kind != "no_output" and \
                (problem.node_id, problem.input_name) not in unconverted:
            errors.setdefault(problem.node_id, []).append(_comfy_error(problem, workflow, classes, settings))
    for node_id, node in workflow.nodes.items():
        entry = _upload_problem(classes[node_id], node.widgets, set(workflow.links_into(node_id)), settings)
        if entry is not None:
            errors.setdefault(node_id, []).append(entry)
    graph = build_graph(workflow)
    needs = {output: graph.ancestors(output) | {output} for output in outputs}
    node_errors: dict[str, Any] = {}
    for output, needed in needs.items():
        for node_id in sorted(needed & set(errors), key=id_sort_key):
            entry = node_errors.setdefault(node_id, {"errors": errors[node_id], "dependent_outputs": [],
                                                     "class_type": workflow.nodes[node_id].type})
            entry["dependent_outputs"].append(output)
    sound = [output for output in outputs if not needs[output] & set(errors)]
    if not sound:
        details = "\n".join(f"{entry['message']}: {entry['details']}" for node_id in node_errors
                            for entry in node_errors[node_id]["errors"])
        raise PromptRejected(error_entry("prompt_outputs_failed_validation",
                                         "Prompt outputs failed validation", details), node_errors)
    keep = set().union(*(needs[output] for output in sound))
    for node_id in [n for n in workflow.nodes if n not in keep]:
        workflow.remove_node(node_id)
    _pass_checked_paths(workflow, classes, settings)
    return CheckedPrompt(workflow, sound, node_errors)


def _node_classes(prompt: Any, lookup: Lookup) -> dict[str, type[NodeType]]:
    if not isinstance(prompt, dict) or not prompt:
        raise PromptRejected(error_entry("invalid_prompt", "Cannot execute because the prompt is not an "
                                         "object of nodes by id.", f"got {type(prompt).__name__}"))
    classes: dict[str, type[NodeType]] = {}
    for node_id, raw in prompt.items():
        if not isinstance(raw, dict) or "class_type" not in raw:
            raise PromptRejected(error_entry("invalid_prompt", "Cannot execute because a node is missing the "
                                             "class_type property.", f"Node ID '#{node_id}'"))
        class_type = raw["class_type"]
        node_type = lookup(class_type) if isinstance(class_type, str) else None
        if node_type is None:
            raise PromptRejected(error_entry("invalid_prompt", f"Cannot execute because node {class_type} "
                                             f"does not exist.", f"Node ID '#{node_id}'"))
        classes[node_id] = node_type
    return classes


def _converted_node(node_id: str, raw: dict[str, Any], node_type: type[NodeType],
                    errors: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The node with its widget values converted as ComfyUI converts them; failures go to `errors`."""
    inputs = raw.get("inputs", {})
    if not isinstance(inputs, dict):
        return raw
    converted = dict(inputs)
    for name, value in inputs.items():
        spec = node_type.input_named(name)
        if isinstance(value, dict) and "__value__" in value:
            value = converted[name] = value["__value__"]
        if spec is None or not spec.is_widget or isinstance(value, list):
            continue
        try:
            converted[name] = _convert(spec.kind, value)
        except (TypeError, ValueError, OverflowError) as error:
            kind = INT if spec.kind == SEED else spec.kind
            errors.setdefault(node_id, []).append(error_entry(
                "invalid_input_type", f"Failed to convert an input value to a {kind} value",
                f"{name}, {value!r}, {error}", input_name=name, received_value=value,
                exception_message=str(error)))
            converted[name] = value
    return {**raw, "inputs": converted}


def _convert(kind: str, value: Any) -> Any:
    if kind in (INT, SEED) and isinstance(value, (str, float)) and not isinstance(value, bool):
        return int(value)
    if kind == FLOAT and isinstance(value, (str, int)) and not isinstance(value, bool):
        return float(value)
    if kind == STRING and isinstance(value, (int, float)):
        return str(value)
    if kind == BOOLEAN and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind == BOOLEAN and isinstance(value, int) and value in (0, 1):
        return bool(value)
    return value


def _comfy_error(problem: ValidationError, workflow: Workflow, classes: dict[str, type[NodeType]],
                 settings: Settings) -> dict[str, Any]:
    """A Sluice validation problem as a ComfyUI node error; `details` keeps Sluice's message."""
    name = problem.input_name
    if problem.kind == "missing_input":
        return error_entry("required_input_missing", "Required input is missing", f"{name}", input_name=name)
    if problem.kind == "type_mismatch":
        return error_entry("return_type_mismatch", "Return type mismatch between linked nodes",
                           f"{name}, {problem.message}", input_name=name)
    if problem.kind == "bad_link":
        return error_entry("bad_linked_input", "Bad linked input", f"{name}, {problem.message}",
                           input_name=name)
    if problem.kind == "cycle":
        return error_entry("dependency_cycle", "Dependency cycle detected", problem.message)
    if problem.kind == "bad_value" and name is not None:
        node_type = classes[problem.node_id]
        spec = node_type.input_named(name)
        value = workflow.nodes[problem.node_id].widgets.get(name)
        return _value_error(node_type, spec, value, problem.message, settings)
    return error_entry("custom_validation_failed", "Custom validation failed for node",
                       f"{name} - {problem.message}" if name else problem.message, input_name=name)


def _value_error(node_type: type[NodeType], spec: Input, value: Any, message: str,
                 settings: Settings) -> dict[str, Any]:
    config = input_config(node_type, spec, settings)
    extra = {"input_name": spec.name, "input_config": config, "received_value": value}
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    low = 0 if spec.kind == SEED else spec.min
    if spec.kind == COMBO:
        choices = config[0] if isinstance(config[0], list) else []
        listed = f"(list of length {len(choices)})" if len(choices) > LARGE_CHOICE_LIST else str(choices)
        if len(choices) > LARGE_CHOICE_LIST:
            extra["input_config"] = None
        return error_entry("value_not_in_list", "Value not in list",
                           f"{spec.name}: '{value}' not in {listed}", **extra)
    if spec.kind in (INT, SEED, FLOAT) and numeric and low is not None and value < low:
        return error_entry("value_smaller_than_min", f"Value {value} smaller than min of {low}", spec.name,
                           **extra)
    high = config[1].get("max") if len(config) > 1 else None
    if spec.kind in (INT, SEED, FLOAT) and numeric and high is not None and value > high:
        return error_entry("value_bigger_than_max", f"Value {value} bigger than max of {high}", spec.name,
                           **extra)
    type_problem = Input(spec.name, spec.kind).check_value(value) if spec.kind != COMBO else None
    if type_problem is not None:
        kind = INT if spec.kind == SEED else spec.kind
        return error_entry("invalid_input_type", f"Failed to convert an input value to a {kind} value",
                           f"{spec.name}, {value!r}, {message}", **extra)
    return error_entry("custom_validation_failed", "Custom validation failed for node",
                       f"{spec.name} - {message}", **extra)


def _upload_path(value: str, settings: Settings) -> Any:
    """The checked file a LoadImage name stands for (PathRefused when it leads outside or is missing)."""
    name, annotated = split_annotation(value)
    relative = PurePosixPath(name.replace("\\", "/"))
    subfolder = "" if str(relative.parent) == "." else str(relative.parent)
    if name.startswith(("/", "\\")):
        subfolder = name  # an absolute path: refused as one
    return view_path(relative.name, subfolder, annotated or "input", settings)


def _upload_problem(node_type: type[NodeType], widgets: dict[str, Any], linked: set[str],
                    settings: Settings) -> dict | None:
    name = UPLOAD_INPUTS.get(node_type.type_name)
    if name is not None and name in linked:  # a linked value could not be checked before the node reads it
        return error_entry("custom_validation_failed", "Custom validation failed for node",
                           f"{name} - the server takes the image's file name as a value (a name in the input "
                           f"folder), not through a link", input_name=name)
    value = widgets.get(name) if name is not None else None
    if not isinstance(value, str):
        return None
    try:
        _upload_path(value, settings)
    except PathRefused as refused:
        return error_entry("custom_validation_failed", "Custom validation failed for node",
                           f"{name} - Invalid image file: {value} ({refused.message})", input_name=name,
                           received_value=value)
    return None


def _pass_checked_paths(workflow: Workflow, classes: dict[str, type[NodeType]], settings: Settings) -> None:
    """Give LoadImage nodes the checked absolute path of their file (they read absolute paths as given)."""
    for node_id, node in workflow.nodes.items():
        name = UPLOAD_INPUTS.get(classes[node_id].type_name)
        if name is not None and isinstance(node.widgets.get(name), str):
            node.widgets[name] = str(_upload_path(node.widgets[name], settings))

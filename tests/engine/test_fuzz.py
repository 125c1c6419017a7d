"""A seeded fuzzer over what Sluice takes in: the default workflow (as Sluice's document, ComfyUI's UI
workflow and its API prompt) with hostile values, deleted keys and damaged bytes, read and validated; and
model files (a safetensors header's JSON, a GGUF header's bytes) opened, detected and read. Every case ends
in success or one of the project's own errors with a message, within a time limit and without a jump in
the process's peak memory. Hypothesis runs derandomized (the same cases every run), in under a minute."""

from __future__ import annotations

import copy
import json
import os
import resource
import struct
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.cli import default_workflow_path, job_memory_line
from engine.graph.comfy_export import export_text
from engine.graph.errors import WorkflowError
from engine.graph.interchange import from_json_text
from engine.graph.validate import validate
from engine.jsonfile import JsonInputError
from engine.models.detect import UnsupportedModelError, detect
from engine.models.formats import CheckpointError, MissingTensorError, open_checkpoint
from engine.quant.gguf_file import GGUFFormatError
from engine.quant.gguf_writer import GGUFTensorPlan, write_gguf
from engine.quant.types import UnsupportedQuantTypeError
from engine.settings import Settings
from nodes.registry import default_registry

WORKFLOW_ERRORS = (WorkflowError, JsonInputError)
MODEL_ERRORS = (CheckpointError, GGUFFormatError, UnsupportedModelError, UnsupportedQuantTypeError,
                MissingTensorError, JsonInputError)
CASE_SECONDS = 3.0  # each case's time limit (validation of the default workflow takes milliseconds)
PEAK_GROWTH = 512 * 1024 * 1024  # the most a case may raise the process's peak RSS
FUZZ = settings(derandomize=True, database=None, deadline=timedelta(seconds=CASE_SECONDS),
                suppress_health_check=list(HealthCheck),
                max_examples=int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "800")))  # more to hunt, fewer in CI

HOSTILE = [-1, 0, 1, 2**31, 2**63, -(2**63), 10**39, 16384, 4096, 1e308, -0.0, 0.5, 1e-320, True, False, None,
           "", " ", "..", "../../etc/passwd", "/etc/passwd", "a\nb", "\x00", "x" * 5000, "é" * 300, "CON",
           "\u202e", [], {}, [1, 2, 3], {"a": 1}, [[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]],
           {"class_type": "KSampler", "inputs": {}}, ["1", 0], ["999", 5], [None, None]]


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Case:
    """One fuzz case: times it and checks the growth of the peak RSS."""

    def __enter__(self) -> Case:
        self.started, self.peak = time.monotonic(), _peak_rss()
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert time.monotonic() - self.started < CASE_SECONDS * 2
        assert _peak_rss() - self.peak < PEAK_GROWTH, "a case raised the peak memory by over 512 MiB"


def _clear(error: BaseException, accepted: tuple[type[BaseException], ...]) -> None:
    """Fail unless `error` is one of the project's errors with a message."""
    assert isinstance(error, accepted), f"{type(error).__name__}: {error}"
    assert str(error).strip(), f"{type(error).__name__} without a message"


# -- workflows --

@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    return default_registry(Settings(models_root=folder / "models", output_dir=folder / "out",
                                     plugins_dir=None))


@pytest.fixture(scope="module")
def documents(registry) -> dict[str, Any]:
    """The default workflow in the three formats Sluice reads, as parsed JSON."""
    text = default_workflow_path().read_text(encoding="utf-8")
    workflow, _ = from_json_text(text, registry.get)
    return {"sluice": json.loads(text),
            "comfy-ui": json.loads(export_text(workflow, registry.get, "comfy-ui")),
            "comfy-api": json.loads(export_text(workflow, registry.get, "comfy-api"))}


def _paths(data: Any) -> list[tuple]:
    """Every path (a tuple of keys and indices) to a value inside `data`."""
    found: list[tuple] = []
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        found.append(path)
        if isinstance(value, dict):
            stack.extend((inner, (*path, key)) for key, inner in value.items())
        elif isinstance(value, list):
            stack.extend((inner, (*path, index)) for index, inner in enumerate(value))
    return sorted(found, key=repr)


def _mutated(data: Any, operations: list[tuple[int, str, int]]) -> Any:
    """`data` after each (path pick, operation, value pick): replace a value, delete it, or nest it deep."""
    data = copy.deepcopy(data)
    for path_pick, operation, value_pick in operations:
        paths = [p for p in _paths(data) if p]
        if not paths:
            break
        path = paths[path_pick % len(paths)]
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if operation == "replace":
            parent[key] = copy.deepcopy(HOSTILE[value_pick % len(HOSTILE)])
        elif operation == "delete":
            del parent[key]
        elif operation == "nest":
            value = parent[key]
            for _ in range(value_pick % 400):
                value = [value]
            parent[key] = value
        elif operation == "scale" and type(parent[key]) in (int, float):
            parent[key] = parent[key] * (10 ** (value_pick % 30)) * (-1) ** value_pick
    return data


def _read_and_validate(text: str | bytes, registry: Any, output_dir: Path) -> None:
    try:
        workflow, _ = from_json_text(text, registry.get, "fuzzed workflow")
    except Exception as error:  # noqa: BLE001 - the assertion names what was raised
        _clear(error, WORKFLOW_ERRORS)
        return
    errors = validate(workflow, registry.get, output_dir)
    assert all(error.message.strip() for error in errors)
    job_memory_line(workflow)  # `sluice plan`'s estimate of the same workflow


OPERATION = st.sampled_from(["replace", "delete", "nest", "scale"])
PICK = st.integers(0, 10**6)
OPERATIONS = st.lists(st.tuples(PICK, OPERATION, PICK), min_size=1, max_size=4)


@FUZZ
@given(form=st.sampled_from(["sluice", "comfy-ui", "comfy-api"]), operations=OPERATIONS)
def test_fuzzed_workflows_read_and_validate_or_fail_clearly(registry, documents, tmp_path_factory, form,
                                                            operations):
    text = json.dumps(_mutated(documents[form], operations))
    with Case():
        _read_and_validate(text, registry, tmp_path_factory.getbasetemp() / "out")


@FUZZ
@given(form=st.sampled_from(["sluice", "comfy-ui", "comfy-api"]),
       damage=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.none() | st.integers(0, 10**6))
def test_workflows_with_damaged_bytes_fail_clearly(registry, documents, tmp_path_factory, form, damage, cut):
    content = bytearray(json.dumps(documents[form]).encode())
    for position, byte in damage:
        content[position % len(content)] = byte
    if cut is not None:
        content = content[:cut % len(content)]
    with Case():
        _read_and_validate(bytes(content), registry, tmp_path_factory.getbasetemp() / "out")


# -- model files --

def _read_model(path: Path) -> None:
    """Open, detect and read every tensor of the model file at `path`; only clear errors may come out."""
    try:
        with open_checkpoint(path) as reader:
            for key in reader.keys():
                reader.get(key)
            detect(reader)
    except Exception as error:  # noqa: BLE001 - the assertion names what was raised
        _clear(error, MODEL_ERRORS)
        assert path.name in str(error) or isinstance(error, UnsupportedModelError), error


SAFETENSORS_HEADER = {
    "__metadata__": {"format": "pt"},
    "first_stage_model.decoder.conv_in.weight": {"dtype": "F32", "shape": [4, 4, 3, 3],
                                                 "data_offsets": [0, 576]},
    "first_stage_model.decoder.conv_in.bias": {"dtype": "F16", "shape": [4], "data_offsets": [576, 584]},
    "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight":
        {"dtype": "BF16", "shape": [8, 4], "data_offsets": [584, 648]},
    "model.diffusion_model.input_blocks.0.0.weight": {"dtype": "I8", "shape": [2, 4, 1, 1],
                                                      "data_offsets": [648, 656]},
}
SAFETENSORS_DATA = bytes(range(256)) * 2 + bytes(144)  # 656 bytes


def _safetensors(header: Any, data: bytes = SAFETENSORS_DATA, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def test_the_unmutated_fuzz_models_read(tmp_path):
    (tmp_path / "seed.safetensors").write_bytes(_safetensors(SAFETENSORS_HEADER))
    with open_checkpoint(tmp_path / "seed.safetensors") as reader:
        assert sorted(reader.keys()) == sorted(k for k in SAFETENSORS_HEADER if k != "__metadata__")
        assert reader.get("first_stage_model.decoder.conv_in.weight").shape == (4, 4, 3, 3)
    _write_gguf(tmp_path / "seed.gguf")
    with open_checkpoint(tmp_path / "seed.gguf") as reader:
        assert len(reader.keys()) == 2


@FUZZ
@given(operations=OPERATIONS, length=st.none() | st.integers(0, 2**64 - 1),
       cut=st.none() | st.integers(0, 2000))
def test_fuzzed_safetensors_headers_fail_clearly(tmp_path_factory, operations, length, cut):
    content = _safetensors(_mutated(SAFETENSORS_HEADER, operations), length=length)
    if cut is not None:
        content = content[:cut]
    path = tmp_path_factory.getbasetemp() / "fuzzed.safetensors"
    path.write_bytes(content)
    with Case():
        _read_model(path)


def _write_gguf(path: Path) -> bytes:
    plans = [GGUFTensorPlan("model.diffusion_model.out.2.weight", (4, 32), "Q8_0"),
             GGUFTensorPlan("model.diffusion_model.out.2.bias", (4,), "F32")]
    rng = np.random.default_rng(0)

    def tensor_bytes(plan: GGUFTensorPlan) -> torch.Tensor:
        data = rng.integers(0, 255, plan.nbytes, dtype=np.uint8)
        if plan.type_name == "Q8_0":
            data.reshape(-1, 34)[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
        return torch.from_numpy(data)

    write_gguf(path, {"general.architecture": "sd1", "general.file_type": 7, "sluice.list": [1, 2, 3]},
               plans, tensor_bytes)
    return path.read_bytes()


EXTREMES = [b"\xff" * 8, b"\x00" * 8, struct.pack("<Q", 2**63), struct.pack("<Q", 2**32),
            struct.pack("<I", 40), struct.pack("<I", 9), struct.pack("<I", 2**31)]


@FUZZ
@given(damage=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255), st.integers(0, 10)),
                       min_size=1, max_size=6),
       cut=st.none() | st.integers(0, 10**6))
def test_fuzzed_gguf_headers_fail_clearly(tmp_path_factory, damage, cut):
    folder = tmp_path_factory.getbasetemp()
    content = bytearray(_write_gguf(folder / "seed.gguf"))
    header_end = content.index(b"model.diffusion_model.out.2.bias") + 64  # the tensor infos end near here
    for position, byte, extreme in damage:
        position %= header_end
        if extreme < len(EXTREMES):
            content[position:position + len(EXTREMES[extreme])] = EXTREMES[extreme]
        else:
            content[position] = byte
    if cut is not None:
        content = content[:cut % len(content)]
    path = folder / "fuzzed.gguf"
    path.write_bytes(bytes(content))
    with Case():
        _read_model(path)


# -- what the fuzzer found, one test each --

def _safetensors_file(tmp_path: Path, header: Any, data: bytes = SAFETENSORS_DATA) -> Path:
    path = tmp_path / "found.safetensors"
    path.write_bytes(_safetensors(header, data))
    return path


@pytest.mark.parametrize(("entry", "message"), [
    ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, "has dtype ['F32']; accepted: F64"),  # was a
    # TypeError
    ({"dtype": {"F32": 1}, "shape": [4], "data_offsets": [0, 16]}, "has dtype {'F32': 1}"),
    ({"dtype": "F32", "shape": [10**30, 1], "data_offsets": [0, 16]}, "span 16 bytes"),  # OverflowError
    ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "bad shape or offsets"),
])
def test_a_safetensors_entry_of_the_wrong_types_is_a_clear_error(tmp_path, entry, message):
    path = _safetensors_file(tmp_path, {"w": entry}, bytes(16))
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("{", r"\{")) as caught:
        open_checkpoint(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("metadata", [[1, 2], "text", 5])
def test_safetensors_metadata_that_is_not_an_object_is_a_clear_error(tmp_path, metadata):  # an AttributeError
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    path = _safetensors_file(tmp_path, {"__metadata__": metadata, "w": entry}, bytes(16))
    with pytest.raises(CheckpointError, match="__metadata__ is a JSON .*; accepted: an object of strings"):
        open_checkpoint(path)


@pytest.mark.parametrize("device", [[1, 2, 3], {"cpu": True}])
def test_a_comfy_api_prompt_with_a_list_for_a_renamed_widget_imports_with_a_warning(registry, device):
    prompt = {"1": {"class_type": "CLIPLoader", "inputs": {"clip_name": "sluice-shapes-clip.safetensors",
                                                           "type": "stable_diffusion", "device": device}}}
    workflow, warnings = from_json_text(json.dumps(prompt), registry.get)  # was a TypeError (unhashable)
    assert workflow.nodes["1"].type == "CLIPLoader"
    assert any(f"device {device!r} is not one of ComfyUI's values" in warning for warning in warnings)

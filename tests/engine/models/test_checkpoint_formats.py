"""Checkpoint readers: round trips against safetensors/torch/gguf writers; corrupt, lying, hostile files."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.models import formats
from engine.models.formats import (
    CheckpointError,
    MissingTensorError,
    UnsafeCheckpointError,
    UnsupportedTensorTypeError,
    open_checkpoint,
)

sys.path.insert(0, str(Path(__file__).parent))
from sd_checkpoints import save_state_dict, write_checkpoint  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def sample_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shapes = {"conv.weight": (8, 4, 3, 3), "linear.weight": (16, 8), "norm.bias": (16,), "table": (5, 3, 2)}
    return {k: torch.randn(s, generator=generator).to(dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("fmt", ["safetensors", "ckpt", "gguf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_gives_back_exact_tensors_shapes_and_dtypes(tmp_path, fmt, dtype):
    tensors = sample_tensors(dtype)
    path = tmp_path / f"model.{fmt}"
    save_state_dict(path, tensors, fmt)
    with open_checkpoint(path) as reader:
        assert sorted(reader.keys()) == sorted(tensors)
        for key, expected in tensors.items():
            assert reader.shape(key) == tuple(expected.shape)
            assert reader.dtype(key) == dtype
            assert reader.nbytes(key) == expected.numel() * expected.element_size()
            loaded = reader.get(key)
            assert loaded.dtype == dtype and torch.equal(loaded, expected), key


def test_format_is_chosen_by_content_not_extension(tmp_path):
    tensors = sample_tensors(torch.float32)
    for fmt, wrong_name, reader_class in [
        ("safetensors", "a.ckpt", formats.SafetensorsReader),
        ("gguf", "b.safetensors", formats.GGUFCheckpointReader),
        ("ckpt", "c.gguf", formats.TorchZipReader),
    ]:
        save_state_dict(tmp_path / wrong_name, tensors, fmt)
        with open_checkpoint(tmp_path / wrong_name) as reader:
            assert isinstance(reader, reader_class)
            assert torch.equal(reader.get("linear.weight"), tensors["linear.weight"])


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_metadata_is_returned_as_strings(tmp_path, fmt):
    path = tmp_path / f"m.{fmt}"
    save_state_dict(path, sample_tensors(torch.float16), fmt, metadata={"prediction_type": "v", "note": "x"})
    with open_checkpoint(path) as reader:
        assert reader.metadata()["prediction_type"] == "v"
        assert reader.metadata()["note"] == "x"


def test_checkpoint_state_dict_and_params_ema_wrappers_and_plain_dict_all_load(tmp_path):
    tensors = sample_tensors(torch.float32)
    torch.save(tensors, tmp_path / "plain.pt")
    torch.save({"state_dict": tensors, "global_step": 7, "epoch": 1}, tmp_path / "wrapped.ckpt")
    torch.save({"params_ema": tensors}, tmp_path / "realesrgan.pth")  # BasicSR upscalers wrap it so
    for name in ("plain.pt", "wrapped.ckpt", "realesrgan.pth"):
        with open_checkpoint(tmp_path / name) as reader:
            assert sorted(reader.keys()) == sorted(tensors)


def test_checkpoint_views_of_one_shared_storage_load_as_their_own_values(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    torch.save({"whole": base, "column": base[:, 2], "transposed": base.t()}, tmp_path / "views.pt")
    with open_checkpoint(tmp_path / "views.pt") as reader:
        assert torch.equal(reader.get("column"), base[:, 2])
        assert torch.equal(reader.get("transposed"), base.t())
        assert torch.equal(reader.get("whole"), base)


def test_listing_a_sparse_multi_gigabyte_safetensors_file_reads_only_its_header(tmp_path, monkeypatch):
    path = tmp_path / "huge.safetensors"
    shape, nbytes = (32768, 32768), 32768 * 32768 * 2
    header = json.dumps({"big": {"dtype": "F16", "shape": list(shape), "data_offsets": [0, nbytes]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)  # a 2 GiB hole: no data is ever written
    monkeypatch.setattr("safetensors.safe_open", lambda *a, **k: pytest.fail("listing opened the data"))
    with open_checkpoint(path) as reader:
        assert reader.keys() == ["big"] and reader.shape("big") == shape and reader.nbytes("big") == nbytes


@pytest.mark.parametrize("fmt", ["safetensors", "ckpt", "gguf"])
def test_inspection_of_a_checkpoint_never_loads_a_tensor(tmp_path, fmt, monkeypatch):
    from engine.models.inspect import inspect_file

    path = tmp_path / f"sd1.{fmt}"
    write_checkpoint(path, "sd1", fmt=fmt, components=("vae",))
    for reader_class in (formats.SafetensorsReader, formats.TorchZipReader, formats.GGUFCheckpointReader):
        monkeypatch.setattr(reader_class, "_load", lambda *a: pytest.fail("a tensor was loaded"))
    original_read = zipfile.ZipFile.read
    read_names: list[str] = []
    monkeypatch.setattr(
        zipfile.ZipFile,
        "read",
        lambda self, name, *a: read_names.append(name) or original_read(self, name, *a),
    )
    assert inspect_file(path)["components"] == {"vae": ""}
    assert all(name.endswith("data.pkl") for name in read_names)


# ---------------------------------------------------------------- bad files


def test_truncated_safetensors_names_file_and_tensor(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"a": torch.zeros(10), "b": torch.zeros(1000)}, str(path))
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"truncated safetensors file .*cut\.safetensors.*tensor 'b'"):
        open_checkpoint(path)


def _write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_safetensors_header_that_lies_about_a_tensor_size_is_rejected(tmp_path):
    path = tmp_path / "lying.safetensors"
    _write_raw_safetensors(path, {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}, bytes(64))
    with pytest.raises(
        CheckpointError, match=r"lying\.safetensors: tensor 'w' is F32\[4, 4\] \(64 bytes\).*32"
    ):
        open_checkpoint(path)


@pytest.mark.parametrize(
    "header_bytes, message",
    [
        (struct.pack("<Q", 10**9) + b"{}", "header length 1000000000 exceeds the file"),
        (struct.pack("<Q", 6) + b"{nope}", "header is not valid JSON"),
        (struct.pack("<Q", 8) + b'{"a": 1}', "bad header entry for tensor 'a'"),
    ],
)
def test_corrupt_safetensors_header_is_a_clear_error(tmp_path, header_bytes, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(header_bytes)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path)


def test_unknown_safetensors_dtype_lists_the_accepted_ones(tmp_path):
    path = tmp_path / "odd.safetensors"
    _write_raw_safetensors(path, {"w": {"dtype": "F12", "shape": [1], "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(CheckpointError, match="tensor 'w' has dtype 'F12'; accepted: F64, F32"):
        open_checkpoint(path)


def test_truncated_torch_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "cut.ckpt"
    torch.save(sample_tensors(torch.float32), path)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"cut\.ckpt"):
        open_checkpoint(path)


def test_torch_checkpoint_with_a_short_storage_names_the_tensor(tmp_path):
    source, path = tmp_path / "good.ckpt", tmp_path / "short.ckpt"
    torch.save({"w": torch.zeros(64)}, source)
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(path, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(item, data[:16] if item.filename.endswith("data/0") else data)
    with pytest.raises(CheckpointError, match=r"short\.ckpt: tensor 'w' needs 256 bytes .* which holds 16"):
        open_checkpoint(path)


def test_truncated_gguf_names_file_and_tensor(tmp_path):
    path = tmp_path / "cut.gguf"
    save_state_dict(path, {"first": torch.zeros(8), "last": torch.zeros(4096)}, "gguf")
    os.truncate(path, path.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match=r"truncated GGUF file: tensor 'last' .*cut\.gguf"):
        open_checkpoint(path)


@pytest.mark.parametrize("content", [b"", b"hello world, not a model", b"GGUF\x00\x00"])
def test_unrecognised_or_broken_content_is_a_clear_error(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        open_checkpoint(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint file not found: .*absent.safetensors"):
        open_checkpoint(tmp_path / "absent.safetensors")


def test_legacy_torch_serialization_is_refused_with_advice(tmp_path):
    path = tmp_path / "old.pt"
    torch.save(sample_tensors(torch.float32), path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy .* re-save it"):
        open_checkpoint(path)


def test_missing_tensor_is_a_key_error_naming_file_key_and_close_matches(tmp_path):
    path = tmp_path / "m.safetensors"
    save_state_dict(path, sample_tensors(torch.float32), "safetensors")
    with open_checkpoint(path) as reader, pytest.raises(KeyError) as caught:
        reader.get("linear.weigth")
    assert isinstance(caught.value, MissingTensorError)
    assert str(caught.value) == f"no tensor 'linear.weigth' in {path}; close matches: linear.weight"


def test_quantised_gguf_tensor_is_listed_and_read_as_bytes_or_dequantised(tmp_path):
    path = tmp_path / "q.gguf"
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    writer = gguf.GGUFWriter(str(path), arch="sd")
    writer.add_tensor("blocks.0.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    odd = gguf.GGMLQuantizationType.IQ2_XXS  # a type the engine does not dequantise
    writer.add_tensor("odd.weight", np.zeros((1, 66), dtype=np.uint8), raw_dtype=odd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open_checkpoint(path) as reader:
        assert reader.shape("blocks.0.weight") == (4, 64)
        assert reader.type_name("blocks.0.weight") == "Q8_0"
        assert reader.nbytes("blocks.0.weight") == 4 * 2 * 34  # two 32-weight blocks of 34 bytes per row
        assert torch.equal(reader.get_raw("blocks.0.weight"), torch.from_numpy(blocks))
        expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
        assert torch.equal(reader.get("blocks.0.weight"), torch.from_numpy(expected))
        with pytest.raises(UnsupportedTensorTypeError, match="blocks.0.weight is quantised .* no torch"):
            reader.dtype("blocks.0.weight")
        assert reader.shape("odd.weight") == (1, 256)
        unsupported = r"'odd.weight' of .*q\.gguf has GGML type IQ2_XXS, which is not supported; accepted: "
        with pytest.raises(UnsupportedTensorTypeError, match=unsupported):
            reader.get("odd.weight")


# ---------------------------------------------------------------- hostile pickles


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _WritesFile:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def _checkpoint_with_pickle(tmp_path: Path, payload: object, name: str) -> Path:
    """A real torch.save archive whose data.pkl is replaced by `payload` inside a state dict."""
    source, path = tmp_path / "template.ckpt", tmp_path / name
    torch.save({"w": torch.zeros(2)}, source)
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(path, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("data.pkl"):
                data = pickle.dumps({"state_dict": {"w": payload}}, protocol=2)
            dst.writestr(item, data)
    return path


@pytest.mark.parametrize("payload_class, asked_for", [(_Payload, ".system'"), (_WritesFile, ".exec'")])
def test_malicious_checkpoint_is_refused_and_its_payload_never_runs(tmp_path, payload_class, asked_for):
    marker = tmp_path / "pwned"
    path = _checkpoint_with_pickle(tmp_path, payload_class(marker), "evil.ckpt")
    with pytest.raises(UnsafeCheckpointError) as caught:
        open_checkpoint(path)
    message = str(caught.value)
    assert message.startswith(f"refusing to load {path}: the file asks for '")
    assert asked_for in message and "only tensors and plain containers are accepted" in message
    assert not marker.exists()
    with zipfile.ZipFile(path) as archive:  # control: the same bytes do run under a plain unpickler
        pickle.load(io.BytesIO(archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))))
    assert marker.exists()


def test_malicious_bare_pickle_named_ckpt_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    path.write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    with pytest.raises(
        UnsafeCheckpointError, match="refusing to load .*evil.ckpt: the file asks for '.*system'"
    ):
        open_checkpoint(path)
    assert not marker.exists()


def test_safetensors_header_length_starting_with_the_pickle_byte_is_still_safetensors(tmp_path):
    path = tmp_path / "padded.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode().ljust(0x180)
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.5, -2.0))
    with open_checkpoint(path) as reader:
        assert reader.get("w").tolist() == [1.5, -2.0]


@pytest.mark.parametrize("offsets, data_size, message", [
    ([[0, 8], [4, 12]], 12, r"tensor 'b' starts at byte 4 of the data region, but the tensor before it "
                            r"\('a'\) ends at byte 8"),
    ([[0, 8], [12, 20]], 20, r"tensor 'b' starts at byte 12 of the data region, but the tensor before it "
                             r"\('a'\) ends at byte 8"),
    ([[4, 12], [12, 20]], 20, r"tensor 'a' starts at byte 4 of the data region, but the data begins at "
                              r"byte 0"),
    ([[0, 8], [8, 16]], 20, r"the tensors end at byte 16 of the data region, but it holds 20 bytes"),
])
def test_safetensors_offsets_that_overlap_or_leave_gaps_are_an_error_naming_the_file(tmp_path, offsets,
                                                                                    data_size, message):
    path = tmp_path / "gappy.safetensors"
    header = {name: {"dtype": "F32", "shape": [2], "data_offsets": span}
              for name, span in zip("ab", offsets, strict=True)}
    _write_raw_safetensors(path, header, bytes(data_size))
    with pytest.raises(CheckpointError, match=r"gappy\.safetensors: " + message):
        with open_checkpoint(path) as reader:
            reader.get("a")


def test_safetensors_header_nested_too_deep_is_a_clear_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    raw = b'{"__metadata__": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    expected = r"deep\.safetensors: header is not valid JSON \(.*nested deeper"
    with pytest.raises(CheckpointError, match=expected):
        open_checkpoint(path)


def test_safetensors_file_changed_after_opening_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "shrunk.safetensors"
    _write_raw_safetensors(path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(16))
    with open_checkpoint(path) as reader:
        path.write_bytes(path.read_bytes()[:-4])  # truncated by another program after the header was read
        with pytest.raises(CheckpointError, match=r"cannot read tensor 'w' of safetensors file .*shrunk\."):
            reader.get("w")

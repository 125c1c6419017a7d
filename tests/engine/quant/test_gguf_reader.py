"""The GGUF reader on hand-built files: quantised tensors as bytes, ComfyUI-GGUF's reshaped tensors, and bad
files (truncated, lying counts and lengths, unknown types, offsets past the end, petabyte tensors) that must
be clear errors without allocating what they claim."""

from __future__ import annotations

import os
import struct
import tracemalloc

import gguf
import numpy as np
import pytest
import torch

from engine.models.formats import CheckpointError, open_checkpoint

Q8_0, F32, BF16 = 8, 0, 30


def text(value: str) -> bytes:
    data = value.encode()
    return struct.pack("<Q", len(data)) + data


def field(key: str, value_type: int, payload: bytes) -> bytes:
    return text(key) + struct.pack("<I", value_type) + payload


def tensor_info(name: str, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return text(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def gguf_file(fields: list[bytes], infos: list[bytes], data: bytes = b"", n_fields: int | None = None,
              n_tensors: int | None = None, version: int = 3) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(fields) if n_fields is None else n_fields)
    head += b"".join(fields) + b"".join(infos)
    return head + b"\0" * (-len(head) % 32) + data


def q8_0_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)


def open_bytes(tmp_path, content: bytes, name: str = "bad.gguf"):
    path = tmp_path / name
    path.write_bytes(content)
    return open_checkpoint(path)


def assert_refused_without_allocating(tmp_path, content: bytes, message: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=message):
            open_bytes(tmp_path, content)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"refusing the file allocated {peak} bytes"


def test_quantised_tensor_reads_as_row_bytes_and_into_a_callers_buffer(tmp_path):
    blocks = q8_0_blocks(3, 64)
    content = gguf_file([field("general.architecture", 8, text("flux"))],
                        [tensor_info("w", (64, 3), Q8_0, 0)], blocks.tobytes())
    with open_bytes(tmp_path, content) as reader:
        assert reader.shape("w") == (3, 64) and reader.type_name("w") == "Q8_0" and reader.nbytes("w") == 204
        assert torch.equal(reader.get_raw("w"), torch.from_numpy(blocks))
        buffer = torch.full((204,), 7, dtype=torch.uint8)
        raw = reader.get_raw("w", out=buffer)
        assert raw.data_ptr() == buffer.data_ptr() and raw.shape == (3, 68)
        assert torch.equal(buffer.view(3, 68), torch.from_numpy(blocks))
        with pytest.raises(ValueError, match=r"out must be a contiguous CPU uint8 tensor of 204 elements"):
            reader.get_raw("w", out=torch.empty(203, dtype=torch.uint8))
        assert reader.metadata()["general.architecture"] == "flux"


def test_comfyui_gguf_original_shape_is_the_logical_shape(tmp_path):
    conv = np.random.default_rng(1).standard_normal((8, 4, 3, 3)).astype(np.float32)  # 288 = 9 blocks of 32
    blocks = gguf.quants.quantize(conv.reshape(9, 32), gguf.GGMLQuantizationType.Q8_0)
    orig_shape = field("comfy.gguf.orig_shape.conv.weight", 9, struct.pack("<IQ4i", 5, 4, 8, 4, 3, 3))
    content = gguf_file([orig_shape], [tensor_info("conv.weight", (32, 9), Q8_0, 0)], blocks.tobytes())
    with open_bytes(tmp_path, content) as reader:
        assert reader.shape("conv.weight") == (8, 4, 3, 3)
        assert reader.get_raw("conv.weight").shape == (9, 34)
        expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(8, 4, 3, 3)
        assert torch.equal(reader.get("conv.weight"), torch.from_numpy(expected))
        assert reader.fields()["comfy.gguf.orig_shape.conv.weight"] == [8, 4, 3, 3]


def test_bf16_tensor_reads_back_exactly(tmp_path):
    values = torch.randn(2, 5).to(torch.bfloat16)
    content = gguf_file([], [tensor_info("b", (5, 2), BF16, 0)], values.view(torch.uint8).numpy().tobytes())
    with open_bytes(tmp_path, content) as reader:
        assert torch.equal(reader.get("b"), values)


def test_truncated_quantised_data_names_the_tensor_and_both_sizes(tmp_path):
    content = gguf_file([], [tensor_info("blocks.w", (64, 3), Q8_0, 0)], q8_0_blocks(3, 64).tobytes()[:-5])
    with pytest.raises(CheckpointError, match=r"truncated GGUF file: tensor 'blocks.w' \(Q8_0\[3, 64\], 204 "
                                              r"bytes\) ends at byte \d+, the file holds \d+ .*bad\.gguf"):
        open_bytes(tmp_path, content)


def test_a_tensor_claiming_petabytes_is_refused_without_allocating(tmp_path):
    content = gguf_file([], [tensor_info("huge", (1 << 20, 1 << 30), F32, 0)], b"\0" * 64)
    assert_refused_without_allocating(tmp_path, content, r"tensor 'huge' \(F32\[1073741824, 1048576\], "
                                                         r"4503599627370496 bytes\) ends at byte")


def test_an_offset_past_the_end_is_refused(tmp_path):
    content = gguf_file([], [tensor_info("far", (4,), F32, 1 << 40)], b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"tensor 'far' starts at byte 1099511627\d+, past the end"):
        open_bytes(tmp_path, content)


def test_an_unknown_tensor_type_names_the_tensor_and_lists_the_known_types(tmp_path):
    content = gguf_file([], [tensor_info("strange", (32,), 99, 0)], b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"'strange' has unknown GGML type id 99; known: F32 \(0\)"):
        open_bytes(tmp_path, content)


@pytest.mark.parametrize(("content", "message"), [
    (gguf_file([], [], n_tensors=1 << 60), r"claims 1152921504606846976 tensors, which need at least"),
    (gguf_file([], [], n_fields=1 << 62), r"claims 4611686018427387904 key-value fields"),
    (gguf_file([struct.pack("<Q", 1 << 50) + b"\0" * 16], [], n_fields=1),
     r"the key of field 0 claims a string of 1125899906842624 bytes"),
    (gguf_file([field("tokens", 9, struct.pack("<IQ", 8, 1 << 58))], []),
     r"claims 288230376151711744 elements in array field 'tokens'"),
    (gguf_file([field("scores", 9, struct.pack("<IQ", 6, 1 << 61))], []), r"in array field 'scores'"),
    (gguf_file([field("nest", 9, struct.pack("<IQ", 9, 1) * 9 + struct.pack("<IQ", 4, 0))], []),
     r"field 'nest' nests arrays deeper than 8"),
    (gguf_file([field("odd", 42, b"\0" * 8)], []), r"field 'odd' has unknown value type 42"),
])
def test_a_lying_header_is_refused_without_allocating(tmp_path, content, message):
    assert_refused_without_allocating(tmp_path, content, message)


@pytest.mark.parametrize(("content", "message"), [
    (gguf_file([], [], version=1), r"unsupported GGUF version 1; accepted: 2, 3"),
    (gguf_file([], [], version=3 << 24), r"big-endian GGUF file, which is not supported"),
    (gguf_file([], [tensor_info("t", (4,), F32, 0), tensor_info("t", (4,), F32, 32)], b"\0" * 64),
     r"tensor 't' appears twice"),
    (gguf_file([field("k", 4, b"\1\0\0\0"), field("k", 4, b"\2\0\0\0")], []), r"field 'k' appears twice"),
    (gguf_file([], [tensor_info("q", (48,), Q8_0, 0)], b"\0" * 64),
     r"tensor 'q' has rows of 48 elements, not whole Q8_0 blocks \(32 elements each\)"),
    (gguf_file([], [tensor_info("t", (1, 1, 1, 1, 1), F32, 0)], b"\0" * 64), r"tensor 't' has 5 dims"),
    (gguf_file([field("general.alignment", 4, struct.pack("<I", 24))], []),
     r"general.alignment is 24, not a power of two"),
    (b"GGUF\3\0\0\0" + b"\0" * 8, r"truncated GGUF file: 16 bytes, the fixed header alone needs 24"),
])
def test_malformed_headers_are_clear_errors_naming_the_file(tmp_path, content, message):
    with pytest.raises(CheckpointError, match=message + r".*bad\.gguf"):
        open_bytes(tmp_path, content)


def test_a_file_cut_short_after_opening_is_an_error_naming_the_tensor(tmp_path):
    blocks = q8_0_blocks(3, 64)
    content = gguf_file([], [tensor_info("w", (64, 3), Q8_0, 0)], blocks.tobytes())
    with open_bytes(tmp_path, content) as reader:
        os.truncate(reader.path, reader.path.stat().st_size - 10)
        with pytest.raises(CheckpointError, match=r"tensor 'w' needs 204 bytes at byte \d+, read 194"):
            reader.get_raw("w")

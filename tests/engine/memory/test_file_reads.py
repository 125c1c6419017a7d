"""Tensors read straight from a safetensors file into their homes equal what the safetensors library reads
(the independent reference), cast as the home asks, whatever the piece size."""

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.memory import file_reads
from engine.memory.file_reads import FileReadError, read_spans
from engine.models.formats import open_checkpoint

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8)


def _random_file(path, seed: int, count: int = 12) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index in range(count):
        shape = tuple(int(n) for n in torch.randint(1, 40, (int(torch.randint(1, 4, ()).item()),),
                                                    generator=generator))
        dtype = DTYPES[index % len(DTYPES)]
        if dtype.is_floating_point:
            tensors[f"t{index:02d}"] = torch.randn(shape, generator=generator).to(dtype)
        else:
            tensors[f"t{index:02d}"] = torch.randint(0, 200, shape, generator=generator).to(dtype)
    save_file(tensors, str(path))
    return tensors


def test_host_targets_get_the_files_tensors_in_their_own_dtype_or_cast(tmp_path):
    path = tmp_path / "weights.safetensors"
    _random_file(path, seed=1)
    expected = load_file(str(path))
    reader = open_checkpoint(path)
    targets = {}
    for key, tensor in expected.items():
        dtype = torch.float32 if tensor.is_floating_point() and key.endswith(("1", "3")) else tensor.dtype
        targets[key] = torch.full(tensor.shape, 7, dtype=dtype)  # poisoned: every element must be written
    read_spans([(targets[key], reader.file_span(key)) for key in expected])
    for key, tensor in expected.items():
        assert torch.equal(targets[key], tensor.to(targets[key].dtype)), key


@pytest.mark.parametrize("piece_bytes", [8, 24, 100, 4096])
def test_pieces_cover_every_tensors_bytes_once_on_element_boundaries(tmp_path, monkeypatch, piece_bytes):
    monkeypatch.setattr(file_reads, "PIECE_BYTES", piece_bytes)
    path = tmp_path / "weights.safetensors"
    tensors = _random_file(path, seed=piece_bytes)
    reader = open_checkpoint(path)
    keys = list(tensors)
    random.Random(piece_bytes).shuffle(keys)  # the pieces follow the file, not the order asked in
    targets = [(torch.empty(0), reader.file_span(key)) for key in keys]
    data = path.read_bytes()
    seen = {key: bytearray(reader.file_span(key).nbytes) for key in keys}
    for piece in file_reads._pieces(targets):
        assert piece.stop - piece.start <= max(piece_bytes, 8)
        chunk = data[piece.start: piece.stop]
        for part in piece.parts:
            element = part.span.dtype.itemsize
            assert part.begin % element == 0 and part.end % element == 0
            key = next(k for k in keys if reader.file_span(k) == part.span)
            seen[key][part.begin: part.end] = chunk[part.at: part.at + part.end - part.begin]
    for key in keys:
        span = reader.file_span(key)
        assert bytes(seen[key]) == data[span.offset: span.offset + span.nbytes], key


def test_a_truncated_file_names_itself_and_the_missing_bytes(tmp_path):
    path = tmp_path / "weights.safetensors"
    _random_file(path, seed=3)
    reader = open_checkpoint(path)
    spans = [reader.file_span(key) for key in reader.keys()]
    last = max(spans, key=lambda s: s.offset)
    path.write_bytes(path.read_bytes()[: last.offset + 1])
    with pytest.raises(FileReadError, match="weights.safetensors ends at byte .*truncated"):
        read_spans([(torch.empty(last.shape, dtype=last.dtype), last)])


def test_a_target_of_another_shape_is_refused_with_both_shapes(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(4, 3)}, str(path))
    span = open_checkpoint(path).file_span("w")
    with pytest.raises(ValueError, match=r"shape \(3, 4\).*shape \(4, 3\)"):
        read_spans([(torch.empty(3, 4), span)])


def test_a_reader_names_no_span_for_a_tensor_the_file_lacks(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(2)}, str(path))
    assert open_checkpoint(path).file_span("missing") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("piece_bytes", [64, 2**20])
def test_gpu_targets_get_the_files_tensors_through_the_pinned_pieces(tmp_path, monkeypatch, piece_bytes):
    monkeypatch.setattr(file_reads, "PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(file_reads, "_buffers", {})
    path = tmp_path / "weights.safetensors"
    _random_file(path, seed=5, count=40)
    expected = load_file(str(path))
    reader = open_checkpoint(path)
    targets = {}
    for key, tensor in expected.items():
        dtype = torch.bfloat16 if tensor.dtype == torch.float16 else tensor.dtype
        targets[key] = torch.full(tensor.shape, 7, dtype=dtype, device="cuda")
    read_spans([(targets[key], reader.file_span(key)) for key in expected])
    for key, tensor in expected.items():
        assert torch.equal(targets[key].cpu(), tensor.to(targets[key].dtype)), key

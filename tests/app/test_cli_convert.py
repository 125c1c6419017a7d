"""`sluice convert`: a safetensors file to a quantised GGUF, and its usage and input errors."""

from __future__ import annotations

import gguf
import torch
from safetensors.torch import save_file

from app.cli import main
from engine.quant.quantize import QUANTIZABLE


def write_model(path) -> None:
    save_file({"double_blocks.0.img_attn.proj.weight": torch.randn(64, 64),
               "double_blocks.0.img_attn.proj.bias": torch.randn(64)}, path)


def test_convert_writes_a_quantised_gguf_and_reports_it(tmp_path, capsys):
    write_model(tmp_path / "flux.safetensors")
    out = tmp_path / "flux-Q5_1.gguf"
    code = main(["convert", str(tmp_path / "flux.safetensors"), str(out), "--type", "q5_1", "--device", "cpu",
                 "--tensor-type-rules", "proj=q4_0"])
    assert code == 0
    printed = capsys.readouterr()
    assert f"wrote {out}: 2 tensors (F32 1, Q4_0 1)" in printed.out and "architecture flux" in printed.out
    assert "[2/2] double_blocks.0.img_attn.proj.weight" in printed.err
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types == {"double_blocks.0.img_attn.proj.weight": "Q4_0",
                     "double_blocks.0.img_attn.proj.bias": "F32"}


def test_convert_usage_errors_exit_2_and_unreadable_input_exits_1(tmp_path, capsys):
    write_model(tmp_path / "m.safetensors")
    source = str(tmp_path / "m.safetensors")
    assert main(["convert", source, str(tmp_path / "o.gguf"), "--type", "q9_9", "--quiet"]) == 2
    assert "--type: unknown GGML type 'q9_9'; accepted: F32, F16, BF16, Q8_0" in capsys.readouterr().err
    assert main(["convert", source, str(tmp_path / "o.gguf"), "--tensor-type-rules", "attn"]) == 2
    assert "is not REGEX=TYPE" in capsys.readouterr().err
    assert main(["convert", source, source, "--type", "q8_0"]) == 2
    assert "would overwrite its input" in capsys.readouterr().err
    (tmp_path / "junk.safetensors").write_bytes(b"not a model")
    assert main(["convert", str(tmp_path / "junk.safetensors"), str(tmp_path / "o.gguf"), "--quiet"]) == 1
    assert "cannot convert" in capsys.readouterr().err and not (tmp_path / "o.gguf").exists()


def test_the_type_help_of_convert_and_run_lists_every_type_sluice_writes(capsys):
    for command in ("convert", "run"):
        assert main([command, "--help"]) == 0
        words = {w.strip(",()").lower() for w in capsys.readouterr().out.split()}
        missing = [t for t in QUANTIZABLE if t.lower() not in words]
        assert missing == [], f"sluice {command} --help does not list {missing}"

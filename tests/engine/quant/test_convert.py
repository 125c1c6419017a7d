"""Checkpoint -> GGUF conversion: read back by gguf-py's own reader (ComfyUI-GGUF's) with the names, types,
fields and ggml's data layout that stable-diffusion.cpp and ComfyUI-GGUF look for; the quantised bytes are
gguf's own; --type and --tensor-type-rules as stable-diffusion.cpp applies them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.models.formats import CheckpointError, open_checkpoint
from engine.models.loader import load_checkpoint, load_text_encoders
from engine.quant.convert import convert_checkpoint, detect_architecture
from engine.quant.dequant import dequantize
from engine.quant.quantize import tensor_type_rules
from engine.quant.types import UnsupportedQuantTypeError
from tests.engine.models.flux_checkpoints import checkpoint_state, clip_l_state, flux_state, t5_state
from tests.engine.models.sd_checkpoints import write_checkpoint

# stable-diffusion.cpp's name conversion (src/name_conversion.cpp): the prefixes of the tensors it takes from
# a whole checkpoint (-m): its diffusion_model_, cond_stage_model_ and first_stage_model_prefix_vec
SD_CPP_PREFIXES = ("model.diffusion_model.", "cond_stage_model.", "conditioner.embedders.", "text_encoders.",
                   "first_stage_model.", "vae.")
# ComfyUI-GGUF's loader.py: the architectures its CLIPLoaderGGUF reads, and its T5_SD_MAP (llama.cpp -> torch)
COMFYUI_GGUF_TEXT_ARCHITECTURES = ("t5", "t5encoder", "llama", "qwen2vl", "qwen3", "qwen3vl")
COMFYUI_GGUF_T5_MAP = {"enc.": "encoder.", ".blk.": ".block.", "token_embd": "shared",
                       "output_norm": "final_layer_norm", "attn_q": "layer.0.SelfAttention.q",
                       "attn_k": "layer.0.SelfAttention.k", "attn_v": "layer.0.SelfAttention.v",
                       "attn_o": "layer.0.SelfAttention.o", "attn_norm": "layer.0.layer_norm",
                       "attn_rel_b": "layer.0.SelfAttention.relative_attention_bias",
                       "ffn_up": "layer.1.DenseReluDense.wi_1", "ffn_down": "layer.1.DenseReluDense.wo",
                       "ffn_gate": "layer.1.DenseReluDense.wi_0", "ffn_norm": "layer.1.layer_norm"}


def flux_like_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return {
        "double_blocks.0.img_attn.proj.weight": randn(64, 64),
        "double_blocks.0.img_attn.proj.bias": randn(64),
        "double_blocks.0.img_attn.norm.query_norm.scale": randn(16),
        "double_blocks.0.txt_mlp.0.weight": randn(48, 40),  # rows of 40: not whole Q8_0 blocks
        "single_blocks.0.linear1.weight": randn(96, 64, dtype=torch.bfloat16),
        "single_blocks.0.linear2.weight": randn(64, 96, dtype=torch.float8_e4m3fn),
        "single_blocks.0.modulation.lin.weight": randn(3, 2, 32, dtype=torch.float16),
        "img_in.weight": randn(64, 32),
        "time_in.in_layer.weight": randn(64, 256),
        "final_layer.linear.weight": randn(16, 64, dtype=torch.float8_e5m2),
        "position_ids": torch.arange(8).reshape(1, 8),
    }


EXPECTED_TYPES = {
    "double_blocks.0.img_attn.proj.weight": "Q8_0",
    "double_blocks.0.img_attn.proj.bias": "F32",
    "double_blocks.0.img_attn.norm.query_norm.scale": "F32",
    "double_blocks.0.txt_mlp.0.weight": "F32",
    "single_blocks.0.linear1.weight": "Q8_0",
    "single_blocks.0.linear2.weight": "Q8_0",
    "single_blocks.0.modulation.lin.weight": "Q8_0",
    "img_in.weight": "F32",
    "time_in.in_layer.weight": "F32",
    "final_layer.linear.weight": "F16",  # fp8 kept unquantised is widened to F16
    "position_ids": "I64",
}


def ggml_layout_problems(reader: gguf.GGUFReader) -> list[str]:
    """What ggml's gguf_init_from_file (stable-diffusion.cpp) would refuse: data not aligned to 32, tensors
    not at the running padded offsets in file order, names of 160 bytes or more, more than 4 dims."""
    problems, expected = [], reader.data_offset
    if reader.data_offset % 32:
        problems.append(f"data section at {reader.data_offset}")
    for tensor in reader.tensors:
        if tensor.data_offset != expected:
            problems.append(f"{tensor.name} at {tensor.data_offset}, expected {expected}")
        expected += -(-tensor.n_bytes // 32) * 32
        if len(tensor.name.encode()) >= 160 or len(tensor.shape) > 4:
            problems.append(f"{tensor.name}: name or dims")
    return problems


def field_value(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def test_safetensors_to_q8_0_gguf_reads_back_in_gguf_with_sd_cpp_and_comfyui_gguf_layout(tmp_path):
    state = flux_like_state()
    save_file(state, tmp_path / "flux.safetensors")
    summary = convert_checkpoint(tmp_path / "flux.safetensors", tmp_path / "flux.gguf", "q8_0")
    assert summary.architecture == "flux"
    reader = gguf.GGUFReader(tmp_path / "flux.gguf")
    assert ggml_layout_problems(reader) == []
    assert field_value(reader, "general.architecture") == "flux"
    assert field_value(reader, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert field_value(reader, "general.quantization_version") == gguf.GGML_QUANT_VERSION
    assert {t.name: t.tensor_type.name for t in reader.tensors} == EXPECTED_TYPES
    for tensor in reader.tensors:
        original = state[tensor.name]
        assert tuple(int(d) for d in reversed(tensor.shape.tolist())) == tuple(original.shape)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            rows = original.float().numpy().reshape(-1, original.shape[-1])
            stored = np.array(tensor.data).reshape(rows.shape[0], -1)
            assert np.array_equal(stored, gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0))
            ours = dequantize(torch.from_numpy(np.array(tensor.data)), "Q8_0", tuple(original.shape))
            reference = gguf.quants.dequantize(np.array(tensor.data), gguf.GGMLQuantizationType.Q8_0)
            assert torch.equal(ours, torch.from_numpy(reference).reshape(original.shape))
        elif tensor.tensor_type == gguf.GGMLQuantizationType.F16:
            assert torch.equal(torch.from_numpy(np.array(tensor.data)).reshape(original.shape),
                               original.to(torch.float16))
        else:
            assert torch.equal(torch.from_numpy(np.array(tensor.data)).reshape(original.shape), original)


def test_the_converted_file_loads_in_sluice_as_the_values_gguf_dequantises(tmp_path):
    state = flux_like_state()
    save_file(state, tmp_path / "flux.safetensors")
    convert_checkpoint(tmp_path / "flux.safetensors", tmp_path / "flux.gguf", "Q8_0")
    expected = {t.name: t for t in gguf.GGUFReader(tmp_path / "flux.gguf").tensors}
    with open_checkpoint(tmp_path / "flux.gguf") as reader:
        assert set(reader.keys()) == set(state)
        for key, original in state.items():
            assert reader.shape(key) == tuple(original.shape)
            tensor = expected[key]
            if not original.is_floating_point():
                assert torch.equal(reader.get(key), original)
                continue
            reference = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type))
            assert torch.equal(reader.get(key).float(), reference.reshape(original.shape).float())


def test_a_gguf_input_is_requantised_where_the_rules_say_and_copied_elsewhere(tmp_path):
    state = flux_like_state()
    save_file(state, tmp_path / "flux.safetensors")
    convert_checkpoint(tmp_path / "flux.safetensors", tmp_path / "q8.gguf", "q8_0")
    convert_checkpoint(tmp_path / "q8.gguf", tmp_path / "q4.gguf", "q4_0", rules="linear1=q8_0")
    q8 = {t.name: t for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors}
    q4 = {t.name: t for t in gguf.GGUFReader(tmp_path / "q4.gguf").tensors}
    proj = "double_blocks.0.img_attn.proj.weight"
    assert q4[proj].tensor_type.name == "Q4_0"
    dequantised = gguf.quants.dequantize(np.array(q8[proj].data), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(q4[proj].data, gguf.quants.quantize(dequantised, gguf.GGMLQuantizationType.Q4_0))
    for name in ("single_blocks.0.linear1.weight", "img_in.weight", "position_ids"):
        assert q4[name].tensor_type == q8[name].tensor_type
        assert np.array_equal(np.array(q4[name].data), np.array(q8[name].data))


def test_sd1_checkpoint_keeps_its_prefix_and_convolutions_and_is_detected(tmp_path):
    keys = ["input_blocks.3.0.op.weight", "input_blocks.6.0.op.weight", "input_blocks.9.0.op.weight",
            "output_blocks.2.1.conv.weight", "output_blocks.5.2.conv.weight", "output_blocks.8.2.conv.weight"]
    state = {f"model.diffusion_model.{k}": torch.randn(8, 8, 3, 3) for k in keys}
    state["model.diffusion_model.input_blocks.1.1.proj_in.weight"] = torch.randn(32, 32, 1, 1)
    to_q = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    state[to_q] = torch.randn(32, 64)
    state["model.diffusion_model.time_embed.0.weight"] = torch.randn(64, 32)
    state["first_stage_model.decoder.conv_in.weight"] = torch.randn(8, 4, 3, 3)
    save_file(state, tmp_path / "sd1.safetensors")
    summary = convert_checkpoint(tmp_path / "sd1.safetensors", tmp_path / "sd1.gguf", "q4_1")
    assert summary.architecture == "sd1"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "sd1.gguf").tensors}
    assert set(types) == set(state)
    assert [k for k, t in types.items() if t != "F32"] == [to_q]
    assert types[to_q] == "Q4_1"


@pytest.mark.parametrize(("keys", "architecture"), [
    (["double_blocks.0.img_attn.proj.weight"], "flux"),
    (["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"], "sd3"),
    (["model.diffusion_model.label_emb.0.0.weight", "model.diffusion_model.input_blocks.3.0.op.weight"],
     "sdxl"),
    (["transformer_blocks.0.attn.to_q.weight"], None),
    (["encoder.down.0.block.0.conv1.weight"], None),
])
def test_architecture_is_detected_from_the_keys_as_comfyui_gguf_does(keys, architecture):
    assert detect_architecture(keys) == architecture


def test_type_rules_follow_stable_diffusion_cpp():
    target = tensor_type_rules("q4_0", r"attn\.=q8_0,^vae\.=f16,mlp=f32")
    assert target("double_blocks.0.img_mod.lin.weight", (64, 64)) == "Q4_0"
    assert target("blocks.0.attn.qkv.weight", (96, 64)) == "Q8_0"  # the first matching rule
    assert target("vae.decoder.up.0.weight", (4, 4, 3, 3)) == "F16"  # f16 has blocks of 1
    assert target("blocks.0.mlp.fc1.weight", (64, 64)) == "F32"
    assert target("blocks.0.attn.qkv.bias", (96, 64)) is None  # .bias, .scale, .weight_scale: never
    assert target("double_blocks.0.img_attn.norm.query_norm.scale", (1, 64)) is None
    assert target("guidance_in.in_layer.weight", (64, 256)) is None  # FLUX, MMDiT, UNet embeddings
    assert target("model.diffusion_model.time_embed.0.weight", (64, 64)) is None
    assert target("token_embedding.weight", (64, 64)) is None
    assert target("blocks.0.linear.weight", (64, 48)) is None  # rows not whole blocks
    assert target("blocks.0.norm.weight", (64,)) is None  # 1-D (ComfyUI-GGUF's rule)
    assert tensor_type_rules()("blocks.0.linear.weight", (64, 64)) is None  # no --type: keep
    assert tensor_type_rules(None, "linear=q5_1")("blocks.0.linear.weight", (64, 64)) == "Q5_1"


@pytest.mark.parametrize(("type_name", "rules", "message"), [
    ("q3", "", r"--type: unknown GGML type 'q3'; accepted: F32, F16, BF16, Q8_0"),
    ("iq2_xxs", "", r"--type: unsupported GGML type 'iq2_xxs'"),
    ("q8_0", "attn", r"item 'attn' is not REGEX=TYPE"),
    ("q8_0", "attn(=q4_0", r"item 'attn\(=q4_0': bad regex"),
    ("q8_0", "attn=q7", r"item 'attn=q7': unknown GGML type 'q7'"),
])
def test_bad_types_and_rules_are_clear_errors(type_name, rules, message):
    with pytest.raises((ValueError, UnsupportedQuantTypeError), match=message):
        tensor_type_rules(type_name, rules)


def test_a_tensor_gguf_cannot_hold_is_refused_and_no_file_is_left(tmp_path):
    save_file({"mask": torch.ones(4, dtype=torch.bool), "w": torch.randn(4, 32)}, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"'mask' of .*m\.safetensors is BOOL, which GGUF cannot"):
        convert_checkpoint(tmp_path / "m.safetensors", tmp_path / "m.gguf", "q8_0")
    save_file({"patch.weight": torch.randn(4, 2, 1, 2, 2)}, tmp_path / "video.safetensors")
    with pytest.raises(ValueError, match=r"'patch.weight' of shape \(4, 2, 1, 2, 2\) has 5 dims; GGUF"):
        convert_checkpoint(tmp_path / "video.safetensors", tmp_path / "m.gguf", "q8_0")
    assert not list(tmp_path.glob("m.gguf*"))


def test_a_whole_checkpoint_keeps_the_names_stable_diffusion_cpp_and_comfyui_gguf_read(tmp_path):
    """A ComfyUI FLUX checkpoint and an SD1 one: every tensor keeps its key, under a prefix sd.cpp's -m takes
    (text encoders under text_encoders.clip_l / .t5xxl or cond_stage_model., the VAE under vae. or
    first_stage_model.); ComfyUI-GGUF's UnetLoaderGGUF finds the transformer's names under
    model.diffusion_model.; and the file loads in Sluice as the same three components."""
    flux = checkpoint_state()
    save_file(flux, tmp_path / "flux.safetensors")
    write_checkpoint(tmp_path / "sd1.safetensors", "sd1", size="tiny")
    for name, family in (("flux", "flux"), ("sd1", "sd1")):
        convert_checkpoint(tmp_path / f"{name}.safetensors", tmp_path / f"{name}.gguf", "q8_0")
        with open_checkpoint(tmp_path / f"{name}.safetensors") as source:
            keys = set(source.keys())
        reader = gguf.GGUFReader(tmp_path / f"{name}.gguf")
        names = [t.name for t in reader.tensors]
        assert set(names) == keys
        assert [n for n in names if not n.startswith(SD_CPP_PREFIXES)] == []
        assert "Q8_0" in {t.tensor_type.name for t in reader.tensors}
        text = {n.split(".transformer.")[0] for n in names if n.startswith(("text_encoders.", "cond_stage"))}
        assert text == ({"text_encoders.clip_l", "text_encoders.t5xxl"} if family == "flux"
                        else {"cond_stage_model"})
        model, clip, vae = load_checkpoint(tmp_path / f"{name}.gguf")
        assert model.family.startswith(family) and clip is not None and vae is not None
        if family == "flux":  # UnetLoaderGGUF: the architecture, and the names left once the prefix is cut
            assert field_value(reader, "general.architecture") == "flux"
            unet = {n.removeprefix("model.diffusion_model.") for n in names
                    if n.startswith("model.diffusion_model.")}
            assert unet == set(flux_state())


def test_a_bare_t5_encoder_is_a_t5encoder_file_comfyui_ggufs_clip_loader_reads(tmp_path):
    """ComfyUI-GGUF's CLIPLoaderGGUF takes a GGUF text encoder only under a text architecture and renames its
    tensors with T5_SD_MAP, which leaves transformers' names as they are; Sluice reads the file as the
    values gguf dequantises (the same encoding as a float32 copy of them)."""
    t5 = t5_state()
    save_file(t5, tmp_path / "t5.safetensors")
    summary = convert_checkpoint(tmp_path / "t5.safetensors", tmp_path / "t5.gguf", "q8_0")
    reader = gguf.GGUFReader(tmp_path / "t5.gguf")
    assert summary.architecture == field_value(reader, "general.architecture") == "t5encoder"
    assert field_value(reader, "general.architecture") in COMFYUI_GGUF_TEXT_ARCHITECTURES
    renamed = {}
    for tensor in reader.tensors:
        name = tensor.name
        for old, new in COMFYUI_GGUF_T5_MAP.items():
            name = name.replace(old, new)
        renamed[name] = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type))
    assert set(renamed) == set(t5)
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q8_0"}
    save_file({k: v.reshape(t5[k].shape).float().contiguous() for k, v in renamed.items()},
              tmp_path / "t5-copy.safetensors")
    save_file(clip_l_state(), tmp_path / "clip_l.safetensors")
    ours = load_text_encoders([tmp_path / "clip_l.safetensors", tmp_path / "t5.gguf"], "flux")
    copy = load_text_encoders([tmp_path / "clip_l.safetensors", tmp_path / "t5-copy.safetensors"], "flux")
    assert torch.equal(ours.encode("a red cube")[0][0], copy.encode("a red cube")[0][0])
    assert detect_architecture([*t5, "decoder.block.0.layer.0.SelfAttention.q.weight"]) == "t5"

"""LoRA file parsing and key mapping: kohya (LDM and diffusers names), diffusers/PEFT with alpha in the
metadata, LoCon, LoHa, LoKr; the diffusers names are checked against diffusers' own single-file converter."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.models.loader import load_checkpoint
from engine.models.lora import (
    LoraFormatError,
    LoraTarget,
    diffusers_unet_names,
    match_lora,
    parse_lora,
    read_lora,
)
from engine.models.unet import UNetModel, sd15_unet_config, sdxl_unet_config

sys.path.insert(0, str(Path(__file__).parent))
from sd_checkpoints import write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def sd1(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("ckpt") / "sd1.safetensors"
    write_checkpoint(path, "sd1", size="tiny", seed=1)
    model, clip, _ = load_checkpoint(path, components=("diffusion", "te"))
    return model, clip


@pytest.fixture(scope="module")
def sdxl_te(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("ckpt") / "sdxl_te.safetensors"
    write_checkpoint(path, "sdxl", size="tiny", components=("te",), seed=2)
    return load_checkpoint(path, components=("te",))[1]


def diffusers_names_by_diffusers(unet: UNetModel, layers_per_block: int, sdxl: bool) -> dict[str, str]:
    """Our parameter name -> diffusers parameter name, as diffusers' convert_ldm_unet_checkpoint moves them
    (each parameter followed by the identity of the placeholder tensor it is carried in)."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    state = {key: torch.empty(1) for key in unet.state_dict()}
    names = {id(value): key for key, value in state.items()}
    config = {
        "layers_per_block": layers_per_block,
        "class_embed_type": None,
        "num_class_embeds": None,
        "addition_embed_type": "text_time" if sdxl else None,
    }
    converted = convert_ldm_unet_checkpoint(
        {"model.diffusion_model." + k: v for k, v in state.items()}, config
    )
    return {names[id(value)]: key for key, value in converted.items() if id(value) in names}


@pytest.mark.parametrize("config, sdxl", [(sd15_unet_config, False), (sdxl_unet_config, True)])
def test_diffusers_unet_names_are_the_ones_diffusers_converter_gives(config, sdxl):
    unet = UNetModel(config(), device="meta")
    expected = diffusers_names_by_diffusers(unet, 2, sdxl)
    mine = {}
    for module, name in diffusers_unet_names(unet).items():
        for param in ("weight", "bias"):
            if f"{module}.{param}" in expected:
                mine[f"{module}.{param}"] = f"{name}.{param}"
    assert len(expected) == len(unet.state_dict())
    assert mine == expected


def test_kohya_layers_read_alpha_from_their_alpha_tensor():
    down, up = torch.randn(4, 16), torch.randn(8, 4)
    lora = parse_lora(
        {
            "lora_unet_x.lora_down.weight": down,
            "lora_unet_x.lora_up.weight": up,
            "lora_unet_x.alpha": torch.tensor(2.0),
        }
    )
    layer = lora.layers["lora_unet_x"]
    assert (layer.kind, layer.rank, layer.alpha, layer.scale) == ("lora", 4, 2.0, 0.5)
    torch.testing.assert_close(layer.weight_delta((8, 16)), 0.5 * up @ down, rtol=0, atol=0)
    assert lora.assumed_alpha == []


@pytest.mark.parametrize(
    "metadata, expected_alpha",
    [
        (
            {
                "lora_adapter_metadata": json.dumps(
                    {"unet.lora_alpha": 16, "unet.r": 4, "text_encoder.lora_alpha": 2}
                )
            },
            16.0,
        ),  # diffusers pipeline save: configs packed by component
        ({"lora_adapter_metadata": json.dumps({"lora_alpha": 12, "r": 4})}, 12.0),  # a single model's adapter
        ({"adapter_config": json.dumps({"lora_alpha": 6, "r": 4})}, 6.0),  # PEFT's adapter_config
        (
            {
                "lora_adapter_metadata": json.dumps(
                    {"unet.lora_alpha": 16, "unet.alpha_pattern": {"attn1.to_q": 3}}
                )
            },
            3.0,
        ),  # a per-module alpha
        ({"ss_network_alpha": "1.0"}, 1.0),  # kohya's training metadata
    ],
)
def test_peft_layers_take_alpha_from_the_metadata(metadata, expected_alpha):
    key = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    lora = parse_lora(
        {f"{key}.lora_A.weight": torch.randn(4, 16), f"{key}.lora_B.weight": torch.randn(8, 4)}, metadata
    )
    layer = lora.layers[key]
    assert layer.alpha == expected_alpha
    assert layer.scale == expected_alpha / 4
    assert lora.assumed_alpha == []


def test_rslora_metadata_scales_by_the_square_root_of_the_rank():
    key = "unet.conv_in"
    lora = parse_lora(
        {f"{key}.lora_A.weight": torch.randn(9, 4, 3, 3), f"{key}.lora_B.weight": torch.randn(8, 9, 1, 1)},
        {"lora_adapter_metadata": json.dumps({"lora_alpha": 6, "use_rslora": True})},
    )
    assert lora.layers[key].scale == pytest.approx(6 / math.sqrt(9))


def test_missing_alpha_is_assumed_to_be_the_rank_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.models.lora"):
        lora = parse_lora(
            {
                "unet.conv_in.lora_A.weight": torch.randn(4, 4, 3, 3),
                "unet.conv_in.lora_B.weight": torch.randn(8, 4, 1, 1),
            },
            {},
            "peft_no_alpha",
        )
    assert lora.layers["unet.conv_in"].scale == 1.0
    assert lora.assumed_alpha == ["unet.conv_in"]
    assert "peft_no_alpha" in caplog.text and "assuming alpha = rank" in caplog.text


def test_peft_adapter_names_and_old_attention_processor_keys_are_normalised():
    processor = "unet.mid_block.attentions.0.transformer_blocks.0.attn2.processor.to_out_lora"
    lora = parse_lora({
        f"{processor}.down.weight": torch.ones(2, 4),
        f"{processor}.up.weight": torch.ones(4, 2),
        "unet.conv_out.lora_A.default.weight": torch.ones(2, 4, 3, 3),
        "unet.conv_out.lora_B.default.weight": torch.ones(4, 2, 1, 1),
    })
    assert set(lora.layers) == {"unet.mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0",
                                "unet.conv_out"}


def test_loha_and_lokr_deltas_follow_their_closed_forms():
    g = torch.Generator().manual_seed(0)
    w = {
        name: torch.randn(shape, generator=g)
        for name, shape in {"w1_a": (6, 3), "w1_b": (3, 10), "w2_a": (6, 3), "w2_b": (3, 10)}.items()
    }
    loha = parse_lora({f"x.hada_{k}": v for k, v in w.items()} | {"x.alpha": torch.tensor(1.5)}).layers["x"]
    expected = (w["w1_a"] @ w["w1_b"]) * (w["w2_a"] @ w["w2_b"]) * (1.5 / 3)
    torch.testing.assert_close(loha.weight_delta((6, 10)), expected, rtol=1e-6, atol=1e-6)

    w1, w2_a, w2_b = (
        torch.randn(2, 5, generator=g),
        torch.randn(3, 2, generator=g),
        torch.randn(2, 4, generator=g),
    )
    lokr = parse_lora(
        {"y.lokr_w1": w1, "y.lokr_w2_a": w2_a, "y.lokr_w2_b": w2_b, "y.alpha": torch.tensor(1.0)}
    )
    layer = lokr.layers["y"]
    kron = torch.stack([torch.stack([w1[i, j] * (w2_a @ w2_b) for j in range(5)], 1) for i in range(2)])
    expected = kron.reshape(6, 20) * (1.0 / 2)  # rows i*3 + p, columns j*4 + q
    torch.testing.assert_close(layer.weight_delta((6, 20)), expected, rtol=1e-6, atol=1e-6)


def test_locon_with_a_tucker_core_equals_its_three_convolutions_in_sequence():
    g = torch.Generator().manual_seed(1)
    down, mid, up = (torch.randn(shape, generator=g) for shape in ((3, 5, 1, 1), (3, 3, 3, 3), (7, 3, 1, 1)))
    layer = parse_lora({"c.lora_down.weight": down, "c.lora_mid.weight": mid, "c.lora_up.weight": up,
                        "c.alpha": torch.tensor(1.5)}).layers["c"]
    x = torch.randn(2, 5, 9, 9, generator=g)
    expected = F.conv2d(F.conv2d(F.conv2d(x, down), mid, stride=2, padding=1), up) * (1.5 / 3)
    got = F.conv2d(x, layer.weight_delta((7, 5, 3, 3)), stride=2, padding=1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _kohya_pair(name: str, out_features: int, in_features: int, rank: int = 2) -> dict[str, torch.Tensor]:
    return {
        f"{name}.lora_down.weight": torch.randn(rank, in_features),
        f"{name}.lora_up.weight": torch.randn(out_features, rank),
        f"{name}.alpha": torch.tensor(1.0),
    }


def test_kohya_ldm_and_diffusers_names_and_peft_names_reach_the_same_module(sd1):
    model, clip = sd1
    q = model.unet.get_submodule("input_blocks.1.1.transformer_blocks.0.attn1.to_q").weight
    out, width = q.shape
    te_q = clip.encoders[0].get_submodule("text_model.encoder.layers.1.self_attn.q_proj").weight
    names = [
        "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q",
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q",
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
        "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q",
    ]
    tensors = {}
    for name in names:
        tensors |= _kohya_pair(name, out, width)
    tensors |= _kohya_pair("lora_te_text_model_encoder_layers_1_self_attn_q_proj", *te_q.shape)
    tensors |= _kohya_pair("text_encoder.text_model.encoder.layers.1.self_attn.q_proj", *te_q.shape)
    match = match_lora(parse_lora(tensors), model.unet, clip.encoders)
    assert match.unmatched == {}
    targets = {layer.name: target for target, layer in match.patches}
    assert {targets[n] for n in names} == {
        LoraTarget("unet", 0, "input_blocks.1.1.transformer_blocks.0.attn1.to_q")
    }
    assert (
        targets["lora_te_text_model_encoder_layers_1_self_attn_q_proj"]
        == targets["text_encoder.text_model.encoder.layers.1.self_attn.q_proj"]
        == LoraTarget("te", 0, "text_model.encoder.layers.1.self_attn.q_proj")
    )


def test_sdxl_second_encoder_q_k_v_map_to_row_slices_of_the_fused_in_proj(sdxl_te):
    bigg = sdxl_te.encoders[1]
    width = bigg.config.width
    tensors = {}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        tensors |= _kohya_pair(f"lora_te2_text_model_encoder_layers_0_self_attn_{proj}", width, width)
    tensors |= _kohya_pair("lora_te2_text_model_encoder_layers_1_mlp_fc1", bigg.config.intermediate, width)
    tensors |= _kohya_pair(
        "lora_te1_text_model_encoder_layers_0_mlp_fc2",
        sdxl_te.encoders[0].config.width,
        sdxl_te.encoders[0].config.intermediate,
    )
    match = match_lora(parse_lora(tensors), None, sdxl_te.encoders)
    assert match.unmatched == {}
    targets = {
        layer.name.removeprefix("lora_te2_text_model_encoder_layers_"): target
        for target, layer in match.patches
    }
    fused = "transformer.resblocks.0.attn"
    assert targets["0_self_attn_q_proj"] == LoraTarget(
        "te", 1, fused, "in_proj_weight", "in_proj_bias", (0, width)
    )
    assert targets["0_self_attn_k_proj"].rows == (width, 2 * width)
    assert targets["0_self_attn_v_proj"].rows == (2 * width, 3 * width)
    assert targets["0_self_attn_out_proj"] == LoraTarget("te", 1, f"{fused}.out_proj")
    assert targets["1_mlp_fc1"] == LoraTarget("te", 1, "transformer.resblocks.1.mlp.c_fc")
    assert targets["lora_te1_text_model_encoder_layers_0_mlp_fc2"] == LoraTarget(
        "te", 0, "text_model.encoder.layers.0.mlp.fc2"
    )


def test_unmatched_unreadable_and_misfit_keys_are_listed_and_logged(sd1, caplog):
    model, clip = sd1
    q = model.unet.get_submodule("input_blocks.1.1.transformer_blocks.0.attn1.to_q").weight
    tensors = _kohya_pair("lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q", *q.shape)
    tensors |= _kohya_pair("lora_unet_no_such_block_to_q", 8, 8)
    tensors |= _kohya_pair("lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k", 3, 5)  # wrong shape
    tensors["lora_unet_middle_block_1_proj_in.lora_down.weight"] = torch.randn(2, 8)  # no up
    tensors["lora_unet_out_2.dora_scale"] = torch.randn(4)
    tensors["lora_unet_out_2.something_else"] = torch.randn(4)
    with caplog.at_level(logging.WARNING, logger="engine.models.lora"):
        match = match_lora(parse_lora(tensors, name="messy.safetensors"), model.unet, clip.encoders)
    assert [layer.name for _, layer in match.patches] == [
        "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q"
    ]
    assert sorted(match.unmatched) == sorted(
        [f"lora_unet_no_such_block_to_q.{s}" for s in ("lora_down.weight", "lora_up.weight", "alpha")]
        + [
            f"lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k.{s}"
            for s in ("lora_down.weight", "lora_up.weight", "alpha")
        ]
        + [
            "lora_unet_middle_block_1_proj_in.lora_down.weight",
            "lora_unet_out_2.dora_scale",
            "lora_unet_out_2.something_else",
        ]
    )
    assert (
        "shape mismatch"
        in match.unmatched["lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k.alpha"]
    )
    assert "incomplete lora layer" in match.unmatched["lora_unet_middle_block_1_proj_in.lora_down.weight"]
    assert "messy.safetensors: 9 key(s) not applied" in caplog.text
    assert "lora_unet_no_such_block_to_q.lora_down.weight" in caplog.text


def test_a_file_without_adapter_layers_is_rejected_naming_its_tensors(tmp_path):
    path = tmp_path / "not_a_lora.safetensors"
    save_file({"model.diffusion_model.out.2.weight": torch.zeros(2)}, path)
    with pytest.raises(LoraFormatError, match="no adapter layers.*model.diffusion_model.out.2.weight"):
        read_lora(path)


@pytest.mark.parametrize("raw, reason", [("{nope", "invalid JSON"), ("[" * 5000, "nested deeper"),
                                         ('{"r": NaN}', "non-finite")])
def test_bad_adapter_metadata_is_a_clear_error(raw, reason):
    with pytest.raises(LoraFormatError, match="lora_adapter_metadata.*not valid JSON.*" + reason):
        parse_lora(
            {"a.lora_A.weight": torch.ones(1, 2), "a.lora_B.weight": torch.ones(2, 1)},
            {"lora_adapter_metadata": raw},
        )


def test_read_lora_reads_tensors_and_metadata_from_a_safetensors_file(tmp_path):
    path = tmp_path / "peft.safetensors"
    save_file(
        {
            "unet.conv_in.lora_A.weight": torch.randn(2, 4, 3, 3),
            "unet.conv_in.lora_B.weight": torch.randn(8, 2, 1, 1),
        },
        path,
        metadata={"lora_adapter_metadata": json.dumps({"unet.lora_alpha": 4, "unet.r": 2})},
    )
    lora = read_lora(path)
    assert lora.name == "peft.safetensors"
    assert lora.layers["unet.conv_in"].scale == 2.0

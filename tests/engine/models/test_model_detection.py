"""Detection from names and shapes: full-size families as shape tables, tiny written files, split files."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from engine.models.detect import ModelInfo, UnsupportedModelError, detect
from engine.models.formats import open_checkpoint
from engine.models.inspect import format_inspection, inspect_file

sys.path.insert(0, str(Path(__file__).parent))
from sd_checkpoints import (  # noqa: E402
    FAMILIES,
    TextSpec,
    UNetSpec,
    checkpoint_shapes,
    family_spec,
    text_shapes,
    unet_shapes,
    vae_shapes,
    write_checkpoint,
)


def meta_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}


# ---------------------------------------------------------------- the helper's layouts are the real ones

DIFFUSERS_UNETS = {  # diffusers UNet2DConditionModel configs of the released models
    "sd1": dict(cross_attention_dim=768, attention_head_dim=8),
    "sd2": dict(cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True),
    "sdxl": dict(
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10),
        cross_attention_dim=2048,
        attention_head_dim=(5, 10, 20),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    ),
    "sdxl_refiner": dict(
        block_out_channels=(384, 768, 1536, 1536),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=4,
        cross_attention_dim=1280,
        attention_head_dim=(6, 12, 24, 24),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2560,
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_helper_unet_layout_converts_to_the_diffusers_model_exactly(family):
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    with torch.device("meta"):
        model = UNet2DConditionModel(**DIFFUSERS_UNETS[family])
    converted = convert_ldm_unet_checkpoint(
        meta_tensors(unet_shapes(family_spec(family, "full").unet)), model.config
    )
    assert {k: tuple(v.shape) for k, v in converted.items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()
    }


def test_helper_vae_and_text_layouts_convert_to_the_diffusers_and_transformers_models_exactly():
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint, convert_open_clip_checkpoint
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    def shapes_of(state):
        return {k: tuple(v.shape) for k, v in state.items()}

    with torch.device("meta"):
        vae = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=2,
            latent_channels=4,
        )
        clip_l = CLIPTextModelWithProjection(
            CLIPTextConfig(
                hidden_size=768,
                num_hidden_layers=12,
                num_attention_heads=12,
                intermediate_size=3072,
                projection_dim=768,
            )
        )
        clip_g = CLIPTextModelWithProjection(
            CLIPTextConfig(
                hidden_size=1280,
                num_hidden_layers=32,
                num_attention_heads=20,
                intermediate_size=5120,
                projection_dim=1280,
                hidden_act="gelu",
            )
        )
    ldm_vae = meta_tensors(vae_shapes(family_spec("sd1", "full").vae))
    assert shapes_of(convert_ldm_vae_checkpoint(ldm_vae, vae.config)) == shapes_of(vae.state_dict())

    hf_l = dataclasses.replace(family_spec("sd1", "full").text[0], prefix="text_model.", projection_dim=768)
    expected_l = {k: v for k, v in shapes_of(clip_l.state_dict()).items() if not k.endswith("position_ids")}
    assert text_shapes(hf_l) == expected_l

    open_g = family_spec("sdxl", "full").text[1]
    prefix = "conditioner.embedders.1.model."
    converted = convert_open_clip_checkpoint(clip_g, meta_tensors(text_shapes(open_g)), prefix=prefix)
    expected_g = {k: v for k, v in shapes_of(clip_g.state_dict()).items() if not k.endswith("position_ids")}
    assert shapes_of(converted) == expected_g


def test_helper_full_sizes_have_the_parameter_counts_read_from_the_released_files():
    # reference/003 measured these from the headers of v1-5-pruned-emaonly and SDXL base 1.0
    assert (
        sum(torch.Size(s).numel() for s in unet_shapes(family_spec("sd1", "full").unet).values())
        == 859_520_964
    )
    assert (
        sum(torch.Size(s).numel() for s in unet_shapes(family_spec("sdxl", "full").unet).values())
        == 2_567_463_684
    )


# ---------------------------------------------------------------- full-size families (shapes only)

# The LDM/SGM inference yamls: v1-inference, v2-inference(-v), sd_xl_base, sd_xl_refiner.
EXPECTED_UNETS = {
    "sd1": dict(
        model_channels=320,
        channel_mult=(1, 2, 4, 4),
        num_res_blocks=2,
        attention_levels=(0, 1, 2),
        transformer_depth=(1, 1, 1, 0),
        transformer_depth_middle=1,
        num_heads=8,
        num_head_channels=-1,
        context_dim=768,
        use_linear_in_transformer=False,
        adm_in_channels=None,
        num_classes=None,
    ),
    "sd2": dict(
        model_channels=320,
        channel_mult=(1, 2, 4, 4),
        num_res_blocks=2,
        attention_levels=(0, 1, 2),
        transformer_depth=(1, 1, 1, 0),
        transformer_depth_middle=1,
        num_heads=-1,
        num_head_channels=64,
        context_dim=1024,
        use_linear_in_transformer=True,
        adm_in_channels=None,
        num_classes=None,
    ),
    "sdxl": dict(
        model_channels=320,
        channel_mult=(1, 2, 4),
        num_res_blocks=2,
        attention_levels=(1, 2),
        transformer_depth=(0, 2, 10),
        transformer_depth_middle=10,
        num_heads=-1,
        num_head_channels=64,
        context_dim=2048,
        use_linear_in_transformer=True,
        adm_in_channels=2816,
        num_classes="sequential",
    ),
    "sdxl_refiner": dict(
        model_channels=384,
        channel_mult=(1, 2, 4, 4),
        num_res_blocks=2,
        attention_levels=(1, 2),
        transformer_depth=(0, 4, 4, 0),
        transformer_depth_middle=4,
        num_heads=-1,
        num_head_channels=64,
        context_dim=1280,
        use_linear_in_transformer=True,
        adm_in_channels=2560,
        num_classes="sequential",
    ),
}
EXPECTED_TEXT = {  # kind, width, layers, heads, intermediate, projection, activation, prefix, layout
    "sd1": [
        ("clip_l", 768, 12, 12, 3072, None, "quick_gelu", "cond_stage_model.transformer.text_model.", "hf")
    ],
    "sd2": [("openclip_h", 1024, 24, 16, 4096, 1024, "gelu", "cond_stage_model.model.", "open_clip")],
    "sdxl": [
        (
            "clip_l",
            768,
            12,
            12,
            3072,
            None,
            "quick_gelu",
            "conditioner.embedders.0.transformer.text_model.",
            "hf",
        ),
        ("openclip_g", 1280, 32, 20, 5120, 1280, "gelu", "conditioner.embedders.1.model.", "open_clip"),
    ],
    "sdxl_refiner": [
        ("openclip_g", 1280, 32, 20, 5120, 1280, "gelu", "conditioner.embedders.0.model.", "open_clip")
    ],
}
EXPECTED_TE_ROOT = {
    "sd1": "cond_stage_model.",
    "sd2": "cond_stage_model.",
    "sdxl": "conditioner.",
    "sdxl_refiner": "conditioner.",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_full_size_single_file_is_detected_with_the_released_configs(family):
    info = detect(meta_tensors(checkpoint_shapes(family, "full")))
    assert (info.family, info.layout) == (family, family)
    assert info.components == {
        "diffusion": "model.diffusion_model.",
        "te": EXPECTED_TE_ROOT[family],
        "vae": "first_stage_model.",
    }
    unet = dataclasses.asdict(info.unet)
    assert {k: unet[k] for k in EXPECTED_UNETS[family]} == EXPECTED_UNETS[family]
    assert (unet["in_channels"], unet["out_channels"], unet["prediction"], unet["family"]) == (
        4,
        4,
        "eps",
        family,
    )
    assert dataclasses.asdict(info.vae) == dict(
        in_channels=3,
        out_ch=3,
        z_channels=4,
        embed_dim=4,
        ch=128,
        ch_mult=(1, 2, 4, 4),
        num_res_blocks=2,
        resolution=256,
        attn_resolutions=(),
        shift_factor=0.0,
        scale_factor=0.13025 if family.startswith("sdxl") else 0.18215,
        use_quant_conv=True,
    )
    assert [
        (
            t.kind,
            t.width,
            t.layers,
            t.heads,
            t.intermediate,
            t.projection_dim,
            t.activation,
            t.key_prefix,
            t.layout,
        )
        for t in info.text_encoders
    ] == EXPECTED_TEXT[family]
    assert all((t.vocab_size, t.max_positions) == (49408, 77) for t in info.text_encoders)
    assert info.unassigned.tensors == 0


def test_component_statistics_count_parameters_bytes_and_dtypes():
    shapes = checkpoint_shapes("sd1", "full")
    tensors = {k: torch.empty(s, device="meta", dtype=torch.float16) for k, s in shapes.items()}
    tensors["model_ema.decay"] = torch.empty((), device="meta")
    info = detect(tensors)
    assert info.stats["diffusion"].parameters == 859_520_964
    assert info.stats["diffusion"].bytes == 2 * 859_520_964
    assert info.stats["diffusion"].dtypes == {"F16": len([k for k in shapes if k.startswith("model.")])}
    assert sum(s.parameters for s in info.stats.values()) == sum(
        torch.Size(s).numel() for s in shapes.values()
    )
    assert (info.unassigned.tensors, info.unassigned_examples) == (1, ["model_ema.decay"])


# ---------------------------------------------------------------- prediction


@pytest.mark.parametrize(
    "metadata, extra_key, expected",
    [
        ({}, None, "eps"),
        ({"prediction_type": "v"}, None, "v"),
        ({"modelspec.prediction_type": "v_prediction"}, None, "v"),
        ({"sluice.prediction": "epsilon"}, None, "eps"),
        ({}, "v_pred", "v"),
        ({}, "v_prediction", "v"),
    ],
)
def test_sd2_v_prediction_comes_from_what_the_file_says(metadata, extra_key, expected):
    shapes = checkpoint_shapes("sd2", "full")
    if extra_key:
        shapes[extra_key] = ()
    assert detect(shapes, metadata=metadata).unet.prediction == expected


def test_unknown_prediction_hint_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="prediction_type='x0'; accepted: v, v_prediction, eps"):
        detect(checkpoint_shapes("sd2", "full", ("diffusion",)), metadata={"prediction_type": "x0"})


def test_v_prediction_hint_is_read_from_a_written_file(tmp_path):
    path = tmp_path / "sd2v.safetensors"
    write_checkpoint(path, "sd2", components=("diffusion",), metadata={"modelspec.prediction_type": "v"})
    with open_checkpoint(path) as reader:
        assert detect(reader).unet.prediction == "v"


# ---------------------------------------------------------------- custom sizes, split files, written files


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_written_checkpoint_is_sd_custom_with_the_configs_it_was_built_from(tmp_path, family):
    spec = family_spec(family, "tiny")
    path = tmp_path / f"{family}.safetensors"
    tensors = write_checkpoint(path, family)
    with open_checkpoint(path) as reader:
        info = detect(reader)
    assert (info.family, info.layout) == ("sd_custom", family)
    u = info.unet
    assert (
        u.model_channels,
        u.channel_mult,
        u.num_res_blocks,
        u.transformer_depth,
        u.transformer_depth_middle,
        u.context_dim,
        u.use_linear_in_transformer,
        u.adm_in_channels,
    ) == (
        spec.unet.model_channels,
        spec.unet.channel_mult,
        spec.unet.num_res_blocks,
        spec.unet.transformer_depth,
        spec.unet.transformer_depth_middle,
        spec.unet.context_dim,
        spec.unet.use_linear,
        spec.unet.adm_in_channels,
    )
    assert (info.vae.ch, info.vae.ch_mult, info.vae.num_res_blocks) == (
        spec.vae.ch,
        spec.vae.ch_mult,
        spec.vae.num_res_blocks,
    )
    assert [
        (t.width, t.layers, t.intermediate, t.projection_dim, t.key_prefix) for t in info.text_encoders
    ] == [(t.width, t.layers, t.intermediate, t.projection_dim, t.prefix) for t in spec.text]
    assert sum(s.parameters for s in info.stats.values()) == sum(t.numel() for t in tensors.values())
    assert sum(s.bytes for s in info.stats.values()) == sum(t.numel() * 4 for t in tensors.values())


def test_custom_unet_with_uneven_levels_is_detected_from_its_shapes():
    spec = UNetSpec(
        model_channels=32,
        channel_mult=(1, 2, 3),
        num_res_blocks=1,
        transformer_depth=(1, 3, 0),
        transformer_depth_middle=2,
        context_dim=48,
        use_linear=False,
        adm_in_channels=None,
        in_channels=9,
        out_channels=8,
    )
    u = detect(unet_shapes(spec, "")).unet
    assert (
        u.family,
        u.in_channels,
        u.out_channels,
        u.channel_mult,
        u.attention_levels,
        u.transformer_depth,
        u.transformer_depth_middle,
        u.context_dim,
        u.num_heads,
        u.num_head_channels,
    ) == ("sd_custom", 9, 8, (1, 2, 3), (0, 1), (1, 3, 0), 2, 48, 8, -1)


def test_inpainting_unet_keeps_its_family():
    spec = dataclasses.replace(family_spec("sd1", "full").unet, in_channels=9)
    info = detect(unet_shapes(spec))
    assert (info.family, info.unet.in_channels) == ("sd1", 9)


def test_head_count_hints_in_metadata_override_the_rule():
    shapes = checkpoint_shapes("sd2", "tiny", ("diffusion",))
    assert (
        detect(shapes, metadata={"sluice.num_heads": "4"}).unet.num_heads,
        detect(shapes, metadata={"sluice.num_head_channels": "16"}).unet.num_head_channels,
    ) == (4, 16)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("component", ["diffusion", "te", "vae"])
def test_split_files_report_their_component_and_prefix(family, component):
    info = detect(checkpoint_shapes(family, "full", (component,)))
    assert list(info.components) == [component]
    expected_prefix = "conditioner." if (component, family) == ("te", "sdxl") else ""
    assert info.components[component] == expected_prefix
    assert info.family == ("vae" if component == "vae" else family)
    assert info.unassigned.tensors == 0


def test_hf_text_encoder_file_with_projection_is_read_as_its_kind():
    clip_g = TextSpec(
        "hf", "text_model.", 1280, 32, 5120, projection_dim=1280
    )  # ComfyUI's clip_g.safetensors
    info = detect(text_shapes(clip_g))
    (text,) = info.text_encoders
    assert (info.family, text.kind, text.projection_dim, text.activation, text.heads, text.layout) == (
        "sdxl_refiner",
        "openclip_g",
        1280,
        "gelu",
        20,
        "hf",
    )


@pytest.mark.parametrize("fmt", ["ckpt", "gguf"])
def test_every_format_gives_the_same_detection(tmp_path, fmt):
    reference, path = tmp_path / "ref.safetensors", tmp_path / f"m.{fmt}"
    write_checkpoint(reference, "sd1", dtype=torch.float16)
    write_checkpoint(path, "sd1", fmt=fmt, dtype=torch.float16)
    with open_checkpoint(reference) as a, open_checkpoint(path) as b:
        assert detect(a) == detect(b)


# ---------------------------------------------------------------- rejection


def test_non_sd_file_is_rejected_with_what_it_holds():
    shapes = {f"joint_blocks.{i}.x_block.attn.qkv.weight": (4608, 1536) for i in range(24)} | {
        "x_embedder.proj.weight": (1536, 16, 2, 2)
    }
    with pytest.raises(UnsupportedModelError) as caught:
        detect(shapes)
    message = str(caught.value)
    assert "holds no SD1.x/SD2.x/SDXL component" in message
    assert "joint_blocks.N (24), x_embedder.proj (1)" in message and "looks like SD3" in message


def test_incomplete_flux_file_is_rejected_naming_what_is_missing():
    shapes = {f"double_blocks.{i}.img_attn.qkv.weight": (9216, 3072) for i in range(19)} | {
        "img_in.weight": (3072, 64)
    }
    with pytest.raises(UnsupportedModelError, match=r"state dict: a FLUX file needs 'txt_in.weight'"):
        detect(shapes)


def test_incomplete_unet_is_rejected_naming_what_is_missing():
    shapes = {
        k: v
        for k, v in checkpoint_shapes("sd1", "full", ("diffusion",)).items()
        if not k.startswith("output_blocks.11.")
    }
    with pytest.raises(UnsupportedModelError, match="11 output blocks; .* call for 12"):
        detect(shapes)


def test_detect_refuses_an_unknown_source_type():
    with pytest.raises(TypeError, match="CheckpointReader or a mapping"):
        detect(["input_blocks.0.0.weight"])


# ---------------------------------------------------------------- inspect


def test_inspect_file_reports_configs_and_sizes_as_plain_data(tmp_path):
    path = tmp_path / "xl.safetensors"
    tensors = write_checkpoint(path, "sdxl", dtype=torch.bfloat16, metadata={"prediction_type": "v"})
    info = inspect_file(path)
    assert json.loads(json.dumps(info))["family"] == "sd_custom"
    assert (info["format"], info["layout"], info["unet"]["prediction"]) == ("safetensors", "sdxl", "v")
    assert info["total_parameters"] == sum(t.numel() for t in tensors.values())
    assert info["total_bytes"] == 2 * info["total_parameters"]
    assert info["stats"]["te"]["dtypes"] == {
        "BF16": len([k for k in tensors if k.startswith("conditioner.")])
    }
    text = format_inspection(info)
    for expected in (
        "family      sd_custom (layout sdxl)",
        "diffusion  model.diffusion_model.",
        "text encoder 1 (openclip_g)",
        "prediction_type",
        "BF16 x",
    ):
        assert expected in text


def test_model_info_round_trips_to_a_dict():
    info = detect(checkpoint_shapes("sd1", "tiny"))
    assert isinstance(info, ModelInfo) and info.to_dict()["unet"]["model_channels"] == 64


def test_the_unet_presets_are_defined_once_and_detection_compares_with_them():
    from engine.models import detect as detect_module
    from engine.models import unet

    for name in ("sd15_unet_config", "sd21_unet_config", "sdxl_unet_config", "sdxl_refiner_unet_config"):
        preset = getattr(detect_module, name)
        assert getattr(unet, name) is preset and preset.__module__ == "engine.models.detect"
    assert set(detect_module.UNET_PRESETS.values()) <= {getattr(detect_module, n) for n in dir(detect_module)
                                                        if n.endswith("_unet_config")}

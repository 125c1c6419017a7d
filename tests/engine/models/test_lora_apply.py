"""Applying LoRAs to a tiny random SD1 (and an SD2 text encoder): merged weights against
W + s * alpha/rank * up@down computed here, merge against runtime outputs, PEFT-with-metadata against kohya,
exact restoration, stacking, and open_clip's fused q, k, v against an unfused encoder patched by hand."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from engine.models.clip import CLIPTextModel
from engine.models.loader import load_checkpoint
from engine.models.lora import parse_lora, read_lora
from engine.models.lora_apply import apply_lora, remove_loras, resolve_mode

sys.path.insert(0, str(Path(__file__).parent))
from sd_checkpoints import write_checkpoint  # noqa: E402

RANK, ALPHA = 4, 2.0  # scale alpha / rank = 0.5
UNET_TARGETS = (
    "input_blocks.1.1.transformer_blocks.0.attn1.to_q",  # Linear
    "input_blocks.1.1.transformer_blocks.0.attn2.to_k",  # Linear over the text context
    "middle_block.1.transformer_blocks.0.attn1.to_out.0",  # Linear with a bias
    "input_blocks.1.1.proj_in",  # 1x1 convolution (SD1)
    "input_blocks.1.0.in_layers.2",  # 3x3 convolution: LoCon
    "input_blocks.2.0.op",  # stride-2 3x3 convolution: LoCon
    "output_blocks.1.0.skip_connection",
)
TE_TARGETS = ("text_model.encoder.layers.0.self_attn.q_proj", "text_model.encoder.layers.1.mlp.fc1")
MERGE_VS_RUNTIME = {"rtol": 1e-5, "atol": 1e-5}  # float32, same terms summed in another order


@pytest.fixture(scope="module")
def sd1(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("ckpt") / "sd1.safetensors"
    write_checkpoint(path, "sd1", size="tiny", seed=3)
    model, clip, _ = load_checkpoint(path, components=("diffusion", "te"))
    return model, clip


def random_pair(module: nn.Module, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(down, up) for a Linear ([r, in], [out, r]) or a convolution ([r, in, kh, kw], [out, r, 1, 1])."""
    weight = module.weight
    down = torch.randn(RANK, *weight.shape[1:], generator=generator) * 0.2
    up = torch.randn(weight.shape[0], RANK, *(1,) * (weight.ndim - 2), generator=generator) * 0.2
    return down, up


def random_pairs(model, clip, seed: int) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    pairs = {("unet", name): random_pair(model.unet.get_submodule(name), generator) for name in UNET_TARGETS}
    pairs |= {
        ("te", name): random_pair(clip.encoders[0].get_submodule(name), generator) for name in TE_TARGETS
    }
    return pairs


def kohya_tensors(pairs) -> dict[str, torch.Tensor]:
    tensors = {}
    for (component, name), (down, up) in pairs.items():
        key = ("lora_unet_" if component == "unet" else "lora_te_") + name.replace(".", "_")
        tensors |= {
            f"{key}.lora_down.weight": down,
            f"{key}.lora_up.weight": up,
            f"{key}.alpha": torch.tensor(ALPHA),
        }
    return tensors


def hand_merged(base: torch.Tensor, pairs_and_strengths) -> torch.Tensor:
    """W + sum(strength * alpha / rank * up @ down), written out here as the independent reference."""
    result = base.clone()
    for (down, up), strength in pairs_and_strengths:
        result += strength * (ALPHA / RANK) * (up.flatten(1) @ down.flatten(1)).reshape(base.shape)
    return result


def unet_output(model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=generator)
    context = torch.randn(2, 5, model.unet.config.context_dim, generator=generator)
    return model.apply(x, torch.tensor([999.0, 300.0]), context)


def te_output(clip) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 49407, (2, 77), generator=torch.Generator().manual_seed(1))
    tokens[:, 10] = 49407
    with torch.no_grad():
        return clip.encoders[0](tokens, return_pooled=True)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def assert_state_equal(module: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = module.state_dict()
    assert state.keys() == expected.keys()
    assert [name for name in state if not torch.equal(state[name], expected[name])] == []


def test_merge_gives_the_hand_computed_weights_and_leaves_the_base_untouched(sd1):
    model, clip = sd1
    base_unet, base_te = snapshot(model.unet), snapshot(clip.encoders[0])
    pairs = random_pairs(model, clip, seed=1)
    applied = apply_lora(model, clip, parse_lora(kohya_tensors(pairs)), 0.8, -1.5, mode="merge")
    assert applied.modes == {"unet": "merge", "te0": "merge"} and applied.match.unmatched == {}
    for (component, name), pair in pairs.items():
        patched = (applied.model.unet if component == "unet" else applied.clip.encoders[0]).get_submodule(
            name
        )
        base = (model.unet if component == "unet" else clip.encoders[0]).get_submodule(name)
        strength = 0.8 if component == "unet" else -1.5
        torch.testing.assert_close(
            patched.weight, hand_merged(base.weight, [(pair, strength)]), rtol=1e-6, atol=1e-6
        )
    untouched = "input_blocks.1.1.transformer_blocks.0.attn1.to_v.weight"
    assert applied.model.unet.get_parameter(untouched) is model.unet.get_parameter(untouched)
    assert_state_equal(model.unet, base_unet)
    assert_state_equal(clip.encoders[0], base_te)
    assert applied.model.options["loras"] == (("lora", 0.8, "merge"),) and "loras" not in model.options


def test_merge_and_runtime_give_the_same_unet_and_text_encoder_outputs(sd1):
    model, clip = sd1
    tensors = kohya_tensors(random_pairs(model, clip, seed=2))
    generator = torch.Generator().manual_seed(5)  # a LoHa layer: the runtime branch uses its whole delta
    ff = "lora_unet_output_blocks_0_1_transformer_blocks_0_ff_net_2"
    out_features, in_features = model.unet.get_submodule(
        "output_blocks.0.1.transformer_blocks.0.ff.net.2"
    ).weight.shape
    tensors |= {
        f"{ff}.hada_w1_a": torch.randn(out_features, 2, generator=generator) * 0.3,
        f"{ff}.hada_w1_b": torch.randn(2, in_features, generator=generator) * 0.3,
        f"{ff}.hada_w2_a": torch.randn(out_features, 2, generator=generator) * 0.3,
        f"{ff}.hada_w2_b": torch.randn(2, in_features, generator=generator) * 0.3,
    }
    conv = "lora_unet_output_blocks_0_0_in_layers_2"  # LoCon with a Tucker core: a whole-delta branch too
    out_channels, in_channels = model.unet.get_submodule("output_blocks.0.0.in_layers.2").weight.shape[:2]
    tensors |= {
        f"{conv}.lora_down.weight": torch.randn(3, in_channels, 1, 1, generator=generator) * 0.2,
        f"{conv}.lora_mid.weight": torch.randn(3, 3, 3, 3, generator=generator) * 0.2,
        f"{conv}.lora_up.weight": torch.randn(out_channels, 3, 1, 1, generator=generator) * 0.2,
    }
    lora = parse_lora(tensors)
    merged = apply_lora(model, clip, lora, 1.3, 0.7, mode="merge")
    runtime = apply_lora(model, clip, lora, 1.3, 0.7, mode="runtime")
    assert runtime.modes == {"unet": "runtime", "te0": "runtime"}
    assert all(
        torch.equal(p, q)
        for p, q in zip(runtime.model.unet.parameters(), model.unet.parameters(), strict=True)
    )  # runtime leaves every weight as it was
    base_out, merged_out, runtime_out = (
        unet_output(model),
        unet_output(merged.model),
        unet_output(runtime.model),
    )
    assert (merged_out - base_out).abs().max() > 1e-2  # the LoRA changes the prediction
    torch.testing.assert_close(runtime_out, merged_out, **MERGE_VS_RUNTIME)
    for got, expected in zip(te_output(runtime.clip), te_output(merged.clip), strict=True):
        torch.testing.assert_close(got, expected, **MERGE_VS_RUNTIME)
    assert not torch.allclose(te_output(merged.clip)[0], te_output(clip)[0])
    assert not model.unet._forward_hooks and all(not m._forward_hooks for m in model.unet.modules())


def diffusers_names(unet) -> dict[str, str]:
    """Our module name -> diffusers module name, from diffusers' own converter (tensor identities)."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    state = {key: torch.empty(1) for key in unet.state_dict()}
    names = {id(value): key for key, value in state.items()}
    config = {
        "layers_per_block": 1,
        "class_embed_type": None,
        "num_class_embeds": None,
        "addition_embed_type": None,
    }
    converted = convert_ldm_unet_checkpoint(
        {"model.diffusion_model." + k: v for k, v in state.items()}, config
    )
    return {
        names[id(v)].removesuffix(".weight"): k.removesuffix(".weight")
        for k, v in converted.items()
        if id(v) in names and k.endswith(".weight")
    }


def test_peft_file_with_alpha_in_metadata_patches_exactly_like_the_kohya_file(sd1, tmp_path):
    model, clip = sd1
    pairs = random_pairs(model, clip, seed=3)
    to_diffusers = diffusers_names(model.unet)
    peft = {}
    for (component, name), (down, up) in pairs.items():
        key = f"unet.{to_diffusers[name]}" if component == "unet" else f"text_encoder.{name}"
        peft |= {f"{key}.lora_A.weight": down, f"{key}.lora_B.weight": up}
    metadata = {
        "unet.lora_alpha": ALPHA,
        "unet.r": RANK,
        "text_encoder.lora_alpha": ALPHA,
        "text_encoder.r": RANK,
    }
    save_file(peft, tmp_path / "peft.safetensors", metadata={"lora_adapter_metadata": json.dumps(metadata)})
    save_file(kohya_tensors(pairs), tmp_path / "kohya.safetensors")
    from_peft = apply_lora(model, clip, read_lora(tmp_path / "peft.safetensors"), 0.9, 1.1)
    from_kohya = apply_lora(model, clip, read_lora(tmp_path / "kohya.safetensors"), 0.9, 1.1)
    assert from_peft.match.unmatched == {} and len(from_peft.match.patches) == len(pairs)
    assert_state_equal(from_peft.model.unet, snapshot(from_kohya.model.unet))
    assert_state_equal(from_peft.clip.encoders[0], snapshot(from_kohya.clip.encoders[0]))
    assert not torch.equal(
        from_peft.model.unet.input_blocks[1][1].proj_in.weight, model.unet.input_blocks[1][1].proj_in.weight
    )


def test_strength_zero_and_removal_restore_the_base_bit_exactly(sd1):
    model, clip = sd1
    lora = parse_lora(kohya_tensors(random_pairs(model, clip, seed=4)))
    base_state, base_out, base_te = snapshot(model.unet), unet_output(model), te_output(clip)
    zero = apply_lora(model, clip, lora, 0.0, 0.0)
    assert zero.model.unet is model.unet and zero.clip is clip
    assert torch.equal(unet_output(zero.model), base_out)

    for mode in ("merge", "runtime"):
        patched = apply_lora(model, clip, lora, 1.0, 1.0, mode=mode)
        restored_model, restored_clip = remove_loras(patched.model, patched.clip)
        assert_state_equal(restored_model.unet, base_state)
        assert torch.equal(unet_output(restored_model), base_out)
        assert all(torch.equal(a, b) for a, b in zip(te_output(restored_clip), base_te, strict=True))
        assert "loras" not in restored_model.options

    # A strength changed on the patched model is the LoRA applied afresh to the base at that strength.
    once = apply_lora(model, clip, lora, 1.0, 1.0).model
    changed = apply_lora(remove_loras(once)[0], None, lora, 0.5).model
    fresh = apply_lora(model, None, lora, 0.5).model
    assert_state_equal(changed.unet, snapshot(fresh.unet))


def test_stacked_loras_add_up_in_either_order(sd1):
    model, clip = sd1
    pairs_a, pairs_b = random_pairs(model, clip, seed=5), random_pairs(model, clip, seed=6)
    lora_a, lora_b = (
        parse_lora(kohya_tensors(pairs_a), name="a"),
        parse_lora(kohya_tensors(pairs_b), name="b"),
    )
    a_then_b = apply_lora(apply_lora(model, clip, lora_a, 0.7, 1.0).model, None, lora_b, -0.4).model
    b_then_a = apply_lora(apply_lora(model, clip, lora_b, -0.4, 1.0).model, None, lora_a, 0.7).model
    assert a_then_b.options["loras"] == (("a", 0.7, "merge"), ("b", -0.4, "merge"))
    for name in UNET_TARGETS:
        expected = hand_merged(
            model.unet.get_submodule(name).weight,
            [(pairs_a["unet", name], 0.7), (pairs_b["unet", name], -0.4)],
        )
        torch.testing.assert_close(a_then_b.unet.get_submodule(name).weight, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b_then_a.unet.get_submodule(name).weight, expected, rtol=1e-6, atol=1e-6)
    mixed = apply_lora(apply_lora(model, None, lora_a, 0.7, mode="runtime").model, None, lora_b, -0.4).model
    torch.testing.assert_close(unet_output(mixed), unet_output(a_then_b), **MERGE_VS_RUNTIME)


def unfused_reference(encoder: CLIPTextModel) -> CLIPTextModel:
    """The open_clip encoder's weights renamed by hand into the hf layout (in_proj split into q, k, v)."""
    width, state = encoder.config.width, encoder.state_dict()
    hf = {
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].T,
    }
    for n in range(encoder.config.layers):
        ours, theirs = f"transformer.resblocks.{n}.", f"text_model.encoder.layers.{n}."
        for slot, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            hf[f"{theirs}self_attn.{proj}.weight"] = state[f"{ours}attn.in_proj_weight"][
                slot * width : (slot + 1) * width
            ]
            hf[f"{theirs}self_attn.{proj}.bias"] = state[f"{ours}attn.in_proj_bias"][
                slot * width : (slot + 1) * width
            ]
        for mine, other in (
            ("attn.out_proj", "self_attn.out_proj"),
            ("ln_1", "layer_norm1"),
            ("ln_2", "layer_norm2"),
            ("mlp.c_fc", "mlp.fc1"),
            ("mlp.c_proj", "mlp.fc2"),
        ):
            for param in ("weight", "bias"):
                hf[f"{theirs}{other}.{param}"] = state[f"{ours}{mine}.{param}"]
    reference = CLIPTextModel(encoder.config, layout="hf", device="meta")
    reference.load_state_dict({k: v.clone() for k, v in hf.items()}, assign=True)
    return reference


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_fused_qkv_lora_on_open_clip_equals_q_k_v_deltas_on_an_unfused_encoder(tmp_path, mode):
    path = tmp_path / "sd2_te.safetensors"
    write_checkpoint(path, "sd2", size="tiny", components=("te",), seed=7)
    clip = load_checkpoint(path, components=("te",))[1]
    encoder = clip.encoders[0]
    reference = unfused_reference(encoder)
    generator = torch.Generator().manual_seed(8)
    tensors = {}
    for n in range(encoder.config.layers):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            name = f"text_model.encoder.layers.{n}.self_attn.{proj}"
            down, up = random_pair(reference.get_submodule(name), generator)
            tensors |= {
                f"lora_te_{name.replace('.', '_')}.lora_down.weight": down,
                f"lora_te_{name.replace('.', '_')}.lora_up.weight": up,
                f"lora_te_{name.replace('.', '_')}.alpha": torch.tensor(ALPHA),
            }
            weight = reference.get_submodule(name).weight
            weight.data = hand_merged(weight.data, [((down, up), 1.2)])
    patched = apply_lora(None, clip, parse_lora(tensors), 0.0, 1.2, mode=mode).clip.encoders[0]
    tokens = torch.randint(0, 49407, (2, 77), generator=generator)
    with torch.no_grad():
        got, expected = patched(tokens, return_pooled=True), reference(tokens, return_pooled=True)
        base = encoder(tokens, return_pooled=True)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[0], base[0], atol=1e-3)


def test_auto_mode_runs_at_runtime_when_weights_cannot_be_rewritten(sd1):
    model, clip = sd1
    lora = parse_lora(kohya_tensors(random_pairs(model, clip, seed=9)))
    on_disk = dataclasses.replace(model, params_location="disk")
    assert apply_lora(model, None, lora).modes == {"unet": "merge"}
    applied = apply_lora(on_disk, None, lora)
    assert applied.modes == {"unet": "runtime"}
    torch.testing.assert_close(
        unet_output(applied.model), unet_output(apply_lora(model, None, lora).model), **MERGE_VS_RUNTIME
    )
    with pytest.raises(ValueError, match="re-read from disk; use mode 'runtime' or 'auto'"):
        apply_lora(on_disk, None, lora, mode="merge")

    quantised = nn.Sequential(nn.Linear(4, 4))
    quantised[0].weight = nn.Parameter(
        quantised[0].weight.detach().to(torch.float8_e4m3fn), requires_grad=False
    )
    target = parse_lora({"0.lora_A.weight": torch.ones(1, 4), "0.lora_B.weight": torch.ones(4, 1)})
    from engine.models.lora import LoraTarget

    assert resolve_mode("auto", quantised, [LoraTarget("unet", 0, "0")]) == "runtime"
    assert target.layers["0"].rank == 1
    with pytest.raises(ValueError, match="unknown LoRA apply mode 'merged'; accepted: auto, merge, runtime"):
        apply_lora(model, None, lora, mode="merged")


def test_sdxl_text_encoders_take_te1_and_te2_loras_and_encode_alike_in_both_modes(tmp_path):
    path = tmp_path / "sdxl_te.safetensors"
    write_checkpoint(path, "sdxl", size="tiny", components=("te",), seed=11)
    clip = load_checkpoint(path, components=("te",))[1]
    generator = torch.Generator().manual_seed(12)
    tensors = {}
    for prefix, encoder in (("lora_te1_", clip.encoders[0]), ("lora_te2_", clip.encoders[1])):
        width = encoder.config.width
        for proj in ("q_proj", "v_proj"):
            key = f"{prefix}text_model_encoder_layers_0_self_attn_{proj}"  # SDXL reads the penultimate layer
            tensors |= {
                f"{key}.lora_down.weight": torch.randn(RANK, width, generator=generator) * 0.3,
                f"{key}.lora_up.weight": torch.randn(width, RANK, generator=generator) * 0.3,
            }
    lora = parse_lora(tensors)
    merged = apply_lora(None, clip, lora, 0.0, 1.0, mode="merge")
    runtime = apply_lora(None, clip, lora, 0.0, 1.0, mode="runtime")
    assert merged.modes == {"te0": "merge", "te1": "merge"} and merged.match.unmatched == {}
    [[base_context, base_extras]] = clip.encode("a red fox")
    [[merged_context, merged_extras]] = merged.clip.encode("a red fox")
    [[runtime_context, runtime_extras]] = runtime.clip.encode("a red fox")
    torch.testing.assert_close(runtime_context, merged_context, **MERGE_VS_RUNTIME)
    torch.testing.assert_close(runtime_extras["pooled_output"], merged_extras["pooled_output"],
                               **MERGE_VS_RUNTIME)
    width_l = clip.encoders[0].config.width  # the context is [CLIP-L | bigG]: both halves change
    assert (merged_context[..., :width_l] - base_context[..., :width_l]).abs().max() > 1e-3
    assert (merged_context[..., width_l:] - base_context[..., width_l:]).abs().max() > 1e-3

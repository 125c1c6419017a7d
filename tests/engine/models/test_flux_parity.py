"""engine.models.flux against diffusers' FluxTransformer2DModel, with weights converted both ways.

One direction converts a random diffusers model's state dict with our flux_keys; the other converts our
model's BFL state dict with diffusers' own single-file converter (convert_flux_transformer_checkpoint_to_
diffusers), so a wrong key, split or swap shows up as a conversion failure or an output mismatch. The
diffusers model is called as FluxPipeline calls it: packed tokens, txt_ids zeros, img_ids (0, row, col).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.loaders import single_file_utils
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

from engine.models.flux import (
    FluxConfig,
    FluxTransformer,
    flux_axes_dim,
    flux_config_from_shapes,
    flux_dev_config,
    flux_schnell_config,
)
from engine.models.flux_keys import BFL_PREFIX, diffusers_flux_getter, diffusers_flux_shapes
from engine.models.staged import run_stages

PARITY_TOLERANCE = 1e-5  # relative L2 error in float32
HEAD_DIM, HEADS = 32, 2
FULL_HIDDEN, FULL_MLP = 3072, 12288  # the widths diffusers' converter assumes for the single blocks


def tiny_config(guidance_embed: bool) -> FluxConfig:
    return FluxConfig(in_channels=16, out_channels=16, vec_in_dim=16, context_in_dim=32,
                      hidden_size=HEADS * HEAD_DIM, mlp_ratio=4.0, num_heads=HEADS, depth=2,
                      depth_single_blocks=2, axes_dim=flux_axes_dim(HEAD_DIM), guidance_embed=guidance_embed)


def diffusers_model(config: FluxConfig, device: str = "cpu") -> FluxTransformer2DModel:
    with torch.device(device):
        return FluxTransformer2DModel(
            patch_size=1, in_channels=config.in_channels, num_layers=config.depth,
            num_single_layers=config.depth_single_blocks, attention_head_dim=config.head_dim,
            num_attention_heads=config.num_heads, joint_attention_dim=config.context_in_dim,
            pooled_projection_dim=config.vec_in_dim, guidance_embeds=config.guidance_embed,
            axes_dims_rope=tuple(config.axes_dim)).eval()


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights of a sensible scale; no norm scale left at 1, so a swapped q/k norm shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(noise / math.sqrt(param[0].numel()) if param.ndim > 1 else 1.0 + 0.1 * noise)


def inputs(config: FluxConfig, height: int, width: int, batch: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"x": torch.randn(batch, config.latent_channels, height, width, generator=generator),
            "timesteps": torch.tensor([0.3, 0.85])[:batch],
            "context": torch.randn(batch, 5, config.context_in_dim, generator=generator),
            "y": torch.randn(batch, config.vec_in_dim, generator=generator),
            "guidance": torch.tensor([3.5, 1.0])[:batch]}


def diffusers_velocity(model: FluxTransformer2DModel, x: torch.Tensor, timesteps: torch.Tensor,
                       context: torch.Tensor, y: torch.Tensor, guidance: torch.Tensor) -> torch.Tensor:
    """The velocity as FluxPipeline computes it, on the latent padded as ComfyUI pads it (circularly)."""
    batch, channels, height, width = x.shape
    padded = F.pad(x, (0, width % 2, 0, height % 2), mode="circular")
    rows, cols = padded.shape[-2] // 2, padded.shape[-1] // 2
    tokens = FluxPipeline._pack_latents(padded, batch, channels, 2 * rows, 2 * cols)
    img_ids = FluxPipeline._prepare_latent_image_ids(batch, rows, cols, x.device, x.dtype)
    txt_ids = torch.zeros(context.shape[1], 3)
    with torch.no_grad():
        out = model(hidden_states=tokens, encoder_hidden_states=context, pooled_projections=y,
                    timestep=timesteps, img_ids=img_ids, txt_ids=txt_ids,
                    guidance=guidance if model.config.guidance_embeds else None, return_dict=False)[0]
    vae_scale_factor = 8
    latent = FluxPipeline._unpack_latents(out, 2 * rows * vae_scale_factor, 2 * cols * vae_scale_factor,
                                          vae_scale_factor)
    return latent[:, :, :height, :width]


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def shapes_of(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(tensor.shape) for key, tensor in state.items()}


CASES = [pytest.param(guidance, size, id=f"{'dev' if guidance else 'schnell'}_like-{size[0]}x{size[1]}")
         for guidance in (True, False) for size in ((6, 8), (5, 7))]


@pytest.mark.parametrize(("guidance_embed", "size"), CASES)
def test_matches_diffusers_through_our_key_converter(guidance_embed: bool, size: tuple[int, int]):
    reference = diffusers_model(tiny_config(guidance_embed))
    randomize(reference, seed=0)
    state = reference.state_dict()
    bfl_shapes = diffusers_flux_shapes(shapes_of(state))
    config = flux_config_from_shapes(bfl_shapes)
    assert config == tiny_config(guidance_embed)
    read = diffusers_flux_getter(state.__getitem__, state)
    model = FluxTransformer(config).eval()
    model.load_state_dict({name: read(name) for name in bfl_shapes}, strict=True)

    args = inputs(config, *size)
    with torch.no_grad():
        ours = model(**args)
    expected = diffusers_velocity(reference, **args)
    assert ours.shape == args["x"].shape and ours.dtype == args["x"].dtype
    assert relative_error(ours, expected) <= PARITY_TOLERANCE


@contextmanager
def converter_at_width(hidden: int, mlp_hidden: int):
    """diffusers' converter splits the single blocks' linear1 at FLUX.1's widths (3072 x 3, 12288) whatever
    the model; while it runs, a split at those sizes is made at the tiny model's widths instead."""
    split = torch.split

    def split_at_width(tensor, sizes, dim=0):
        if list(sizes) == [FULL_HIDDEN] * 3 + [FULL_MLP]:
            sizes = [hidden] * 3 + [mlp_hidden]
        return split(tensor, sizes, dim)

    original = single_file_utils.torch.split
    single_file_utils.torch.split = split_at_width
    try:
        yield
    finally:
        single_file_utils.torch.split = original


@pytest.mark.parametrize("guidance_embed", [True, False], ids=["dev_like", "schnell_like"])
def test_matches_diffusers_loaded_through_diffusers_converter(guidance_embed: bool):
    config = tiny_config(guidance_embed)
    model = FluxTransformer(config).eval()
    randomize(model, seed=2)
    checkpoint = {BFL_PREFIX + name: tensor.clone() for name, tensor in model.state_dict().items()}
    with converter_at_width(config.hidden_size, config.mlp_hidden):
        converted = convert_flux_transformer_checkpoint_to_diffusers(checkpoint)
    reference = diffusers_model(config)
    reference.load_state_dict(converted, strict=True)

    args = inputs(config, 5, 8)
    with torch.no_grad():
        ours = model(**args)
    assert relative_error(ours, diffusers_velocity(reference, **args)) <= PARITY_TOLERANCE


@pytest.mark.parametrize("config", [flux_dev_config(), flux_schnell_config()], ids=["dev", "schnell"])
def test_released_key_names_and_shapes_agree_with_diffusers(config: FluxConfig):
    """On meta: diffusers' converter takes our full-size state dict to exactly its model's keys and shapes,
    and our converter takes its model's state dict back to exactly ours."""
    ours = shapes_of(FluxTransformer(config, device="meta").state_dict())
    theirs = shapes_of(diffusers_model(config, device="meta").state_dict())
    checkpoint = {BFL_PREFIX + name: torch.empty(shape, device="meta") for name, shape in ours.items()}
    assert shapes_of(convert_flux_transformer_checkpoint_to_diffusers(checkpoint)) == theirs
    assert diffusers_flux_shapes(theirs) == ours


RELEASED_COUNTS = [(flux_dev_config(), 11_901_408_320), (flux_schnell_config(), 11_891_178_560)]


@pytest.mark.parametrize(("config", "count"), RELEASED_COUNTS, ids=["dev", "schnell"])
def test_parameter_counts_of_released_models(config: FluxConfig, count: int):
    assert sum(p.numel() for p in FluxTransformer(config, device="meta").parameters()) == count
    assert sum(p.numel() for p in diffusers_model(config, device="meta").parameters()) == count


@pytest.mark.parametrize("guidance_embed", [True, False], ids=["dev_like", "schnell_like"])
def test_stages_run_bit_identically_to_forward(guidance_embed: bool):
    config = tiny_config(guidance_embed)
    model = FluxTransformer(config).eval()
    randomize(model, seed=3)
    args = inputs(config, 7, 6)
    stages = model.stages()
    assert [stage.name for stage in stages] == [
        "embed", "double_blocks.0.attn", "double_blocks.0.mlp", "double_blocks.1.attn", "double_blocks.1.mlp",
        "single_blocks.0.in", "single_blocks.0.out", "single_blocks.1.in", "single_blocks.1.out", "final"]
    owned = [id(p) for stage in stages for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # each parameter in exactly one stage
    with torch.no_grad():
        state = run_stages(stages, model.initial_state(**args))
        assert set(state) == {"h"}
        assert torch.equal(state["h"], model(**args))


def test_stage_list_is_cached_until_forgotten():
    model = FluxTransformer(tiny_config(True), device="meta")
    first = model.stages()
    assert [s.run for s in model.stages()] == [s.run for s in first]
    model.forget_stages()
    assert model.stages()[0].run is not first[0].run


def test_dev_without_guidance_is_an_error():
    config = tiny_config(True)
    model = FluxTransformer(config)
    args = inputs(config, 4, 4)
    del args["guidance"]
    with pytest.raises(ValueError, match="needs guidance"):
        model(**args)


def test_schnell_ignores_guidance():
    config = tiny_config(False)
    model = FluxTransformer(config).eval()
    randomize(model, seed=4)
    args = inputs(config, 4, 4)
    with torch.no_grad():
        assert torch.equal(model(**args), model(**{**args, "guidance": None}))


@pytest.mark.parametrize("config", [flux_dev_config(), flux_schnell_config()], ids=["dev", "schnell"])
def test_config_from_shapes_recovers_released_configs(config: FluxConfig):
    shapes = shapes_of(FluxTransformer(config, device="meta").state_dict())
    assert flux_config_from_shapes(shapes) == config
    prefixed = {BFL_PREFIX + name: shape for name, shape in shapes.items()}
    prefixed["first_stage_model.decoder.conv_in.weight"] = (512, 16, 3, 3)  # another component of the file
    assert flux_config_from_shapes(prefixed, prefix=BFL_PREFIX) == config


def test_config_from_shapes_names_a_missing_block():
    shapes = shapes_of(FluxTransformer(flux_dev_config(), device="meta").state_dict())
    holed = {BFL_PREFIX + name: shape for name, shape in shapes.items()
             if not name.startswith("double_blocks.7.")}
    with pytest.raises(ValueError, match=r"block model\.diffusion_model\.double_blocks\.7 is missing"):
        flux_config_from_shapes(holed, prefix=BFL_PREFIX)


def test_config_from_shapes_names_a_missing_tensor_of_a_block():
    shapes = shapes_of(FluxTransformer(flux_schnell_config(), device="meta").state_dict())
    del shapes["single_blocks.12.linear2.weight"]
    with pytest.raises(ValueError, match=r"single_blocks\.12\.linear2\.weight is missing"):
        flux_config_from_shapes(shapes)


def test_config_from_shapes_rejects_a_t5_file():
    t5 = {"encoder.block.0.layer.0.SelfAttention.q.weight": (4096, 4096), "shared.weight": (32128, 4096)}
    with pytest.raises(ValueError, match=r"a FLUX file needs 'img_in.weight'"):
        flux_config_from_shapes(t5)


def test_axes_dim_rule():
    assert flux_axes_dim(128) == (16, 56, 56)
    assert flux_axes_dim(32) == (4, 14, 14)
    for head_dim in range(2, 258, 2):
        axes = flux_axes_dim(head_dim)
        assert sum(axes) == head_dim and all(a % 2 == 0 for a in axes)

import argparse
import logging

import pytest
import torch

from engine.devices import ComputeDevice
from engine.placement import (
    DEFAULT,
    MODULE_ALIASES,
    MemorySettings,
    PlacementError,
    add_placement_arguments,
    canonical_module,
    max_vram_for,
    parse_assignment,
    parse_max_vram,
    parse_modes,
    placement_for,
    settings_from_namespace,
)

CUDA0 = ComputeDevice("cuda0", torch.device("cuda", 0), "gpu", "fake GPU 0")
CUDA1 = ComputeDevice("cuda1", torch.device("cuda", 1), "gpu", "fake GPU 1")
MPS = ComputeDevice("mps", torch.device("mps"), "igpu", "fake unified GPU")
CPU = ComputeDevice("cpu", torch.device("cpu"), "cpu", "fake CPU")
DEVICES = [CUDA0, CUDA1, CPU]

# The module table of reference/000, written out independently of the code under test.
REFERENCE_TABLE = {
    "diffusion": ["diffusion", "model", "unet", "dit"],
    "te": ["te", "clip", "text", "textencoder", "textencoders", "conditioner", "cond", "llm", "t5", "t5xxl"],
    "clip_vision": ["clip_vision", "clipvision", "clip-vision", "vision"],
    "vae": ["vae", "firststage", "autoencoder", "tae"],
    "controlnet": ["controlnet", "control"],
    "photomaker": ["photomaker", "photomakerid", "pmid", "photo"],
    "upscaler": ["upscaler", "esrgan", "hires"],
    "detector": ["detector", "adetailer", "yolo"],
}


def place(module: str, devices=DEVICES, **flags) -> object:
    return placement_for(module, MemorySettings.from_args(**flags), devices)


@pytest.mark.parametrize(
    ("module", "alias"), [(m, a) for m, aliases in REFERENCE_TABLE.items() for a in aliases]
)
def test_every_alias_of_the_reference_table_names_its_module(module, alias):
    assert canonical_module(alias) == module
    assert canonical_module(alias.upper()) == module


def test_module_table_has_exactly_the_reference_modules():
    assert list(MODULE_ALIASES) == list(REFERENCE_TABLE)


@pytest.mark.parametrize(
    "spelling", ["clip_vision", "clip-vision", "clipvision", "CLIP_Vision", "clip__vision"]
)
def test_hyphens_and_underscores_in_module_names_are_ignored(spelling):
    assert canonical_module(spelling) == "clip_vision"


def test_unknown_module_error_names_it_and_lists_accepted_modules_with_aliases():
    with pytest.raises(PlacementError) as error:
        parse_assignment("dif=cuda0")
    message = str(error.value)
    assert "unknown module 'dif' in --backend 'dif=cuda0'" in message
    assert "accepted: diffusion (model, unet, dit), te (clip, text," in message
    assert "detector (adetailer, yolo)" in message


def test_bare_device_sets_the_default():
    assert parse_assignment("cpu") == {DEFAULT: ("cpu",)}
    assert place("vae", backend="cpu").compute == ("cpu",)


@pytest.mark.parametrize("default_key", ["all", "default", "*", "ALL"])
def test_all_default_and_star_set_the_default_inside_a_mixed_string(default_key):
    text = f"{default_key}=cuda1,te=cpu"
    assert parse_assignment(text) == {DEFAULT: ("cuda1",), "te": ("cpu",)}
    assert place("vae", backend=text).compute == ("cuda1",)
    assert place("te", backend=text).compute == ("cpu",)


@pytest.mark.parametrize("text", ["te=cpu,cuda1", "cuda1,te=cpu", "all=cuda1,clip=cpu", "clip=cpu,*=cuda1"])
def test_module_specific_assignment_wins_regardless_of_position(text):
    assert place("te", backend=text).compute == ("cpu",)
    assert place("diffusion", backend=text).compute == ("cuda1",)


def test_last_setting_for_the_same_key_wins():
    assert parse_assignment("te=cpu,clip=cuda0,cuda1,cpu") == {"te": ("cuda0",), DEFAULT: ("cpu",)}


def test_unassigned_module_uses_the_default_device_gpu_first():
    assert place("vae", backend="te=cpu").compute == ("cuda0",)
    assert place("vae").compute == ("cuda0",)
    assert place("vae", devices=[CPU]).compute == ("cpu",)


def test_device_names_resolve_by_prefix_and_special_values():
    assert place("diffusion", backend="diffusion=CUDA1").compute == ("cuda1",)
    assert place("diffusion", backend="gpu").compute == ("cuda0",)
    with pytest.raises(PlacementError, match=r"--backend 'cu'.*ambiguous.*cuda0, cuda1"):
        place("diffusion", backend="cu")
    with pytest.raises(
        PlacementError, match=r"unknown device 'vulkan0'; available devices: cuda0, cuda1, cpu"
    ):
        place("diffusion", backend="vulkan0")


@pytest.mark.parametrize("module", ["diffusion", "te", "unet", "t5xxl"])
def test_device_lists_are_accepted_for_diffusion_and_te(module):
    parsed = parse_assignment(f"{module}=cuda0&cuda1")
    assert list(parsed.values()) == [("cuda0", "cuda1")]
    assert place(module, backend=f"{module}=cuda0&cuda1").compute == ("cuda0", "cuda1")


@pytest.mark.parametrize(
    "text", ["vae=cuda0&cuda1", "cuda0&cuda1", "all=cuda0&cuda1", "controlnet=cuda0&cuda1"]
)
def test_device_lists_for_other_modules_or_the_default_are_errors(text):
    with pytest.raises(
        PlacementError, match=r"device list \('&', layer split\) is accepted only for diffusion and te"
    ):
        parse_assignment(text)


def test_a_device_twice_in_a_list_is_an_error():
    with pytest.raises(PlacementError, match="device listed twice"):
        parse_assignment("diffusion=cuda0&cuda0")
    with pytest.raises(PlacementError, match="same device twice"):
        place("diffusion", backend="diffusion=cuda1&CUDA:1")


def test_params_backend_accepts_no_device_lists():
    with pytest.raises(PlacementError, match=r"--params-backend accepts no device lists"):
        MemorySettings.from_args(params_backend="diffusion=cuda0&cuda1")


@pytest.mark.parametrize("text", ["disk", "te=disk", "cuda0,vae=disk", "diffusion=cuda0&disk"])
def test_disk_is_not_a_compute_backend(text):
    with pytest.raises(PlacementError, match="disk is a parameter residency mode, not a compute backend"):
        MemorySettings.from_args(backend=text)


def test_params_backend_accepts_disk_per_module_or_as_default():
    assert place("diffusion", backend="cuda0", params_backend="disk").params == "disk"
    settings = dict(backend="cuda0", params_backend="diffusion=disk,te=cpu,vae=cpu")
    assert place("diffusion", **settings).params == "disk"
    assert place("te", **settings).params == "cpu"
    assert place("upscaler", **settings).params == "device"


def test_params_on_the_compute_device_are_device_and_on_another_gpu_name_it():
    assert place("te", backend="cuda0", params_backend="cuda0").params == "device"
    assert place("te", backend="cuda0", params_backend="te=cuda1").params == "cuda1"
    assert place("te", backend="cuda0").params == "device"


def test_cpu_params_for_cpu_or_unified_memory_compute_are_on_the_device():
    assert place("te", backend="cpu", params_backend="cpu").params == "device"
    assert place("te", devices=[MPS, CPU], backend="mps", params_backend="cpu").params == "device"


def test_layer_split_keeps_explicit_cpu_params():
    placement = place("diffusion", backend="diffusion=cuda0&cuda1", params_backend="diffusion=cpu")
    assert placement.compute == ("cuda0", "cuda1") and placement.params == "cpu"


@pytest.mark.parametrize("text", ["te=cpu,", ",cpu", "te=cpu,,vae=cpu"])
def test_empty_entries_are_errors(text):
    with pytest.raises(PlacementError, match="empty entry"):
        parse_assignment(text)


def test_bad_device_token_is_an_error():
    with pytest.raises(PlacementError, match=r"bad device name 'cuda 0'"):
        parse_assignment("te=cuda 0")


def test_split_mode_single_or_per_module():
    assert place("diffusion", backend="diffusion=cuda0&cuda1", split_mode="row").split_mode == "row"
    settings = dict(backend="diffusion=cuda0&cuda1,te=cuda0&cuda1", split_mode="diffusion=row,te=layer")
    assert place("diffusion", **settings).split_mode == "row"
    assert place("te", **settings).split_mode == "layer"
    assert place("diffusion").split_mode == "layer"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("column", "bad value 'column'.*accepted: layer, row"),
        ("vae=row", "module 'vae' is not accepted by --split-mode"),
    ],
)
def test_split_mode_errors(text, message):
    with pytest.raises(PlacementError, match=message):
        MemorySettings.from_args(split_mode=text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6", {DEFAULT: 6.0}),
        ("cuda0=6,cuda1=14", {"cuda0": 6.0, "cuda1": 14.0}),
        ("0", {DEFAULT: 0.0}),
        ("-1", {DEFAULT: -1.0}),
        ("2.5,cuda1=-0.5", {DEFAULT: 2.5, "cuda1": -0.5}),
        ("", {}),
        ("all=3,cpu=1", {DEFAULT: 3.0, "cpu": 1.0}),
    ],
)
def test_max_vram_forms(text, expected):
    assert parse_max_vram(text) == expected


@pytest.mark.parametrize("text", ["six", "cuda0=", "cuda0=6GB", "=6", "6,,cuda0=1", "nan", "cuda0=inf"])
def test_bad_max_vram_is_an_error(text):
    with pytest.raises(PlacementError, match="--max-vram"):
        MemorySettings.from_args(max_vram=text)


def test_max_vram_number_applies_to_each_gpu_and_device_entries_win():
    assert max_vram_for(CUDA0, "6", DEVICES) == 6.0
    assert max_vram_for(CUDA1, "6", DEVICES) == 6.0
    assert max_vram_for(CPU, "6", DEVICES) is None
    assert max_vram_for(CUDA1, "cuda1=14,6", DEVICES) == 14.0
    assert max_vram_for(CUDA0, "cuda1=14", DEVICES) is None
    assert max_vram_for(CPU, "cpu=2", DEVICES) == 2.0
    with pytest.raises(PlacementError, match="unknown device 'vulkan0'"):
        max_vram_for(CUDA0, "vulkan0=2", DEVICES)


def test_flash_attn_module_assignments_and_defaults():
    settings = dict(flash_attn="auto,te=off,vae=on")
    assert place("te", **settings).flash_attn == "off"
    assert place("vae", **settings).flash_attn == "on"
    assert place("diffusion", **settings).flash_attn == "auto"
    assert place("diffusion", flash_attn="off,diffusion=auto").flash_attn == "auto"
    assert place("vae", flash_attn="diffusion=on").flash_attn == "auto"
    assert place("vae", flash_attn="on,off").flash_attn == "off"
    assert parse_modes(
        "audio_encoder=off,*=on", "--flash-attn", ("on", "off", "auto"), ("diffusion", "audio_encoder")
    ) == {"audio_encoder": "off", DEFAULT: "on"}


@pytest.mark.parametrize("module", ["upscaler", "esrgan", "detector", "photomaker"])
def test_flash_attn_rejects_modules_without_configurable_attention(module):
    with pytest.raises(
        PlacementError, match=r"is not accepted by --flash-attn.*accepted: diffusion.*audio_encoder"
    ):
        MemorySettings.from_args(flash_attn=f"auto,{module}=on")
    assert place(module).flash_attn == "off"


def test_audio_encoder_is_not_a_backend_module():
    with pytest.raises(PlacementError, match="unknown module 'audio_encoder' in --backend"):
        parse_assignment("audio_encoder=cpu")


def test_bad_attention_mode_is_an_error():
    with pytest.raises(PlacementError, match=r"bad value 'yes'.*accepted: on, off, auto"):
        MemorySettings.from_args(flash_attn="yes")


def test_conv_direct_module_assignments():
    assert place("vae", conv_direct="auto,vae=off").conv_direct == "off"
    assert place("diffusion", conv_direct="off,diffusion=on").conv_direct == "on"
    assert place("controlnet", conv_direct="off,diffusion=on").conv_direct == "off"
    assert place("te").conv_direct == "off"
    with pytest.raises(PlacementError, match="module 'te' is not accepted by --conv-direct"):
        MemorySettings.from_args(conv_direct="te=on")


def test_auto_fit_on_by_default_and_disabled_by_explicit_params_backend():
    assert MemorySettings.from_args().auto_fit is True
    assert MemorySettings.from_args(auto_fit="off").auto_fit is False
    assert MemorySettings.from_args(auto_fit="on", params_backend="te=cpu").auto_fit is False
    with pytest.raises(PlacementError, match="--auto-fit requires on or off, got 'maybe'"):
        MemorySettings.from_args(auto_fit="maybe")


@pytest.mark.parametrize(
    ("flag", "module"), [("clip_on_cpu", "te"), ("vae_on_cpu", "vae"), ("control_net_cpu", "controlnet")]
)
def test_deprecated_cpu_flags_prepend_to_backend_and_warn(flag, module, caplog):
    with caplog.at_level(logging.WARNING, logger="sluice.placement"):
        settings = MemorySettings.from_args(backend="cuda1", **{flag: True})
    assert settings.backend == f"{module}=cpu,cuda1"
    dashed = "--" + flag.replace("_", "-")
    assert settings.warnings == (f"{dashed} is deprecated; use --backend {module}=cpu",)
    assert any(dashed in record.getMessage() for record in caplog.records)
    assert placement_for(module, settings, DEVICES).compute == ("cpu",)
    assert placement_for("diffusion", settings, DEVICES).compute == ("cuda1",)


def test_explicit_backend_entry_overrides_a_deprecated_flag():
    assert place("te", clip_on_cpu=True, backend="te=cuda1").compute == ("cuda1",)


def test_offload_to_cpu_prepends_star_cpu_to_params_backend_and_disables_auto_fit():
    settings = MemorySettings.from_args(backend="cuda0", offload_to_cpu=True, params_backend="te=disk")
    assert settings.params_backend == "*=cpu,te=disk"
    assert settings.auto_fit is False and settings.warnings == ()
    assert placement_for("diffusion", settings, DEVICES).params == "cpu"
    assert placement_for("te", settings, DEVICES).params == "disk"


@pytest.mark.parametrize(
    ("flag", "module"), [("dit_offload", "diffusion"), ("text_encoder_offload", "te"), ("vae_offload", "vae")]
)
def test_edge_dit_component_offload_flags_keep_that_module_in_cpu_ram(flag, module):
    settings = MemorySettings.from_args(backend="cuda0", **{flag: True})
    for name in ("diffusion", "te", "vae"):
        assert placement_for(name, settings, DEVICES).params == ("cpu" if name == module else "device")
        assert placement_for(name, settings, DEVICES).compute == ("cuda0",)


def test_edge_dit_offload_is_a_no_op_on_cpu_compute():
    assert place("diffusion", backend="cpu", dit_offload=True).params == "device"


def test_prefetch_and_segmented_compute_can_be_disabled():
    settings = MemorySettings.from_args(disable_prefetch=True, disable_segmented_compute=True)
    assert settings.prefetch is False and settings.segmented is False
    assert MemorySettings().prefetch and MemorySettings().segmented


def test_unknown_flag_is_an_error():
    with pytest.raises(PlacementError, match="unknown memory flag.*backned.*accepted: backend"):
        MemorySettings.from_args(backned="cpu")


def test_settings_round_trip_through_the_workflow_file_as_strings():
    settings = MemorySettings.from_args(
        backend="te=cpu,cuda0",
        params_backend="diffusion=disk",
        max_vram="-1",
        flash_attn="auto,te=off",
        disable_prefetch=True,
        vae_tiling="on",
        cuda_graphs="off",
    )
    data = settings.to_dict()
    assert all(isinstance(v, str) for v in data.values())
    assert data["auto_fit"] == "off" and data["prefetch"] == "off" and "warnings" not in data
    assert MemorySettings.from_dict(data) == settings
    assert "params_backend" not in MemorySettings().to_dict()
    with pytest.raises(PlacementError, match="unknown memory setting"):
        MemorySettings.from_dict({"bakend": "cpu"})
    with pytest.raises(PlacementError, match="--cuda-graphs requires on, off or auto, got 'maybe'"):
        MemorySettings.from_dict({"cuda_graphs": "maybe"})
    with pytest.raises(PlacementError, match="disk is a parameter residency mode"):
        MemorySettings.from_dict({"backend": "disk"})


def test_cli_flags_override_workflow_settings():
    parser = argparse.ArgumentParser()
    add_placement_arguments(parser)
    base = MemorySettings(backend="cpu", flash_attn="off", max_vram="4")
    ns = parser.parse_args(["--backend", "cuda1", "--clip-on-cpu", "--auto-fit", "off", "--disable-prefetch",
                            "--cuda-graphs", "off"])
    settings = settings_from_namespace(ns, base)
    assert settings.cuda_graphs == "off" and base.cuda_graphs == "auto"
    assert settings.backend == "te=cpu,cuda1"
    assert settings.flash_attn == "off" and settings.max_vram == "4"
    assert settings.auto_fit is False and settings.prefetch is False and settings.segmented is True
    assert len(settings.warnings) == 1
    assert settings_from_namespace(parser.parse_args([]), base) == base


def test_cli_parser_rejects_bad_choices():
    parser = argparse.ArgumentParser()
    add_placement_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--auto-fit", "maybe"])

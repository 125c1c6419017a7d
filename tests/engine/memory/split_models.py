"""Small models and two-device runtimes for the layer- and row-split tests (no Qt, no app)."""

from __future__ import annotations

import pytest
import torch

from engine.devices import ComputeDevice
from engine.memory.ledger import DeviceLedger
from engine.memory.runtime import MemoryRuntime
from engine.models.clip import CLIPTextModel, TextEncoderConfig
from engine.models.detect import UNetConfig
from engine.models.unet import UNetModel
from engine.placement import MemorySettings
from engine.telemetry import EventBus

MIB = 1024**2


def tiny_unet_config() -> UNetConfig:
    """An SDXL-shaped UNet (linear projections, label embedding) of a few MiB."""
    return UNetConfig(in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
                      attention_levels=(0, 1), transformer_depth=(1, 2), transformer_depth_middle=1,
                      num_heads=-1, num_head_channels=16, context_dim=64, use_linear_in_transformer=True,
                      adm_in_channels=128, num_classes="sequential", prediction="eps", family="sdxl")


def tiny_clip_config(layout: str) -> TextEncoderConfig:
    hf = layout == "hf"
    return TextEncoderConfig(kind="clip_l" if hf else "openclip_g", vocab_size=1000, max_positions=77,
                             width=64, layers=4, heads=4, intermediate=256, projection_dim=32,
                             activation="quick_gelu" if hf else "gelu", key_prefix="", layout=layout)


def random_weights(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights of standard deviation 1/sqrt(fan_in) (norm scales near 1), so activations stay of order one."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, parameter in model.named_parameters():
        if parameter.ndim >= 2:
            tensor = torch.randn(parameter.shape, generator=generator) / parameter[0].numel() ** 0.5
        else:
            tensor = 1.0 * name.endswith("weight") + 0.1 * torch.randn(parameter.shape, generator=generator)
        weights[name] = tensor.to(parameter.dtype)
    return weights


def unet_with_weights(device: str = "cpu") -> tuple[UNetModel, dict[str, torch.Tensor]]:
    weights = random_weights(UNetModel(tiny_unet_config(), device="meta"))
    model = UNetModel(tiny_unet_config(), device=device)
    model.load_state_dict(weights)
    return model, weights


def clip_with_weights(layout: str) -> tuple[CLIPTextModel, dict[str, torch.Tensor]]:
    weights = random_weights(CLIPTextModel(tiny_clip_config(layout), device="meta"))
    model = CLIPTextModel(tiny_clip_config(layout), device="cpu")
    model.load_state_dict(weights)
    return model, weights


def unet_inputs(device: str = "cpu", seed: int = 1) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 16, 16, generator=generator)
    context = torch.randn(2, 7, 64, generator=generator)
    y = torch.randn(2, 128, generator=generator)
    return tuple(t.to(device) for t in (x, torch.tensor([999.0, 10.0]), context, y))


def fake_gpus(count: int = 2) -> list[ComputeDevice]:
    """Device names cuda0, cuda1, ... that all compute on the CPU, as the runtime's device list."""
    cpu = torch.device("cpu")
    gpus = [ComputeDevice(f"cuda{i}", cpu, "gpu", "a GPU name on the CPU") for i in range(count)]
    return [*gpus, ComputeDevice("cpu", torch.device("cpu"), "cpu", "CPU")]


def fake_gpu_runtime(budgets_mib: tuple[int, ...] = (64, 64), settings: MemorySettings | None = None,
                     ) -> MemoryRuntime:
    bus = EventBus()
    ledgers = {f"cuda{i}": DeviceLedger(f"cuda{i}", mib * MIB, bus=bus) for i, mib in enumerate(budgets_mib)}
    return MemoryRuntime(settings or MemorySettings(), devices=fake_gpus(len(budgets_mib)), bus=bus,
                         ledgers=ledgers)


def run_unet(runtime: MemoryRuntime, name: str, model: UNetModel, inputs: tuple[torch.Tensor, ...]
             ) -> torch.Tensor:
    with torch.no_grad():
        return runtime.run(name, model, model.stages(), model.initial_state(*inputs))["h"]


@pytest.fixture
def exact_fp32_convolutions():
    """cuDNN convolutions in full fp32 (TF32 off): outputs of different devices compare at fp32 precision."""
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = allowed


def two_gpus(test):
    """Marks a test that needs two CUDA devices; it runs with cuDNN's TF32 off."""
    test = pytest.mark.usefixtures("exact_fp32_convolutions")(test)
    return pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")(test)

"""Fixtures shared by the memory-runtime tests."""

import pytest
import torch
from split_models import unet_inputs, unet_with_weights


@pytest.fixture(scope="module")
def unet_reference() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(weights, output) of the tiny UNet run plainly on the CPU: what every split must reproduce."""
    model, weights = unet_with_weights()
    with torch.no_grad():
        expected = model(*unet_inputs())
    return weights, expected

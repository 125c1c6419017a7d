"""engine/tiling.py: tiled runs equal the whole-image run where they must, blend seams, and retry on OOM."""

import pytest
import torch
import torch.nn.functional as F

from engine.memory.ledger import BudgetExceeded
from engine.tiling import run_tiled, run_tiled_with_retry, tile_starts


def nearest_2x(tile: torch.Tensor) -> torch.Tensor:
    return F.interpolate(tile, scale_factor=2, mode="nearest")


def box_blur_2x(tile: torch.Tensor) -> torch.Tensor:
    """A model with a 2 px receptive radius: tiles differ from the whole image near their borders."""
    blurred = F.avg_pool2d(F.pad(tile, (2, 2, 2, 2), mode="replicate"), 5, stride=1)
    return F.interpolate(blurred, scale_factor=2, mode="nearest")


def test_tile_starts_cover_the_image_with_equal_tiles_flush_at_the_border():
    assert tile_starts(100, 128, 32) == [0]
    assert tile_starts(300, 128, 32) == [0, 96, 172]
    for size in (129, 300, 513, 1000):
        starts = tile_starts(size, 128, 32)
        assert starts[0] == 0 and starts[-1] + 128 == size
        assert all(b - a <= 96 for a, b in zip(starts, starts[1:], strict=False))


def test_tile_at_least_image_size_is_exactly_the_whole_image_run():
    image = torch.rand(2, 3, 40, 56)
    assert torch.equal(run_tiled(box_blur_2x, image, 2, tile=64, overlap=8), box_blur_2x(image))


def test_pointwise_model_is_reproduced_exactly_by_feathered_tiles():
    image = torch.rand(1, 3, 150, 170)
    result = run_tiled(nearest_2x, image, 2, tile=64, overlap=16)
    torch.testing.assert_close(result, nearest_2x(image), atol=1e-6, rtol=0)


def test_seams_of_a_spatial_model_are_small_and_only_near_tile_borders():
    torch.manual_seed(0)
    image = torch.rand(1, 3, 150, 170)
    reference = box_blur_2x(image)
    result = run_tiled(box_blur_2x, image, 2, tile=64, overlap=16)
    error = (result - reference).abs()
    assert error.max() < 0.15  # random pixels, 5x5 box, feathered over 32 output px
    assert error.mean() < 2e-3
    rows = tile_starts(150, 64, 16)
    interior = error[..., : (rows[1] - 2) * 2, :]  # above the first seam, more than the radius away
    assert interior[..., : 2 * (48 - 2), : 2 * (48 - 2)].max() == 0


def test_memory_failure_retries_at_half_tile_size_down_to_the_floor(caplog):
    tried = []

    def fails_above_160px(tile: torch.Tensor) -> torch.Tensor:
        tried.append(tile.shape[-1])
        if tile.shape[-1] > 160:
            raise BudgetExceeded(f"tile {tile.shape[-1]} px does not fit")
        return nearest_2x(tile)

    image = torch.rand(1, 3, 300, 600)
    with caplog.at_level("WARNING", logger="sluice.tiling"):
        result = run_tiled_with_retry(fails_above_160px, image, 2, tile=512, overlap=32, min_tile=128)
    torch.testing.assert_close(result, nearest_2x(image), atol=1e-6, rtol=0)
    assert tried[:2] == [512, 256] and set(tried[2:]) == {128}
    assert "retrying at 256 px" in caplog.text and "retrying at 128 px" in caplog.text


def test_cuda_out_of_memory_below_the_floor_is_raised():
    def always_oom(tile: torch.Tensor) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        run_tiled_with_retry(always_oom, torch.rand(1, 3, 300, 300), 2, tile=256, min_tile=128)


def test_bad_overlap_is_a_clear_error():
    with pytest.raises(ValueError, match="overlap 40 px must lie in 0..32"):
        run_tiled(nearest_2x, torch.rand(1, 3, 100, 100), 2, tile=64, overlap=40)

"""An automatic judge for images of the shapes data set: does the picture show what the caption asked for?

It measures a generated image the way a person would read it: the background colour (the border's median
colour), the shape's pixels (those far from the background colour), their colour, where their centre lies
on the 3x3 grid, and their area (small or large). Each measurement is the nearest of the data set's named
values, so the judge is independent of the model: the same code scores the renderer's own images perfectly
(tests check that).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from tools.shapes_dataset import COLORS, POSITIONS, SIZES, Scene

ATTRIBUTES = ("background", "color", "position", "size")
SHAPE_DISTANCE = 50.0  # RGB distance from the background beyond which a pixel is a shape (palette gap >= 80)


@dataclass(frozen=True)
class Measurement:
    background: str
    color: str | None  # None when no shape pixels were found
    position: str | None
    size: str | None
    shape_fraction: float  # share of the image's pixels that belong to a shape


def nearest_color(rgb: np.ndarray, exclude: str | None = None) -> str:
    names = [n for n in COLORS if n != exclude]
    palette = np.array([COLORS[n] for n in names], dtype=np.float32)
    return names[int(np.argmin(((palette - rgb) ** 2).sum(axis=1)))]


def measure(image: Image.Image | np.ndarray) -> Measurement:
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float32)
    side = pixels.shape[0]
    ring = max(2, side // 20)
    border = np.concatenate([pixels[:ring].reshape(-1, 3), pixels[-ring:].reshape(-1, 3),
                             pixels[:, :ring].reshape(-1, 3), pixels[:, -ring:].reshape(-1, 3)])
    background = nearest_color(np.median(border, axis=0))
    distance = np.sqrt(((pixels - np.array(COLORS[background], dtype=np.float32)) ** 2).sum(axis=-1))
    mask = distance > SHAPE_DISTANCE  # (H, W)
    fraction = float(mask.mean())
    if mask.sum() < max(4, side * side // 400):
        return Measurement(background, None, None, None, fraction)
    color = nearest_color(np.median(pixels[mask], axis=0), exclude=background)
    ys, xs = np.nonzero(mask)
    centre = np.array([xs.mean(), ys.mean()]) / side
    position = min(POSITIONS, key=lambda p: float(((np.array(POSITIONS[p]) - centre) ** 2).sum()))
    extent = max(np.ptp(xs), np.ptp(ys)) / side  # the shape's larger bounding-box side, as a fraction
    size = min(SIZES, key=lambda s: abs(SIZES[s] - extent))
    return Measurement(background, color, position, size, fraction)


def judge(image: Image.Image | np.ndarray, scene: Scene, check_size: bool = True) -> dict[str, bool]:
    """Which attributes of a one-shape `scene` the image gets right (size only when the caption named it)."""
    if len(scene.shapes) != 1:
        raise ValueError(f"the judge reads one-shape scenes; this one has {len(scene.shapes)} shapes")
    expected = scene.shapes[0]
    found = measure(image)
    verdict = {
        "background": found.background == scene.background,
        "color": found.color == expected.color,
        "position": found.position == expected.position,
    }
    if check_size:
        verdict["size"] = found.size == expected.size
    return verdict

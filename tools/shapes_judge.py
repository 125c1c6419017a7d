"""An automatic judge for images of the shapes data set: does the picture show what the caption asked for?

It measures a generated image the way a person would read it: the background colour (the border's median
colour), the shape's pixels (those far from the background colour, less specks: connected pieces under a
tenth of the largest piece, such as the single stray pixels the VAE leaves in corners), their colour, where
their centre lies
on the 3x3 grid, their extent (small or large), and the shape itself: each of the six shapes is drawn by the
data set's renderer over the measured pixels' bounding box, and the one that overlaps them best (intersection
over union) is the shape read. Each measurement is the nearest of the data set's named values, so the judge is
independent of the model: the same code scores the renderer's own images perfectly (tests check that).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from tools.shapes_dataset import COLORS, POSITIONS, SHAPES, SIZES, Scene, draw_outline

ATTRIBUTES = ("background", "color", "position", "size", "shape")
SHAPE_DISTANCE = 50.0  # RGB distance from the background beyond which a pixel is a shape (palette gap >= 80)
SUPERSAMPLE = 4  # the shape templates are drawn this much larger, then averaged down, as the renderer does
SPECK = 0.1  # connected pieces of shape pixels smaller than this share of the largest piece are ignored


@dataclass(frozen=True)
class Measurement:
    background: str
    color: str | None  # None when no shape pixels were found
    position: str | None
    size: str | None
    shape: str | None
    shape_fraction: float  # share of the image's pixels that belong to a shape


def nearest_color(rgb: np.ndarray, exclude: str | None = None) -> str:
    names = [n for n in COLORS if n != exclude]
    palette = np.array([COLORS[n] for n in names], dtype=np.float32)
    return names[int(np.argmin(((palette - rgb) ** 2).sum(axis=1)))]


@functools.cache
def _geometry(shape: str) -> tuple[float, float, float]:
    """(bounding-box side, box centre's x and y offsets), each over the radius, of `shape` as drawn."""
    side, r = 1024, 256.0
    image = Image.new("L", (side, side), 0)
    draw_outline(ImageDraw.Draw(image), shape, side / 2, side / 2, r, 255)
    ys, xs = np.nonzero(np.asarray(image) > 127)
    x0, x1, y0, y1 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
    return max(x1 - x0, y1 - y0) / r, ((x0 + x1) / 2 - side / 2) / r, ((y0 + y1) / 2 - side / 2) / r


def shape_template(shape: str, box: tuple[int, int, int, int], side: int) -> np.ndarray:
    """(side, side) bool mask of `shape` drawn so that its bounding box's longer side and centre are those of
    `box` (x0, y0, x1, y1 in pixels, exclusive ends)."""
    extent_per_radius, dx, dy = _geometry(shape)
    x0, y0, x1, y1 = box
    r = max(x1 - x0, y1 - y0) / extent_per_radius
    cx, cy = (x0 + x1) / 2 - dx * r, (y0 + y1) / 2 - dy * r
    big = side * SUPERSAMPLE
    image = Image.new("L", (big, big), 0)
    draw_outline(ImageDraw.Draw(image), shape, cx * SUPERSAMPLE, cy * SUPERSAMPLE, r * SUPERSAMPLE, 255)
    return np.asarray(image.resize((side, side), Image.Resampling.BOX)) > 127


def best_shape(mask: np.ndarray) -> str:
    """The shape whose template, fitted to `mask`'s bounding box, overlaps `mask` best (by IoU)."""
    ys, xs = np.nonzero(mask)
    box = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)

    def overlap(shape: str) -> float:
        template = shape_template(shape, box, mask.shape[0])
        return (template & mask).sum() / max(1, (template | mask).sum())

    return max(SHAPES, key=overlap)


def connected_pieces(mask: np.ndarray) -> np.ndarray:
    """(H, W) int labels of `mask`'s 8-connected pieces (0 outside the mask): each pixel of a piece ends up
    with the piece's largest pixel number, by spreading the maximum to neighbours until nothing changes."""
    height, width = mask.shape
    labels = np.where(mask, np.arange(1, height * width + 1).reshape(height, width), 0)
    while True:
        padded = np.pad(labels, 1)
        spread = np.max([padded[dy:dy + height, dx:dx + width] for dy in range(3) for dx in range(3)], axis=0)
        spread = np.where(mask, spread, 0)
        if np.array_equal(spread, labels):
            return labels
        labels = spread


def without_specks(mask: np.ndarray) -> np.ndarray:
    """`mask` less its connected pieces smaller than SPECK of its largest piece."""
    labels = connected_pieces(mask)
    names, sizes = np.unique(labels[labels > 0], return_counts=True)
    if len(names) == 0:
        return mask
    kept = names[sizes >= SPECK * sizes.max()]
    return np.isin(labels, kept) & mask


def measure(image: Image.Image | np.ndarray) -> Measurement:
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float32)
    side = pixels.shape[0]
    ring = max(2, side // 20)
    border = np.concatenate([pixels[:ring].reshape(-1, 3), pixels[-ring:].reshape(-1, 3),
                             pixels[:, :ring].reshape(-1, 3), pixels[:, -ring:].reshape(-1, 3)])
    background = nearest_color(np.median(border, axis=0))
    distance = np.sqrt(((pixels - np.array(COLORS[background], dtype=np.float32)) ** 2).sum(axis=-1))
    mask = without_specks(distance > SHAPE_DISTANCE)  # (H, W)
    fraction = float(mask.mean())
    if mask.sum() < max(4, side * side // 400):
        return Measurement(background, None, None, None, None, fraction)
    color = nearest_color(np.median(pixels[mask], axis=0), exclude=background)
    ys, xs = np.nonzero(mask)
    centre = np.array([xs.mean(), ys.mean()]) / side
    position = min(POSITIONS, key=lambda p: float(((np.array(POSITIONS[p]) - centre) ** 2).sum()))
    extent = max(np.ptp(xs), np.ptp(ys)) / side  # the shape's larger bounding-box side, as a fraction
    size = min(SIZES, key=lambda s: abs(SIZES[s] - extent))
    return Measurement(background, color, position, size, best_shape(mask), fraction)


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
    verdict["shape"] = found.shape == expected.shape
    return verdict

"""Images from the engine (PIL images, HxWx3 uint8 arrays, tensors) as QImages."""

from __future__ import annotations

from typing import Any

import numpy as np
from PySide6.QtGui import QImage


def to_qimage(image: Any) -> QImage:
    """A deep-copied QImage of a PIL image, an HxWxC (C = 1, 3, 4) uint8 array or a tensor with .numpy()."""
    if isinstance(image, QImage):
        return image.copy()
    if hasattr(image, "convert") and hasattr(image, "mode"):  # PIL
        image = np.asarray(image.convert("RGBA"))
    elif hasattr(image, "detach"):  # torch: (H, W, C) floats in [0, 1] or uint8
        image = image.detach().cpu().numpy()
    array = np.asarray(image)
    if array.ndim == 4:
        array = array[0]  # (B, H, W, C) -> the first image
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise ValueError(f"cannot show an image of shape {array.shape}; expected (H, W, 1|3|4)")
    if array.dtype != np.uint8:
        array = (np.clip(array.astype(np.float32), 0.0, 1.0) * 255 + 0.5).astype(np.uint8)
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    if array.shape[2] == 3:
        array = np.concatenate([array, np.full(array.shape[:2] + (1,), 255, np.uint8)], axis=2)
    array = np.ascontiguousarray(array)  # (H, W, 4) RGBA
    height, width, _ = array.shape
    return QImage(array.data, width, height, 4 * width, QImage.Format.Format_RGBA8888).copy()

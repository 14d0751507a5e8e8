"""Vision items of one sample (images, videos or video frames) as the mRoPE
computation reads them: source, grid, frame, LLM grid and temporal spacing.

Shared by the families (:mod:`thdpack.vlm.base`, which make them), the mRoPE
kernel (:mod:`thdpack.vlm.mrope`) and a pack's vision fields
(:mod:`thdpack.vlm.vision_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# how an item's temporal positions ``trunc(k · interval)`` are computed, mirroring torch's
# type promotion in the family's get_rope_index: integer, float32 or float64 arithmetic
MODE_INT, MODE_F32, MODE_F64 = 0, 1, 2


@dataclass(frozen=True)
class RopeItems:
    """Vision items of one kind (images or videos) of one sample, in placeholder order.

    All arrays are ``[k]`` (``grid`` is ``[k, 3]``):
        source: index of the image / video the item comes from (a row of the grid
            it was made from; :func:`thdpack.vlm.vision_fields.attach_vision` renumbers it
            within each sample for error messages).
        grid: the source's ``(t, h, w)`` patch grid as given (for error messages).
        frame: frame (temporal patch) of the video the item is, or -1 for a whole image / video.
        t, h, w: LLM grid of the item (``t`` temporal patches, ``h, w`` after spatial merge).
        interval: float64 spacing of the temporal positions.
        mode: ``MODE_INT`` / ``MODE_F32`` / ``MODE_F64`` arithmetic for ``trunc(k · interval)``.
    """

    source: np.ndarray
    grid: np.ndarray
    frame: np.ndarray
    t: np.ndarray
    h: np.ndarray
    w: np.ndarray
    interval: np.ndarray
    mode: np.ndarray

    @property
    def tokens(self) -> np.ndarray:
        """int64 ``[k]`` placeholder tokens of each item."""
        return self.t * self.h * self.w

    def __len__(self) -> int:
        return int(self.source.size)

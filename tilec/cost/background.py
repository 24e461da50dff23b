"""``Background``: where a model input is known, when compiling, to hold one constant colour (a
slide's background made white by its tissue mask), so that the time estimate can count the tiles
the runtime computes once (``tilec.runtime.reuse``).

Convention: the input's image is ``height`` x ``width`` pixels; ``mask`` (True: background) is a
grid of cells over it, pixel ``(r, c)`` lying in cell ``(r * R // height, c * C // width)`` of an
``R`` x ``C`` mask, as ``tilec.slides.Slide.masked`` applies a tissue mask. Intervals are half-open.
"""

from __future__ import annotations

import numpy as np


class Background:
    """The background cells of one model input (module docstring)."""

    def __init__(self, mask: np.ndarray, height: int, width: int):
        mask = np.asarray(mask, dtype=bool)
        if mask.ndim != 2 or not mask.size:
            raise ValueError(f"a background mask is a non-empty 2-D array, got shape {mask.shape}")
        self.height, self.width = height, width
        self.cells = mask.shape
        self.sums = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), dtype=np.int64)  # summed-area table
        self.sums[1:, 1:] = (~mask).cumsum(axis=0).cumsum(axis=1)

    def constant(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Per row interval ``rows[i] = (start, stop)`` and column interval ``cols[j]``, whether the
        pixels ``rows[i]`` x ``cols[j]`` are all background (an empty read is)."""
        (row_lo, row_hi), (col_lo, col_hi) = (self._cells(bounds, size, cells) for bounds, size, cells in (
            (rows, self.height, self.cells[0]), (cols, self.width, self.cells[1])))
        s = self.sums
        tissue = (s[row_hi[:, None], col_hi[None, :]] - s[row_lo[:, None], col_hi[None, :]]
                  - s[row_hi[:, None], col_lo[None, :]] + s[row_lo[:, None], col_lo[None, :]])
        empty = (rows[:, 1] <= rows[:, 0])[:, None] | (cols[:, 1] <= cols[:, 0])[None, :]
        return (tissue == 0) | empty

    @staticmethod
    def _cells(bounds: np.ndarray, size: int, cells: int) -> tuple[np.ndarray, np.ndarray]:
        """The cells ``[lo, hi)`` that the pixel intervals ``bounds`` touch (some cell for an empty one)."""
        start = np.clip(bounds[:, 0], 0, size - 1)
        stop = np.clip(bounds[:, 1], start + 1, size)
        return start * cells // size, (stop - 1) * cells // size + 1

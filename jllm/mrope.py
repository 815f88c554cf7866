"""M-RoPE positions (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's multimodal rotary positions) on the
host, as transformers' `get_rope_index` computes them, for any stretch of a request's tokens.

A text token's three rows (time, height, width) are equal; an image's merged tokens, laid out
row-major over its `grid_h` x `grid_w` grid, take (start, start + row, start + column) where
`start` is the position its first token would have had; the tokens after an image continue
from start + max(grid_h, grid_w). So a token's positions follow from its index in the
sequence and the images before it: its shift (positions minus index) grows by
max(grid_h, grid_w) - length at each image. Past the prompt every row is the index plus the
request's `delta` (transformers' `mrope_position_deltas`).

A request's images are `spans` [k, 4] int: (first token, token count, grid_h, grid_w) per
image, in prompt order, in merged units (the language model's tokens). The engine computes
them at admission (`NewRequestData.mrope_spans`) and the runner each step's positions from
them (`runner/placement.py`). Host-side only: no JAX import.
"""

from __future__ import annotations

import numpy as np


def spans_of(items) -> np.ndarray:
    """[k, 4] int64 spans of a request's image items (engine/multimodal.py:ImageItem), in
    prompt order."""
    rows = [(it.offset, it.length, it.llm_grid[0], it.llm_grid[1]) for it in items]
    return np.asarray(rows, np.int64).reshape(-1, 4)


def _shifts(spans: np.ndarray) -> np.ndarray:
    """[k + 1]: the shift before each image, then after the last."""
    gain = np.maximum(spans[:, 2], spans[:, 3]) - spans[:, 1]
    return np.concatenate([[0], np.cumsum(gain)])


def delta(spans: np.ndarray) -> int:
    """Positions minus index past the prompt's last image."""
    return int(_shifts(spans)[-1]) if len(spans) else 0


def rope_positions(index: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """[3, n] int32 M-RoPE positions of a request's tokens at sequence indices `index` [n]."""
    index = np.asarray(index, np.int64)
    out = np.broadcast_to(index, (3, len(index))).copy()
    if len(spans) == 0:
        return out.astype(np.int32)
    shifts = _shifts(spans)
    ends = spans[:, 0] + spans[:, 1]
    before = np.searchsorted(ends, index, side="right")  # images wholly before each token
    out += shifts[before]
    inside = before < len(spans)
    inside[inside] = index[inside] >= spans[before[inside], 0]
    at = np.flatnonzero(inside)
    if at.size:
        img = spans[before[at]]
        start = img[:, 0] + shifts[before[at]]
        j = index[at] - img[:, 0]
        out[0, at] = start
        out[1, at] = start + j // img[:, 3]
        out[2, at] = start + j % img[:, 3]
    return out.astype(np.int32)

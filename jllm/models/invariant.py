"""Reductions in one fixed order, for the batch-invariant mode (jllm/config/batch_invariant.py).

XLA's CPU backend picks how to vectorize a reduction from the whole fused loop's shape, so
a row's sum over its last axis can round differently when more rows share the call (an
RMSNorm over 576 floats does from 8 rows on). Written as explicit elementwise adds, the order
is the program's: XLA does not reassociate floating-point adds, and each output element is
the same expression whatever the number of rows.

Glossary: D the reduced axis, L lanes of the first pass.
"""

from __future__ import annotations

LANES = 16


def row_sum(x):
    """x [..., D] -> [..., 1]: lane l of the first pass sums x[..., i * L + l] over i in
    order, then the L lanes are added as a tree of halves."""
    D = x.shape[-1]
    lanes = LANES if D % LANES == 0 else 1
    parts = x.reshape(*x.shape[:-1], D // lanes, lanes)
    acc = parts[..., 0, :]
    for i in range(1, D // lanes):
        acc = acc + parts[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc


def row_mean(x):
    """`row_sum` / D."""
    return row_sum(x) / x.shape[-1]

"""Small helpers shared by the host side and the runner (no JAX import)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)

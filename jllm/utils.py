"""Small helpers shared by the host side and the runner (no JAX import)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def partial_marker(text: str, markers) -> int:
    """The length of the longest tail of `text` that begins one of `markers` without being
    all of it: text a stream holds back until what follows says whether a marker starts."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest

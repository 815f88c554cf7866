"""Attention backends behind one interface (`base.AttentionBackend`): the C++ CPU kernel and
the Pallas TPU and GPU kernels of the ragged paged attention kit (`ragged.py`), and the XLA
attention (`xla.py`). The platform policy (`engine/platform.py`) picks a backend by name;
`get_backend` gives its object, which the model's attention layers call with their
`AttentionOptions` (`options.py`) and the step builder asks for its metadata.
"""

from __future__ import annotations

from jllm.attention.base import AttentionBackend, write_kv
from jllm.attention.options import AttentionOptions
from jllm.attention.ragged import CpuKernelBackend, PallasBackend
from jllm.attention.xla import XlaBackend, max_kv_chunk_pages

BACKENDS: dict[str, AttentionBackend] = {
    "cpu_kernel": CpuKernelBackend(),
    "xla": XlaBackend(),
    **{
        name: PallasBackend(name)
        for name in ("pallas", "pallas_interpret", "pallas_gpu", "pallas_gpu_interpret")
    },
}


def get_backend(name: str) -> AttentionBackend:
    """The backend object of an `attention_backend` name."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)}, got {name!r}.")
    return BACKENDS[name]


def block_table_pages(block_size: int) -> int:
    """The multiple of pages every block table's width is padded to (the runner's bucket
    policy, runner/buckets.py), whichever backend runs: the XLA path's largest KV chunk, so
    that each of its chunk sizes divides the table."""
    return max_kv_chunk_pages(block_size)


__all__ = [
    "AttentionBackend",
    "AttentionOptions",
    "BACKENDS",
    "block_table_pages",
    "get_backend",
    "write_kv",
]

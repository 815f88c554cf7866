"""jllm: vLLM's API on a JAX/XLA engine.

`LLM` is imported lazily so that the host-side modules (config, sampling params, scheduler,
block manager, engine core) stay importable without JAX.
"""

import importlib.util
import os


def _torch_missing() -> bool:
    try:
        return importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):
        return True


# transformers announces "PyTorch was not found..." when it is imported without torch; jllm
# uses transformers for configs and tokenizers only and never needs torch.
if _torch_missing():
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# JAX's GPU client takes 75% of the device by default, while vLLM's gpu_memory_utilization
# (0.9) is a share of the whole device. Unless the user chose how JAX allocates, its
# allocator may hold 95% (the rest is for the CUDA context and libraries outside it); the
# KV cache then takes gpu_memory_utilization of the device (jllm/runner/kv_cache.py). It
# takes effect if JAX's GPU backend starts after this import; CPU and TPU ignore it.
_ALLOCATOR_VARIABLES = (
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)
if not any(name in os.environ for name in _ALLOCATOR_VARIABLES):
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.95"

# One malloc arena, before any thread starts (jllm/cpu_heap.py: XLA's CPU steps otherwise
# fault on fresh pages every step).
from jllm import cpu_heap  # noqa: E402

cpu_heap.one_arena()

from jllm.config import EngineArgs  # noqa: E402
from jllm.outputs import (  # noqa: E402
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jllm.pooling_params import PoolingParams  # noqa: E402
from jllm.sampling_params import (  # noqa: E402
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from jllm.version import __version__ as __version__  # noqa: E402

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineArgs",
    "RequestOutputKind",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "PoolingParams",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]


def __getattr__(name: str):
    if name == "LLM":
        from jllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'jllm' has no attribute {name!r}")

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

from jllm.config import EngineArgs  # noqa: E402
from jllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from jllm.sampling_params import (  # noqa: E402
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"

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
]


def __getattr__(name: str):
    if name == "LLM":
        from jllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'jllm' has no attribute {name!r}")

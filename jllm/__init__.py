"""jllm: vLLM's API on a JAX/XLA engine.

`LLM` is imported lazily so that the host-side modules (config, sampling params, scheduler,
block manager, engine core) stay importable without JAX.
"""

from jllm.config import EngineArgs
from jllm.outputs import CompletionOutput, Logprob, RequestOutput
from jllm.sampling_params import (
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

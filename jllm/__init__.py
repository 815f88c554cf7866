"""jllm: vLLM's API on a JAX/XLA engine."""

from jllm.config import EngineArgs
from jllm.entrypoints.llm import LLM
from jllm.outputs import CompletionOutput, Logprob, RequestOutput
from jllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineArgs",
    "RequestOutputKind",
]

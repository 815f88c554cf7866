"""Custom logits processors (vLLM V1's engine-level `logits_processors=[...]`), as JAX.

vLLM's V1 processors keep per-row state updated by `update_state(BatchUpdate)` and run an
eager `apply(logits)` on the whole batch. jllm's sampler is one jitted executable per row
bucket, compiled at start-up, so a processor here has two halves:

- on the host, `row_state(params)` gives a request's fixed-shape state when it joins the
  batch (None: the processor leaves the request alone); the persistent input batch keeps
  it in the request's row until the request leaves, and every step gathers it per sample
  row next to the other sampling inputs (no extra transfer);
- on the device, `apply(logits, state, active)` is traced into the sampler: logits [R, V]
  float32, state [R, *state_shape], active [R] bool -> logits [R, V]. It must act only on
  active rows. A processor with `uses_output_index = True` also gets `output_index` [R]
  int32: the index in the request's output of the token each row samples (vLLM's
  processors read the output tokens so far; this is their count, drafts included).

Per-request arguments come from `SamplingParams.extra_args` (the server's `vllm_xargs`), as
in vLLM. A processor that `is_argmax_invariant` (it never changes the most likely token) is
applied after temperature on sampled rows only, like vLLM's min-p; the others right after
`logit_bias`, before the penalties. `validate_params` refuses bad arguments when the request
is added. Pass classes or "module:Class" names: `LLM(model, logits_processors=[MyProc])`;
see `examples/logits_processor.py`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from jllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsProcessorConfig:
    """What a processor may size itself by."""

    vocab_size: int
    max_num_seqs: int


class LogitsProcessor:
    """Base class: override `row_state`, `apply` and, as needed, the class attributes."""

    state_shape: tuple[int, ...] = ()  # per-row state, fixed for the processor
    uses_output_index = False  # apply(logits, state, active, output_index)
    state_dtype = np.int32  # 32-bit (int32, float32, uint32) or bool

    def __init__(self, config: LogitsProcessorConfig) -> None:
        self.config = config

    def is_argmax_invariant(self) -> bool:
        return False

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError for arguments this processor cannot take."""

    def row_state(self, params: SamplingParams):
        """The request's state (array-like of `state_shape`), or None to leave it alone."""
        raise NotImplementedError

    def apply(self, logits, state, active, output_index=None):
        """Traceable: logits [R, V] float32, state [R, *state_shape], active [R] bool; with
        `uses_output_index`, output_index [R] int32."""
        raise NotImplementedError


def load_logits_processors(specs, config: LogitsProcessorConfig) -> tuple[LogitsProcessor, ...]:
    """Instances of the given classes or "module:Class" names."""
    out = []
    for spec in specs or ():
        cls = spec
        if isinstance(spec, str):
            module, sep, name = spec.partition(":")
            if not sep or not module or not name:
                raise ValueError(
                    f"Invalid logits processor FQCN {spec!r}. Expected format: '<module>:<type>'."
                )
            cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(
                f"{spec!r} is not a jllm.logits_process.LogitsProcessor subclass (jllm's "
                "processors run inside the jitted sampler; see jllm/logits_process.py)."
            )
        proc = cls(config)
        dtype = np.dtype(proc.state_dtype)
        if dtype != np.bool_ and dtype.itemsize != 4:
            raise ValueError(f"{cls.__name__}.state_dtype must be 32-bit or bool, got {dtype}.")
        out.append(proc)
    return tuple(out)

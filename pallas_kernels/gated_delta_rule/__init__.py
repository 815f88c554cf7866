"""Gated delta rule kit: the linear attention of Qwen3-Next's and Qwen3.5's gated DeltaNet
layers over a flat ragged batch (any mix of decodes, prefill chunks and verification rows),
each request row resuming from its own recurrent state.

Per value head, with state S [K, V] (keys x values), a token with query q, key k, value v,
log decay g <= 0 and write strength beta in (0, 1) does (the delta rule, gated):

    S = exp(g) * S
    S = S + k (beta (v - k^T S))^T      # write what S does not yet predict for k
    o = q^T S

q and k are L2-normalised first (``use_qk_l2norm``, as the models run it) and q scaled by
K^-1/2; each query/key head serves ``Hv / Hk`` consecutive value heads.

``gated_delta_rule_reference`` runs the recurrence token by token: the oracle.
``gated_delta_rule_chunked`` is the XLA path: every row's tokens are cut into chunks of C,
the work inside a chunk done at once with a unit lower-triangular solve (the WY / UT form
of DeltaNet's chunked algorithm, as the FLA library's ``chunk_gated_delta_rule``), and one
scan over the chunks carries each row's state. ``causal_conv`` is the short depthwise
convolution in front of it over the same flat batch, each row resuming from its conv window.
``gated_delta_rule_recurrent`` is the XLA update of a decode-only step (every row one token,
no scan), and ``gated_delta_rule_xla`` picks it or the chunked path per step.
``gated_delta_rule`` (Pallas TPU) and ``gated_delta_rule_gpu`` (Pallas on Triton) are the
same contract as kernels, each with a chunk kernel and a recurrent one (``interpret=True``
runs them on the CPU); ``gated_delta_rule_sharded`` runs any of them with the heads split
over tensor-parallel devices. ``validate_inputs`` holds the shared static checks.
"""

from .chunked import chunk_plan, gated_delta_rule_chunked
from .conv import causal_conv, causal_conv_reference
from .gpu import gated_delta_rule_gpu, unsupported_shape
from .kernel import gated_delta_rule
from .recurrent import gated_delta_rule_recurrent, gated_delta_rule_xla
from .reference import gated_delta_rule_reference
from .sharded import gated_delta_rule_sharded
from .validation import l2_normalize, token_rows, validate_inputs

__all__ = [
    "causal_conv",
    "causal_conv_reference",
    "chunk_plan",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_gpu",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_reference",
    "gated_delta_rule_sharded",
    "gated_delta_rule_xla",
    "l2_normalize",
    "token_rows",
    "unsupported_shape",
    "validate_inputs",
]

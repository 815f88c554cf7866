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
``validate_inputs`` holds the shared static checks.
"""

from .chunked import chunk_plan, gated_delta_rule_chunked
from .conv import causal_conv, causal_conv_reference
from .reference import gated_delta_rule_reference
from .validation import l2_normalize, token_rows, validate_inputs

__all__ = [
    "causal_conv",
    "causal_conv_reference",
    "chunk_plan",
    "gated_delta_rule_chunked",
    "gated_delta_rule_reference",
    "l2_normalize",
    "token_rows",
    "validate_inputs",
]

"""A layer's attention options as one record: what the layer asks of the backend besides its
q, k and v.

A layer builds its `AttentionOptions` once and hands it to `ctx.attend` every step; the
backend's `attend` takes it, and each backend declares the options it implements
(`AttentionBackend.supported`, names of the fields below) and refuses the rest by name
(`AttentionBackend.check`). The engine collects the options of every layer of a model
(`options_in`) and checks them against the backend before anything is compiled, so a model
the backend cannot run fails at start-up, and `auto` takes the XLA attention instead.

The record is frozen and hashable (it is part of what the step's jit traces, like the
backend), and holds no arrays: a layer with attention sinks says so here (`sinks=True`) and
passes its learned per-head logits to `attend` as an array.

A latent layer (`latent=True`, multi-head latent attention in its absorbed form: DeepSeek
V2/V3) caches one vector per token and layer, shared by every query head: the compressed
latent c_kv (kv_lora_rank R lanes, after its norm) then the rotated key k_pe (qk_rope_head_dim
r lanes). Its group's cache is [L, B, S, R + r], with no head axis and no separate values, and
its `attend` takes
- q [T, N, R + r]: each head's no-rope query absorbed through W_UK into R lanes, then its
  rotated q_pe;
- k, the new latents [c_kv, k_pe]: [T, R + r] or [T, 1, R + r];
- v=None (the values are the cached latents' first R lanes);
and returns [T, N, R], the latent each head reads, which the layer projects through W_UV.
Score(t, s) = q[t] . cache[s] * scale: multi-query attention with one KV head whose value is
the first R lanes of its key. The layer sets `v_head_dim=R` (kv_lora_rank: the width attention
returns, not the checkpoint's v_head_dim, the output of W_UV) and its scale as the expanded
form has it (qk_head_dim ** -0.5, times DeepSeek's YaRN mscale squared where it has one).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable

# Each optional field, as a refusal names it.
OPTION_NAMES = {
    "window": "sliding window",
    "soft_cap": "attention soft cap",
    "chunk_size": "chunked local attention",
    "sinks": "attention sinks",
    # Before v_head_dim, which every latent layer sets: a refusal names the latent first.
    "latent": "MLA latent attention",
    "v_head_dim": "value head size unlike the key head size",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionOptions:
    """Scores are q . k * scale, then soft_cap * tanh(score / soft_cap) when soft_cap is set.
    A query at position p sees the keys at positions <= p and, with `window`, > p - window
    (vLLM's and transformers' sliding window: the query and the window - 1 keys before it);
    with `chunk_size` C, >= floor(p / C) * C (Llama 4's chunked local attention: only its own
    chunk). With `sinks`, each query head h's softmax denominator has one more term,
    exp(sinks[h] - m), a key of score sinks[h] (not scaled nor capped) and value zero
    (gpt-oss). `v_head_dim`: the values' head size where it differs from the queries' and
    keys' (MLA expanded to heads: keys 192, values 128); the output has the values' size."""

    scale: float
    window: int | None = None
    soft_cap: float | None = None
    chunk_size: int | None = None
    sinks: bool = False
    latent: bool = False
    v_head_dim: int | None = None

    def __post_init__(self):
        if self.scale is None:
            raise ValueError("attention options need the layer's scale")
        # Plain Python numbers, so that the record hashes, compares and prints as it reads.
        for name, kind, cast in (
            ("scale", numbers.Real, float),
            ("soft_cap", numbers.Real, float),
            ("window", numbers.Integral, int),
            ("chunk_size", numbers.Integral, int),
            ("v_head_dim", numbers.Integral, int),
        ):
            object.__setattr__(self, name, _positive(name, getattr(self, name), kind, cast))
        if not isinstance(self.sinks, bool):
            raise ValueError(f"attention sinks says whether the layer has them, not {self.sinks!r}")
        if not isinstance(self.latent, bool):
            raise ValueError(f"latent says whether the layer is MLA's, not {self.latent!r}")
        if self.latent and self.v_head_dim is None:
            raise ValueError(
                "a latent (MLA) layer's values are the first v_head_dim lanes of its latent: "
                "set v_head_dim to its kv_lora_rank"
            )

    def used(self) -> tuple[str, ...]:
        """The optional fields this layer sets (the names `AttentionBackend.supported` holds)."""
        return tuple(name for name in OPTION_NAMES if getattr(self, name) not in (None, False))

    def check_sinks(self, sinks, num_heads: int) -> None:
        """Raises ValueError unless `sinks` is given exactly when the options say the layer has
        them, as one value per query head ([N])."""
        if self.sinks != (sinks is not None):
            raise ValueError(
                "attention sinks: the layer's options say "
                f"sinks={self.sinks}, but {'none were' if sinks is None else 'they were'} given"
            )
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(
                f"attention sinks must be [N={num_heads}] (one per query head), got shape "
                f"{tuple(sinks.shape)}"
            )


def _positive(name: str, value, kind, cast):
    """`value` as `cast` (None stays None); ValueError unless it is a positive `kind`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        what = "int" if kind is numbers.Integral else "number"
        none = "" if name == "scale" else " or None"
        raise ValueError(f"attention {name} must be a positive {what}{none}, not {value!r}")
    return cast(value)


def options_in(module) -> frozenset[AttentionOptions]:
    """Every `AttentionOptions` a Flax NNX module tree holds as an attribute of one of its
    modules (each attention layer's, however the family names it)."""
    from flax import nnx

    return frozenset(
        value
        for _, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Module)
        for value in vars(node).values()
        if isinstance(value, AttentionOptions)
    )


def describe(options: Iterable[AttentionOptions]) -> str:
    """The optional features a set of layers' options use, for a log line."""
    used = sorted({name for o in options for name in o.used()})
    return ", ".join(OPTION_NAMES[name] for name in used) or "none"

"""The step context: what one step's forward carries down to every layer besides the hidden
states, as one registered pytree (`StepContext`), so that a new per-token input (an adapter
slot, an image embedding) is a field here instead of a new argument on every signature.

The runner builds it from the step's inputs; the decoder (`models/decoder.py`) completes it
(`live`) and, per layer, says which KV-cache group and which row of that group's stacked
cache the layer owns (`at_layer`). A layer's attention calls `ctx.attend`, which picks the
group's cache and metadata and runs the backend with the layer's `AttentionOptions`
(jllm/attention/options.py; around it, over a float8 cache, the layer's KV-cache scales where
the model has them: model_loader/kv_scales.py). Every `Linear` takes the context, so that a
LoRA delta can read each token's adapter slot; fields a step does not use are None, which
costs nothing in the compiled step.

KV-cache groups: the layers of one attention kind share a group (one block table, one
stacked cache [Lg, B, S, 2K, H] whose row r is the group's r-th layer); `attn` holds each
group's attention metadata and `attend` reads and returns the tuple of caches, one per pool:
groups of one pool (`pools`, by group) share its array, each through its own block table.
A group of per-request state (linear attention, models/state.py) is not attention: its
metadata is a `StateMetadata`, its pool a tuple of state arrays, and its layers call
`load_state` and `store_state` instead of `attend`.

Glossary: T tokens, D model dim.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jllm.attention.options import AttentionOptions
from jllm.models import state


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "positions",
        "attn",
        "live",
        "layer",
        "lora_slots",
        "embeds",
        "embeds_mask",
        "deep_embeds",
    ],
    meta_fields=["backend", "group", "pools", "routes"],
)
@dataclasses.dataclass(frozen=True)
class StepContext:
    positions: jax.Array  # [T] token positions ([3, T] for M-RoPE's three rows)
    attn: tuple  # each KV-cache group's attention metadata, in the model's group order
    backend: object = None  # the AttentionBackend (jllm/attention/): static
    live: jax.Array | None = None  # [T] bool: the tokens that are not padding
    layer: jax.Array | None = None  # the current layer's row in its group's cache (int32)
    group: int = 0  # the current layer's KV-cache group: static
    lora_slots: jax.Array | None = None  # [T] int32 adapter slot per token (0: none)
    embeds: jax.Array | None = None  # [T, D] embeddings that replace the tokens' own
    embeds_mask: jax.Array | None = None  # [T] bool: where `embeds` replaces them
    # [Ld, T, D] DeepStack (Qwen3-VL): added, where `embeds_mask`, to the hidden states after
    # each of the first Ld decoder layers
    deep_embeds: jax.Array | None = None
    pools: tuple = ()  # each group's pool, its cache's index (static; empty: one per group)
    # enable_return_routed_experts: the current layer's RouteLog (below), where its
    # experts' router leaves the step's top-k expert ids; None: not recorded (static)
    routes: object = None

    def replace(self, **changes) -> StepContext:
        return dataclasses.replace(self, **changes)

    def at_layer(self, group: int, row) -> StepContext:
        """The context of a layer: its KV-cache group and its row in that group's cache."""
        return self.replace(group=group, layer=row)

    @property
    def cache_index(self) -> int:
        """The current layer's cache among the step's caches: its group's pool."""
        return self.pools[self.group] if self.pools else self.group

    def load_state(self, kv_caches: tuple) -> tuple:
        """The current layer's per-request state at the step's start, for a group of
        per-request state: each of its state arrays as [R, *shape], zeros for rows that start
        fresh (models/state.py)."""
        md = self.attn[self.group]
        return state.load_state(kv_caches[self.cache_index], self.layer, md)

    def store_state(self, kv_caches: tuple, states: tuple) -> tuple:
        """The step's caches with the current layer's rows' `states` ([R, *shape] each, as
        `load_state` gave them) written at their slots; padding rows write nothing."""
        c = self.cache_index
        pool = state.store_state(kv_caches[c], self.layer, self.attn[self.group], states)
        return (*kv_caches[:c], pool, *kv_caches[c + 1 :])

    def attend(
        self,
        q,
        k,
        v,
        kv_caches: tuple,
        *,
        options: AttentionOptions | None = None,
        sinks=None,
        kv_scales=None,
        scale=None,
        window=None,
        soft_cap=None,
    ):
        """The current layer's attention over its group's cache: q [T, N, H], k [T, K, H],
        v [T, K, Hv] -> (out [T, N, Hv], the step's caches, one per pool, with this group's
        pool's updated). An MLA latent layer (`options.latent`) passes its new latents as k
        and no v: its values are the latents' first lanes.

        options: the layer's AttentionOptions (jllm/attention/options.py), built once with
        the layer; or, without them, `scale`, `window` and `soft_cap` as keywords, which make
        the record here. sinks: the layer's [N] sink logits when options.sinks.

        kv_scales: the layer's (k_scale, v_scale) float32 scalars, or None. Over a float8
        cache the backend then attends with q * k_scale, k / k_scale and v / v_scale, which
        it writes and reads as it always does, and its output is multiplied by v_scale: the
        scores q.k and the sum of p.v are unchanged while the cache holds k / k_scale and
        v / v_scale. Outside every kernel, so each backend takes them alike; a cache of
        another dtype ignores them. A latent layer's values are its keys' lanes, so they
        share the key's scale."""
        if options is None:
            if scale is None:
                raise ValueError("ctx.attend needs the layer's options (or at least scale=)")
            options = AttentionOptions(scale=scale, window=window, soft_cap=soft_cap)
        elif (scale, window, soft_cap) != (None, None, None):
            raise ValueError("ctx.attend takes options= or scale/window/soft_cap, not both")
        g, c = self.group, self.cache_index
        scaled = kv_scales is not None and kv_caches[c].dtype.itemsize == 1  # float8 (bytes)
        if scaled:
            k_scale, v_scale = kv_scales
            if v is None:  # MLA's latent: one vector, one scale
                v_scale = k_scale
            else:
                v = _over(v, v_scale)
            q, k = _times(q, k_scale), _over(k, k_scale)
        out, cache = self.backend.attend(
            q,
            k,
            v,
            kv_caches[c],
            self.layer,
            self.attn[g],
            options,
            sinks=sinks,
        )
        if scaled:
            out = _times(out, v_scale)
        return out, (*kv_caches[:c], cache, *kv_caches[c + 1 :])


class RouteLog:
    """One layer's routing record within one traced step (`enable_return_routed_experts`):
    a mixture of experts (models/moe.py) sets `ids`, its top-k experts per token [T, k]
    int32, and the decoder's scan body reads them back after the layer, in the same trace
    (models/decoder.py); a dense layer leaves None. A fresh log per layer call: it is never
    read outside the trace that wrote it."""

    def __init__(self) -> None:
        self.ids = None


def _times(x, factor):
    """x * a float32 scalar, in float32, rounded once to x's dtype."""
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


def _over(x, factor):
    """x / a float32 scalar, in float32, rounded once to x's dtype."""
    return (x.astype(jnp.float32) / factor).astype(x.dtype)

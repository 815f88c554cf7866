"""The interface every attention backend implements, and the K/V write they share.

A backend is a frozen dataclass (hashable: the step's jit takes it as a static argument) that
- builds the metadata its kernel reads from the step's `FlatBatch` (`build_metadata`);
- writes a layer's new K/V into the stacked cache and attends (`attend`), with the layer's
  `AttentionOptions` (`options.py`: scale, sliding window, soft cap, chunked local
  attention, sinks, MLA's latent attention, value head size) and, for a layer with sinks,
  their per-head logits;
- declares what it supports: where it runs and which dtypes and shapes it takes
  (`unsupported` gives the reason it cannot; `prepare` builds its kernel), and which
  optional fields of the options it implements (`supported`; `check` refuses the rest by
  name, and the engine runs it on every layer's options at start-up);
- declares the batch layout it reads (`prefill_tile`): rows of several tokens packed back to
  back after the decode rows (None: the ragged kernels read any row at any offset), or each
  starting on, and filling, tiles of that many tokens (the XLA path's tiles). The step
  builder lays the batch out so, and the scheduler charges its budget so;
- runs the gated delta rule of a linear-attention layer (`gated_delta_rule`: the XLA path
  here, the Pallas kernels in the Pallas backends), its heads split under tensor
  parallelism.

Both write the new K/V into the cache first (padding tokens write to an out-of-range slot
that is dropped), so every query sees its own chunk and any block shared in the same step.
A float8 cache (`kv_cache_dtype="fp8"`) takes them converted with saturation, and every
backend reads its pages into the compute dtype; on the CPU it holds the float8 bytes as uint8
(`md.kv_fp8` names the format: XLA's CPU backend updates float8 arrays element by element).

A latent (MLA) layer's cache is [L, B, S, H], one latent vector of H lanes per token and no
head axis (`options.py` gives its `attend`); `write_latent` scatters its new latents, into a
float8 cache alike (the whole vector in one format, as vLLM's standard fp8 MLA cache; its one
scale serves keys and values both, since the values are the keys' first lanes). Under tensor
parallelism the latent is not split: every device holds the whole cache, as vLLM replicates
it, and only the query heads are split.

Glossary: T tokens, K kv heads, H head dim, B blocks, S block size, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jllm.attention.options import OPTION_NAMES, AttentionOptions
from pallas_kernels.gated_delta_rule import gated_delta_rule_sharded, gated_delta_rule_xla
from pallas_kernels.ragged_paged_attention import to_cache
from sharding import MODEL_AXIS


def write_kv(kv_cache, layer, k, v, slot_mapping, fp8_dtype=None):
    """Scatter new K/V [T, K, H] into layer `layer` of the cache [L, B, S, 2K, H], K and V
    interleaved. Indexing the stacked cache directly keeps the update in place."""
    NL, B, S, K2, H = kv_cache.shape
    T, K, _ = k.shape
    kv = to_cache(jnp.stack([k, v], axis=2).reshape(T, K2, H), kv_cache.dtype, fp8_dtype)
    flat = kv_cache.reshape(NL, B * S, K2, H).at[layer, slot_mapping].set(kv, mode="drop")
    return flat.reshape(NL, B, S, K2, H)


def write_latent(kv_cache, layer, latent, slot_mapping, fp8_dtype=None):
    """Scatter new latents [T, H] into layer `layer` of a latent cache [L, B, S, H]."""
    NL, B, S, H = kv_cache.shape
    new = to_cache(latent, kv_cache.dtype, fp8_dtype)
    flat = kv_cache.reshape(NL, B * S, H).at[layer, slot_mapping].set(new, mode="drop")
    return flat.reshape(NL, B, S, H)


def latent_inputs(q, k, v, kv_cache, options: AttentionOptions):
    """A latent layer's new latents as [T, H], after checking its `attend` arguments: q
    [T, N, H], k [T, H] or [T, 1, H], v None, the cache [L, B, S, H], v_head_dim < H."""
    if v is not None:
        raise ValueError("a latent layer's values are its latents' first lanes: pass v=None")
    if kv_cache.ndim != 4:
        raise ValueError(
            f"a latent layer's cache is [L, B, S, H] (no head axis), got shape {kv_cache.shape}"
        )
    T, _, H = q.shape
    if kv_cache.shape[-1] != H or tuple(k.shape) not in ((T, H), (T, 1, H)):
        raise ValueError(
            f"a latent layer takes q [T, N, H], k [T, H] or [T, 1, H] and its cache "
            f"[L, B, S, H] of one H, got q {q.shape}, k {k.shape}, cache {kv_cache.shape}"
        )
    if not options.v_head_dim < H:
        raise ValueError(
            f"a latent layer's values (v_head_dim={options.v_head_dim}) are the first lanes "
            f"of its latent of {H}: fewer than all"
        )
    return k.reshape(T, H)


def write_step_kv(kv_cache, layer, k, v, md):
    """`write_kv` with the step's metadata: its slots, and the float8 format of a cache held
    as bytes. -> (the updated cache, that format or None)."""
    fp8 = None if md.kv_fp8 is None else jnp.dtype(md.kv_fp8)
    return write_kv(kv_cache, layer, k, v, md.slot_mapping, fp8), fp8


def write_step_latent(kv_cache, layer, latent, md):
    """`write_latent` with the step's metadata. -> (the updated cache, its float8 format)."""
    fp8 = None if md.kv_fp8 is None else jnp.dtype(md.kv_fp8)
    return write_latent(kv_cache, layer, latent, md.slot_mapping, fp8), fp8


def model_mesh():
    """The abstract mesh when the heads are split over its model axis, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if not mesh.empty and mesh.shape.get(MODEL_AXIS, 1) > 1 else None


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    # The optional fields of AttentionOptions this backend implements (the scale it always
    # takes): a subset of options.OPTION_NAMES.
    supported: ClassVar[frozenset[str]] = frozenset()
    prefill_tile = None  # the tile rows of several tokens fill (an int), or None: packed

    def check(self, options: AttentionOptions) -> None:
        """Refuses, naming the option and this backend, what it does not implement."""
        for field in options.used():
            if field not in self.supported:
                value = getattr(options, field)
                raise ValueError(
                    f"attention backend {self.name!r} has no {OPTION_NAMES[field]} "
                    f"({field}={value!r})"
                )

    def unsupported(
        self, platform: str, dtype, head_dim: int, block_size: int, fp8_cache: bool
    ) -> str | None:
        """Why this backend cannot run a model of these shapes on `platform`, or None."""
        return None

    def prepare(self) -> None:
        """Makes the backend ready to run (builds its kernel); raises when it cannot."""

    def build_metadata(self, flat):
        raise NotImplementedError

    def attend(self, q, k, v, kv_cache, layer, md, options: AttentionOptions, sinks=None):
        """q [T, N, H], k [T, K, H], v [T, K, Hv] (Hv = options.v_head_dim or H), the stacked
        cache [L, B, S, 2K, H] and this layer's index -> (out [T, N, Hv], the updated cache).
        A latent layer (options.latent): q [T, N, H], the new latents k [T, H] (or [T, 1, H]),
        v None and its cache [L, B, S, H] -> out [T, N, Hv]. `sinks`: the layer's [N] sink
        logits when options.sinks, else None."""
        raise NotImplementedError

    def delta_rule_kernel(self, key_dim: int, value_dim: int):
        """The gated delta rule path this backend runs (the kit's contract): XLA's."""
        return gated_delta_rule_xla

    def gated_delta_rule(self, q, k, v, g, beta, state, md):
        """A linear-attention layer's gated delta rule over the step's rows (the kit's
        contract: pallas_kernels/gated_delta_rule, with md's query_start and query_lens):
        q, k [T, Hk, K], v [T, Hv, V], g, beta [T, Hv], state [R, Hv, K, V] -> (o
        [T, Hv, V] float32, the new state)."""
        kernel = self.delta_rule_kernel(q.shape[-1], v.shape[-1])
        args = (q, k, v, g, beta, state, md.query_start, md.query_lens)
        mesh = model_mesh()
        if mesh is not None:
            return gated_delta_rule_sharded(mesh, MODEL_AXIS, *args, kernel=kernel)
        return kernel(*args)

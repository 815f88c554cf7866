"""KV-cache specs: what one KV-cache group keeps, per token or per request, as vLLM's
`KVCacheSpec` classes (vllm/v1/kv_cache_interface.py) in our shape.

A model's layers of one attention kind form a KV-cache group (models/decoder.py), and the
group's spec says everything the rest of the engine needs about it, in one place:

- its memory: the arrays its layers keep (`cache_arrays`: stacked over the group's layers,
  so the decoder scans them) and what one block of them takes (`page_size_bytes`), as held
  by one device (`shard`);
- what a request holds (`num_blocks`: the length of its block list; `max_blocks_per_request`:
  how many of them are live at once), and which blocks a step may free (those wholly before
  `num_skipped_tokens`, which no query of the step reads);
- what a prefix-cache hit of n blocks needs from it: the blocks from `hit_start(n)` to n
  cached (or, for a group that caches nothing, no hit but the empty one);
- how its pool is sized next to the others (`pool_cap`).

The kinds: full attention (every token's K and V, for good), a sliding window (the last W
tokens), chunked local attention (a query at p reads the keys from floor(p / C) * C on), an
MLA latent (one `kv_lora_rank + qk_rope_head_dim` vector per token, no heads, read as full
attention reads) and per-request state (`MambaSpec`: a linear-attention layer's fixed-size
recurrent and conv state, one slot per request, not paged by tokens).

Block size and cache dtype are the engine's, the same for every group (jllm has one of
each), so they are arguments rather than fields, and a model declares its specs from its
config alone. A spec's `num_layers` counts its group's layers (1: one layer, as a family
describes a layer's kind).

Pools (vLLM's hybrid allocator): groups whose cache arrays are identical share one block pool
and one physical array (`share_pools`), row r of each group being the same array row (vLLM
shares tensors by position), so a block a sliding group frees serves full attention. Blocks
of equal bytes but other shapes keep their own pools: an array has one shape.

Sits below engine/, runner/ and models/, which all read it (numpy only, no JAX), at the top
of the package beside vLLM's module name, as `scheduler_output.py` is for the records the
engine and the runner share.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from jllm.utils import cdiv


def windowed_pool_cap(span: int, block_size: int, max_num_seqs: int, max_step_tokens: int):
    """The most blocks a group whose requests each keep `span` tokens before their step holds
    at once, the null block included: each of `max_num_seqs` requests keeps its span plus the
    step's own tokens (all of them together at most `max_step_tokens`), two partial blocks at
    either end."""
    return cdiv(max_num_seqs * span + max_step_tokens, block_size) + 2 * max_num_seqs + 1


def sliding_pool_cap(window: int, block_size: int, max_num_seqs: int, max_step_tokens: int):
    """`windowed_pool_cap` of a sliding window W: each request keeps the W - 1 keys before its
    step."""
    return windowed_pool_cap(window - 1, block_size, max_num_seqs, max_step_tokens)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """A KV-cache group's layers, paged by tokens: its block list has one entry per
    `block_size` tokens, and (unless a subclass says otherwise) every block stays live and
    a prefix hit needs them all."""

    num_layers: int = 1
    prefix_cacheable: ClassVar[bool] = True  # whether its full blocks are cached for hits

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"A KV-cache group holds at least one layer, got {self}.")

    # ---- memory ----------------------------------------------------------------------------
    def cache_arrays(self, num_blocks: int, block_size: int, dtype) -> tuple[tuple, ...]:
        """The group's arrays, as ((shape, dtype), ...), each stacked over its layers:
        [Lg, num_blocks, ...]."""
        raise NotImplementedError

    def page_size_bytes(self, block_size: int, dtype) -> int:
        """One block of every layer of the group (one request's slot for per-request state)."""
        arrays = self.cache_arrays(1, block_size, dtype)
        return sum(math.prod(shape) * np.dtype(dt).itemsize for shape, dt in arrays)

    def shard(self, tp: int, pp: int) -> KVCacheSpec:
        """What one device holds: the layers split over `pp` pipeline stages (and, where the
        kind has heads, its heads over `tp` devices)."""
        return dataclasses.replace(self, num_layers=self.num_layers // pp)

    def pool_key(self) -> tuple:
        """Equal for groups whose arrays are identical at any (common) block size and cache
        dtype: those may share a pool and its arrays."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    # ---- a step's metadata -------------------------------------------------------------------
    def step_fields(self, dtype) -> dict:
        """What the attention backends read of this group in a step besides its slots and
        block tables (`FlatBatch`'s fields, jllm/attention/metadata.py): one token's bytes
        in one layer (`kv_token_bytes`, whole, as the step's arrays are), and what bounds the
        keys a query reads (a sliding `window`, a local `chunk_size`)."""
        return {"kv_token_bytes": self.page_size_bytes(1, dtype) // self.num_layers}

    # ---- what a request holds --------------------------------------------------------------
    def num_blocks(self, num_tokens: int, block_size: int) -> int:
        """The length of the block list of a request with `num_tokens` slots."""
        return cdiv(num_tokens, block_size)

    def num_skipped_tokens(self, position: int) -> int:
        """The tokens before `position` that no query from `position` on reads: a step from
        there frees the blocks wholly before them (vLLM's `get_num_skipped_tokens`)."""
        return 0

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The most live blocks one request of `num_tokens` tokens (lookahead slots included)
        holds when a step computes at most `max_step_tokens` of them (drafts and lookahead
        included): what start-up checks a pool against and sizes it by."""
        return cdiv(num_tokens, block_size)

    def pool_cap(self, block_size: int, max_num_seqs: int, max_step_tokens: int) -> int | None:
        """The most blocks `max_num_seqs` requests hold at once, the null block included;
        None when that grows with the context (the pool takes the spare memory)."""
        return None

    # ---- prefix caching --------------------------------------------------------------------
    def hit_start(self, num_hit_blocks: int, block_size: int) -> int:
        """The first block a prefix hit of `num_hit_blocks` blocks needs cached: the steps
        after the hit read from there on, and the blocks before it stay NULL."""
        return self.num_skipped_tokens(num_hit_blocks * block_size) // block_size


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Attention over K and V heads: [Lg, B, S, 2K, H] (K and V interleaved on the head
    axis), split over TP devices by kv head."""

    num_kv_heads: int
    head_size: int

    def cache_arrays(self, num_blocks: int, block_size: int, dtype) -> tuple[tuple, ...]:
        shape = (self.num_layers, num_blocks, block_size, 2 * self.num_kv_heads, self.head_size)
        return ((shape, np.dtype(dtype)),)

    def shard(self, tp: int, pp: int) -> AttentionSpec:
        return dataclasses.replace(
            self, num_layers=self.num_layers // pp, num_kv_heads=self.num_kv_heads // tp
        )

    def pool_key(self) -> tuple:
        return ("kv", self.num_layers, self.num_kv_heads, self.head_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token's K and V, for as long as the request runs."""

    def describe(self) -> str:
        return "full attention"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A sliding window of W tokens: the query at p reads keys p - W + 1 .. p. Positions
    never move back (a rejected draft is recomputed from past the step's first position),
    so the blocks wholly before a step's window are freed for good, and a request holds a
    bounded span of blocks however long it runs."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"A sliding window is at least 1 token, got {self.sliding_window}.")

    def describe(self) -> str:
        return f"sliding window {self.sliding_window}"

    def step_fields(self, dtype) -> dict:
        return super().step_fields(dtype) | {"window": self.sliding_window}

    def num_skipped_tokens(self, position: int) -> int:
        return max(0, position - self.sliding_window + 1)

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """A step of n tokens from c holds c - W + 1 .. c + n - 1, a span of W - 1 + n
        tokens, which straddles at most cdiv(span - 1, S) + 1 blocks."""
        span = self.sliding_window - 1 + max_step_tokens
        return min(cdiv(num_tokens, block_size), cdiv(span - 1, block_size) + 1)

    def pool_cap(self, block_size: int, max_num_seqs: int, max_step_tokens: int) -> int:
        return sliding_pool_cap(self.sliding_window, block_size, max_num_seqs, max_step_tokens)


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (Llama 4's local layers): the context is cut into chunks of C
    tokens and the query at p reads keys floor(p / C) * C .. p. A step frees the blocks
    wholly before its first position's chunk."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_chunk_size < 1:
            raise ValueError(f"An attention chunk is at least 1 token, got {self}.")

    def describe(self) -> str:
        return f"chunked local attention {self.attention_chunk_size}"

    def step_fields(self, dtype) -> dict:
        return super().step_fields(dtype) | {"chunk_size": self.attention_chunk_size}

    def num_skipped_tokens(self, position: int) -> int:
        return position // self.attention_chunk_size * self.attention_chunk_size

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """A step of n tokens from c holds its chunk's start .. c + n - 1, a span of at most
        C - 1 + n tokens, which starts at a multiple of gcd(C, S) in its block: at worst
        S - gcd(C, S) tokens in."""
        chunk, span = self.attention_chunk_size, self.attention_chunk_size - 1 + max_step_tokens
        offset = block_size - math.gcd(chunk, block_size)
        return min(cdiv(num_tokens, block_size), (offset + span - 1) // block_size + 1)

    def pool_cap(self, block_size: int, max_num_seqs: int, max_step_tokens: int) -> int:
        span = self.attention_chunk_size - 1
        return windowed_pool_cap(span, block_size, max_num_seqs, max_step_tokens)


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek's MLA): one compressed latent of
    `kv_lora_rank` plus the `qk_rope_head_dim` rotary key per token, shared by every head,
    [Lg, B, S, kv_lora_rank + qk_rope_head_dim]. Held and hit as full attention; not split
    over TP devices (every device holds the whole latent, as in vLLM)."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    def cache_arrays(self, num_blocks: int, block_size: int, dtype) -> tuple[tuple, ...]:
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        return (((self.num_layers, num_blocks, block_size, latent), np.dtype(dtype)),)

    def pool_key(self) -> tuple:
        return ("latent", self.num_layers, self.kv_lora_rank + self.qk_rope_head_dim)

    def describe(self) -> str:
        return f"MLA latent {self.kv_lora_rank}+{self.qk_rope_head_dim}"


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Per-request state (vLLM's MambaSpec: Mamba, linear attention, gated delta nets): each
    layer keeps, per request, fixed-size arrays of `shapes` and `dtypes` (a conv window and
    a recurrent state), [Lg, slots, *shape] each, whatever the context length. A request's
    block list is its one slot: taken at admission, freed when it finishes or is preempted,
    never skipped. `head_axes` names, per array, the dimension of its shape that tensor
    parallelism splits (its heads), or None: replicated. Block size and cache dtype do not
    apply.

    Prefix hits: a hit of n blocks needs the state after n * S tokens. With
    `cache_interval` C (tokens, a multiple of the block size; vLLM's `mamba_cache_mode=
    "align"` with `mamba_block_size`) the state after each multiple of C a step ends at is
    snapshotted into a slot of the pool, kept in the prefix cache under that block's key
    (engine/single_type_manager.py: StateManager), and a hit is the longest such snapshot.
    With 0 (vLLM's "none" mode) the group caches nothing and accepts no hit but the empty
    one, which turns prefix caching off for the model."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    head_axes: tuple[int | None, ...] = ()  # () : none split
    cache_interval: int = 0
    # Speculative decoding: each request also holds a slot with its state before its last
    # verification step, which a step that rejected drafts restores (StateManager).
    backups: bool = False

    @property
    def prefix_cacheable(self) -> bool:
        return self.cache_interval > 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(f"Per-request state needs one dtype per state shape, got {self}.")
        if self.head_axes and len(self.head_axes) != len(self.shapes):
            raise ValueError(f"Per-request state needs one head axis per state shape, got {self}.")

    def array_axes(self) -> tuple[tuple[str | None, ...], ...]:
        """Each array's logical axes after [Lg, slots]: "heads" on its head axis."""
        heads = self.head_axes or (None,) * len(self.shapes)
        return tuple(
            tuple("heads" if d == h else None for d in range(len(shape)))
            for shape, h in zip(self.shapes, heads, strict=True)
        )

    def shard(self, tp: int, pp: int) -> MambaSpec:
        shapes = tuple(
            tuple(n // tp if a == "heads" else n for n, a in zip(shape, axes, strict=True))
            for shape, axes in zip(self.shapes, self.array_axes(), strict=True)
        )
        return dataclasses.replace(self, num_layers=self.num_layers // pp, shapes=shapes)

    def cache_arrays(self, num_blocks: int, block_size: int, dtype) -> tuple[tuple, ...]:
        return tuple(
            ((self.num_layers, num_blocks, *shape), np.dtype(dt))
            for shape, dt in zip(self.shapes, self.dtypes, strict=True)
        )

    def pool_key(self) -> tuple:
        return ("state", self.num_layers, self.shapes, self.dtypes, self.head_axes)

    def describe(self) -> str:
        return "per-request state"

    def step_fields(self, dtype) -> dict:
        """Not attention: a step describes the group by its rows' slots (the runner's
        StateMetadata, jllm/models/state.py), not by the backends' flat batch."""
        return {"state": True}

    def num_blocks(self, num_tokens: int, block_size: int) -> int:
        return 2 if self.backups else 1

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        return self.num_blocks(num_tokens, block_size)

    def pool_cap(self, block_size: int, max_num_seqs: int, max_step_tokens: int) -> int:
        """One slot per request (two with backups); with snapshots as many again as
        requests, which hold the snapshots a step pins (written or read) and cached ones."""
        per_request = (2 if self.backups else 1) + (1 if self.cache_interval else 0)
        return per_request * max_num_seqs + 1


def with_state_options(specs, interval: int, backups: bool) -> tuple[KVCacheSpec, ...]:
    """`specs` with every per-request state group snapshotting every `interval` tokens (0:
    never; `MambaSpec.cache_interval`) and, with `backups`, keeping a backup slot per
    request for speculative decoding."""
    return tuple(
        dataclasses.replace(s, cache_interval=interval, backups=backups)
        if isinstance(s, MambaSpec)
        else s
        for s in specs
    )


def share_pools(specs) -> tuple[int, ...]:
    """Each group's pool, in order of first use: groups of one model whose arrays are
    identical (`pool_key`) share one."""
    first: dict[tuple, int] = {}
    return tuple(first.setdefault(spec.pool_key(), len(first)) for spec in specs)


@dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """The KV cache once sized (vLLM's KVCacheConfig): each group's spec (the model's, then a
    draft model's), the pool each group draws its blocks from, and each pool's block count,
    the null block included."""

    specs: tuple[KVCacheSpec, ...]
    pools: tuple[int, ...]
    num_blocks: tuple[int, ...]

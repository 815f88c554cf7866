"""The decoder every family shares: embed -> layer segments -> final norm -> LM head.

A family is a subclass that names its layer module (`layer_cls`, built as
`layer_cls(cfg, dtype, rngs, kind)` and called as `layer(x, ctx, kv_caches)` with the step
context, `models/context.py`) and, where its layers differ, each layer's kind (`layer_kinds`):
Gemma 3's local and global attention layers, or Qwen3-MoE's dense and sparse MLPs, and each
kind's attention kind (`attention_kind`), which says what the layer keeps in the KV cache:
None for full attention over the config's `num_kv_heads` x `head_dim` (the default), an int
W for a sliding window of W tokens, or any one-layer KV-cache spec (jllm/kv_cache_interface.py:
chunked local attention, an MLA latent, per-request state). That is the whole interface a
family implements for its cache; layers of one attention kind share a KV-cache group.
Everything else is here: the embedding (with the family's optional scale, and embedding
overrides from the context), the layer scans, the final norm, the LM head and an optional
final soft cap.

Layers run as scans (XLA compiles a scan's body once; 30 unrolled layers took 3-5 s per
bucket to compile on a 2-core CPU). Layers of one kind share a stacked module with a leading
layer axis. The kinds in order are planned into segments (`plan_segments`): `repeats` copies
of a pattern of kinds, run as one scan over the copies whose body runs the pattern's
layers in order. A model of one kind is one segment of one layer, its stack at `layers`
(transformers' `model.layers.N` in the checkpoint); Gemma 3's 26 layers of 5 local then 1
global are ((local x 5, global), 4) then ((local,), 2) at `blocks[s][j]`.

KV-cache groups (`kv_cache_groups`): the layers of one attention kind, in order of first
appearance, each with its spec (`kv_cache_specs`: the kind's, for the group's layer count); a
layer's row in its group's stacked cache is its rank among the group's layers. Groups whose
arrays are identical share one pool (`kv_cache_pools`, from `share_pools`): the caches the
decoder takes are one per pool, and the layers of every group of a pool read and write
that one array at their rows, with their own group's block table (block ids are unique
within a pool). So the blocks a sliding-window group frees (engine/kv_cache_manager.py)
serve Gemma 2's full-attention layers. Within a segment a pattern position's group is fixed
and its row grows by a fixed stride per repeat, so the scan body computes it from the repeat
index.

The projections a CPU kernel runs (bf16 or float32) stay stacked, outside the scan's inputs:
each layer's Linear gets the whole stack and its index (`StackedWeight`), so that the scan
never copies those weights out per layer; the kernels skip the step's padding tokens (those
whose K/V write is dropped). A mixture of experts' stacked experts stay so on every
platform: a layer reads only the experts its tokens chose.

Glossary: T tokens, R rows, D model dim, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, share_pools
from jllm.models import bf16_matmul, f32_matmul, pipeline
from jllm.models.context import RouteLog, StepContext
from jllm.models.layers import Linear, RMSNorm, StackedWeight, param
from jllm.models.state import StateMetadata
from jllm.quantization.weights import QuantizedWeight, matmul, take_rows


@dataclass(frozen=True)
class KVCacheGroup:
    """The layers of one attention kind, which share a block table and a stacked cache of
    `spec` (its `num_layers` is theirs)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]

    @property
    def window(self) -> int | None:
        """The group's sliding window, None for other kinds."""
        return self.spec.sliding_window if isinstance(self.spec, SlidingWindowSpec) else None


@dataclass(frozen=True)
class Segment:
    """`repeats` copies of the layer kinds `pattern`, starting at layer `first`."""

    pattern: tuple[Hashable, ...]
    repeats: int
    first: int

    @property
    def num_layers(self) -> int:
        return len(self.pattern) * self.repeats


def add_deepstack(x, ctx: StepContext, layer):
    """x [T, D] after decoder layer `layer` (traced) plus, at the image tokens, DeepStack's
    features for that layer (`ctx.deep_embeds` [Ld, T, D]; none past the first Ld)."""
    deep = ctx.deep_embeds
    feature = deep[jnp.minimum(layer, deep.shape[0] - 1)].astype(x.dtype)
    return jnp.where((ctx.embeds_mask & (layer < deep.shape[0]))[:, None], x + feature, x)


def plan_segments(kinds: Sequence[Hashable]) -> tuple[Segment, ...]:
    """The layer kinds in order -> segments that cover them in order: from each start, the
    pattern whose repeats cover the most layers (at least two repeats; the shortest such
    pattern on a tie), else the one layer."""
    kinds, segments, start = tuple(kinds), [], 0
    while start < len(kinds):
        rest = kinds[start:]
        best = ((rest[0],), 1)
        for p in range(1, len(rest) // 2 + 1):
            pattern, repeats = rest[:p], 1
            while rest[repeats * p : (repeats + 1) * p] == pattern:
                repeats += 1
            if repeats >= 2 and repeats * p > best[1] * len(best[0]):
                best = (pattern, repeats)
        segments.append(Segment(best[0], best[1], start))
        start += len(best[0]) * best[1]
    return tuple(segments)


def layer_rows(groups: Sequence[KVCacheGroup]) -> list[tuple[int, int]]:
    """Per layer, in order: (its KV-cache group, its row in that group's stacked cache)."""
    places = sorted((i, g, r) for g, group in enumerate(groups) for r, i in enumerate(group.layers))
    return [(g, r) for _, g, r in places]


def segment_rows(seg: Segment, rows: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Per position j of the segment's pattern: (its group, its row at repeat 0, how many rows
    it moves per repeat), so that the layer at repeat k is row `row + k * per_repeat`."""
    out = []
    for j in range(len(seg.pattern)):
        g, row = rows[seg.first + j]
        per_repeat = sum(rows[seg.first + i][0] == g for i in range(len(seg.pattern)))
        out.append((g, row, per_repeat))
    return out


def _stays_stacked(dtype, kernel: bool):
    """A filter for the weights a layer reads from the whole stack (`StackedWeight`) instead
    of the scan's per-layer slice: a Linear's weight of `dtype` (not quantized) when a CPU
    kernel runs the products (`kernel`), and stacked experts always (models/moe.py): a
    layer reads only its routed experts, where the scan's slice would copy all of them."""

    def stays(path, variable) -> bool:
        if not isinstance(variable, nnx.Param):
            return False
        meta = variable.get_metadata()
        if meta.get("stacked_experts"):
            return True
        if not kernel or meta.get("contract") is None:
            return False
        value = variable.get_value()
        return isinstance(value, jax.Array) and value.dtype == dtype

    return stays


class CausalLM(nnx.Module):
    """The shared decoder. `cfg` needs vocab_size, hidden_size, num_layers, rms_norm_eps and
    tie_word_embeddings; `embed_scale`, `final_logit_softcap` and `norm_unit_offset` are
    optional."""

    layer_cls: type  # the family's decoder layer

    @classmethod
    def layer_kinds(cls, cfg) -> tuple[Hashable, ...]:
        """Each layer's kind, in order (one kind unless the family says otherwise)."""
        return (None,) * cfg.num_layers

    @classmethod
    def attention_kind(cls, cfg, kind) -> int | KVCacheSpec | None:
        """The attention kind of a layer of `kind`: None for full attention, its sliding
        window W (a query at p sees keys p - W + 1 .. p), or a one-layer KV-cache spec. The
        layers of one attention kind share a KV-cache group."""
        return None

    @classmethod
    def layer_cache_spec(cls, cfg, kind) -> KVCacheSpec:
        """The KV-cache spec of one layer of `kind` (`attention_kind` as a spec)."""
        attention = cls.attention_kind(cfg, kind)
        if isinstance(attention, KVCacheSpec):
            return dataclasses.replace(attention, num_layers=1)
        heads = dict(num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_dim)
        if attention is None:
            return FullAttentionSpec(**heads)
        return SlidingWindowSpec(**heads, sliding_window=attention)

    @classmethod
    def segments_of(cls, cfg) -> tuple[Segment, ...]:
        """The model's layers as segments (`plan_segments`). Under pipeline stages each
        segment's stack holds, per stage, as many repeats as the stage holding most of them
        (`stage_slots`: the slots no checkpoint layer fills, never run), stage after stage.
        Layers of one pattern (`cfg.stage_repeats`) are then one segment: the first
        segment's pattern (a model whose last repeat is cut short, Gemma 3's 26 layers of 5
        local and 1 global, counts it whole). Otherwise (`cfg.stage_segments`) each segment
        stays, its `first` the layer it starts at within a stage's run."""
        segments = plan_segments(cls.layer_kinds(cfg))
        plan = getattr(cfg, "stage_segments", None)
        if plan is not None:
            out, first = [], 0
            for k, seg in enumerate(segments):
                width = max(row[k] for row in plan)
                out.append(Segment(seg.pattern, len(plan) * width, first))
                first += width * len(seg.pattern)
            return tuple(out)
        stages = getattr(cfg, "stage_repeats", None)
        if stages is None or (len(segments) == 1 and len(set(stages)) == 1):
            return segments
        return (Segment(segments[0].pattern, len(stages) * max(stages), 0),)

    @classmethod
    def num_stages(cls, cfg) -> int:
        """The pipeline stages the config splits the layers over (1: none)."""
        plan = getattr(cfg, "stage_segments", None) or getattr(cfg, "stage_repeats", None)
        return 1 if plan is None else len(plan)

    @classmethod
    def stage_slots(cls, cfg) -> tuple | None:
        """Under pipeline stages with empty slots: per segment, per position j of its
        pattern, per row of its stack, the checkpoint layer the slot holds (None: empty,
        the padding of a stage holding fewer repeats than the largest, or of a cut repeat).
        None when every slot of one pattern's stack is filled."""
        plan = getattr(cfg, "stage_segments", None)
        if plan is None and getattr(cfg, "stage_repeats", None) is None:
            return None
        if plan is None:  # one pattern: its repeats, stage after stage
            plan = tuple((count,) for count in cfg.stage_repeats)
            starts = [0]
        else:
            starts = [seg.first for seg in plan_segments(cls.layer_kinds(cfg))]
        segments = cls.segments_of(cfg)
        tables = []
        for k, seg in enumerate(segments):
            unit, width = len(seg.pattern), seg.repeats // len(plan)
            table = [[None] * seg.repeats for _ in range(unit)]
            first = starts[k]  # the stage's first layer of this segment in the checkpoint
            for stage, row in enumerate(plan):
                for r in range(row[k]):
                    for j in range(unit):
                        layer = first + r * unit + j
                        if layer < cfg.num_layers:
                            table[j][stage * width + r] = layer
                first += row[k] * unit
            tables.append(tuple(tuple(rows) for rows in table))
        full = all(layer is not None for t in tables for rows in t for layer in rows)
        return None if full and cfg.stage_segments is None else tuple(tables)

    @classmethod
    def kv_cache_groups(cls, cfg) -> tuple[KVCacheGroup, ...]:
        """The model's KV-cache groups, in order of their first layer (under pipeline
        stages, the padded slots count: `segments_of`, and the rows go stage after stage,
        each stage's rows laid out alike, so that the stage axis splits them)."""
        groups: dict[KVCacheSpec, list[int]] = {}
        stages = cls.num_stages(cfg)
        stage = [
            k
            for seg in cls.segments_of(cfg)
            for _ in range(seg.repeats // stages)
            for k in seg.pattern
        ]
        for i, kind in enumerate(stage * stages):
            groups.setdefault(cls.layer_cache_spec(cfg, kind), []).append(i)
        return tuple(
            KVCacheGroup(dataclasses.replace(spec, num_layers=len(layers)), tuple(layers))
            for spec, layers in groups.items()
        )

    @classmethod
    def kv_cache_specs(cls, cfg) -> tuple[KVCacheSpec, ...]:
        """Each KV-cache group's spec, in group order."""
        return tuple(g.spec for g in cls.kv_cache_groups(cfg))

    @classmethod
    def kv_cache_pools(cls, cfg) -> tuple[int, ...]:
        """Each KV-cache group's pool: the index of its array among the caches the decoder
        takes."""
        return share_pools(cls.kv_cache_specs(cfg))

    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)  # activations' dtype, whatever the weights are stored in
        self.embed_tokens = param(
            rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype
        )
        self.segments = self.segments_of(cfg)
        self.slots = self.stage_slots(cfg)  # pipeline stages' empty slots, if any

        def stack(kind, count: int):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=0, out_axes=0)
            def make(rngs: nnx.Rngs):
                return self.layer_cls(cfg, dtype, rngs, kind)

            return make(rngs)  # every weight has a leading [count] axis

        if self.uniform:
            self.layers = stack(self.segments[0].pattern[0], self.segments[0].repeats)
        else:
            self.blocks = nnx.List(
                nnx.List(stack(kind, s.repeats) for kind in s.pattern) for s in self.segments
            )
        unit_offset = getattr(cfg, "norm_unit_offset", False)  # Gemma's (1 + w)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, unit_offset)
        if not cfg.tie_word_embeddings:
            shape, axes = (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab")
            self.lm_head = Linear("RD,DV->RV", shape, axes, dtype, rngs)

    @property
    def uniform(self) -> bool:
        return len(self.segments) == 1 and len(self.segments[0].pattern) == 1

    def stack_padding(self, path: tuple) -> dict[int, int]:
        """The empty slots of the layer stack at (or under) state path `path`, each with
        the row whose weights it copies (the position's first: an empty slot never runs):
        {} without pipeline padding."""
        if self.slots is None:
            return {}
        rows = self.slots[path[1]][path[2]] if path[0] == "blocks" else self.slots[0][0]
        source = rows.index(next(layer for layer in rows if layer is not None))
        return {row: source for row, layer in enumerate(rows) if layer is None}

    def layer_slot(self, index: int) -> tuple[tuple, int]:
        """Where checkpoint layer `index` lives: (the path of its stacked module, its index
        in the stack)."""
        if self.slots is not None:
            for k, table in enumerate(self.slots):
                for j, rows in enumerate(table):
                    if index in rows:
                        path = ("layers",) if self.uniform else ("blocks", k, j)
                        return path, rows.index(index)
            raise IndexError(f"layer {index} of a {self.cfg.num_layers}-layer model")
        if self.uniform:
            return ("layers",), index
        for s, seg in enumerate(self.segments):
            if seg.first <= index < seg.first + seg.num_layers:
                repeat, j = divmod(index - seg.first, len(seg.pattern))
                return ("blocks", s, j), repeat
        raise IndexError(f"layer {index} of a {self.cfg.num_layers}-layer model")

    def embed(self, token_ids, ctx: StepContext | None = None):  # [T] -> [T, D]
        table = self.embed_tokens.get_value()
        if isinstance(table, QuantizedWeight):  # a GGUF file's quantized embedding
            x = take_rows(table, token_ids, self.dtype)
        else:
            x = table[token_ids]
        scale = getattr(self.cfg, "embed_scale", None)
        if scale is not None:
            x = x * jnp.asarray(scale, x.dtype)
        if ctx is not None and ctx.embeds is not None:  # e.g. image features at their tokens
            x = jnp.where(ctx.embeds_mask[:, None], ctx.embeds.astype(x.dtype), x)
        return x

    def __call__(self, token_ids, ctx: StepContext, kv_caches: tuple):
        """Hidden states [T, D] after the final norm, and the updated caches: one per
        KV-cache pool (`kv_cache_pools`), [Lg, B, S, 2K, H] for attention, a tuple of state
        arrays [Lg, slots, *shape] for per-request state (models/state.py). Under a mesh of several
        pipeline stages the layers run as stages (`models/pipeline.py`)."""
        hidden, kv_caches, _ = self.forward(token_ids, ctx, kv_caches)
        return hidden, kv_caches

    def forward(self, token_ids, ctx: StepContext, kv_caches: tuple, routes_k: int = 0):
        """`__call__`, and with `routes_k` > 0 also every layer's routed experts [L, T, k]
        int32 in layer order (`enable_return_routed_experts`): a mixture of experts' top-k
        ids, zeros for a dense layer (vLLM's record). Else None."""
        x, kv_caches, routes = self.run_layers(self.embed(token_ids, ctx), ctx, kv_caches, routes_k)
        return self.norm(x), kv_caches, routes

    def run_layers(self, x, ctx: StepContext, kv_caches: tuple, routes_k: int = 0):
        """The decoder's layers over the embeddings x [T, D]: (x before the final norm, the
        updated caches, the routed experts as `forward` gives them)."""
        kernel = bf16_matmul.applies(self.dtype) or f32_matmul.applies(self.dtype)
        in_place = _stays_stacked(jnp.dtype(self.dtype), bool(kernel))
        first = ctx.attn[0]  # group 0's metadata; its pool is pool 0
        if isinstance(first, StateMetadata):
            live = first.live
        else:
            live = first.slot_mapping < kv_caches[0].shape[1] * kv_caches[0].shape[2]
        ctx = ctx.replace(live=live, pools=self.kv_cache_pools(self.cfg))
        kv_caches = tuple(kv_caches)
        stages = pipeline.num_stages()
        routes = []
        if stages > 1:
            if routes_k:
                raise ValueError("Routed experts are not recorded under pipeline stages yet.")
            if ctx.deep_embeds is not None:
                raise ValueError("DeepStack image features are not run under pipeline stages yet.")
            x, kv_caches = pipeline.run(self, x, ctx, kv_caches, stages, in_place)
        else:
            for s in range(len(self.segments)):
                parts = self.segment_parts(s, in_place)
                x, kv_caches, ids = self.scan_segment(s, parts, x, ctx, kv_caches, None, routes_k)
                routes.append(ids)
        return x, kv_caches, jnp.concatenate(routes) if routes_k else None

    def segment_parts(self, s: int, in_place) -> list[tuple]:
        """Segment `s`'s stacked modules, each split as (graphdef, the weights its layers
        read from the whole stack, the rest)."""
        modules = [self.layers] if self.uniform else list(self.blocks[s])
        return [nnx.split(m, in_place, ...) for m in modules]

    def scan_segment(
        self, s: int, parts, x, ctx: StepContext, kv_caches: tuple, active=None, routes_k=0
    ):
        """Segment `s`'s layers over x, as a scan over the repeats `parts` hold (all of
        them, or a pipeline stage's; their cache rows then count from the stage's first).
        `active`: [pattern, repeats] bool (traced), the slots to run; None: all. Returns
        (x, the caches, with `routes_k` the segment's routed experts [layers, T, k] in layer
        order, else None)."""
        where = segment_rows(self.segments[s], layer_rows(self.kv_cache_groups(self.cfg)))
        T = x.shape[0]

        def body(carry, inputs):
            x, kv_caches = carry
            states, repeat = inputs
            slots = zip(parts, states, where, strict=True)
            routes = []
            for j, ((graphdef, stacked, _), state, (g, row, per_repeat)) in enumerate(slots):
                views = jax.tree.map(lambda a: StackedWeight(a, repeat), stacked)
                layer = nnx.merge(graphdef, views, state)
                layer_ctx = ctx.at_layer(g, row + repeat * per_repeat)
                if routes_k:
                    layer_ctx = layer_ctx.replace(routes=RouteLog())
                if active is None:
                    x, kv_caches = layer(x, layer_ctx, kv_caches)
                else:
                    x, kv_caches = jax.lax.cond(
                        active[j, repeat],
                        lambda x, c, layer=layer, layer_ctx=layer_ctx: layer(x, layer_ctx, c),
                        lambda x, c: (x, c),
                        x,
                        kv_caches,
                    )
                if ctx.deep_embeds is not None:
                    seg = self.segments[s]
                    x = add_deepstack(x, ctx, seg.first + repeat * len(seg.pattern) + j)
                if routes_k:
                    ids = layer_ctx.routes.ids
                    routes.append(jnp.zeros((T, routes_k), jnp.int32) if ids is None else ids)
            return (x, kv_caches), (jnp.stack(routes) if routes_k else None)

        states = tuple(state for _, _, state in parts)
        repeats = jax.tree.leaves(states)[0].shape[0]
        # Not unrolled: with the stacked cache an unrolled scan copies the cache per layer.
        (x, kv_caches), routes = jax.lax.scan(body, (x, kv_caches), (states, jnp.arange(repeats)))
        if routes_k:  # [repeats, pattern, T, k]: layer first + r * pattern + j
            routes = routes.reshape(-1, T, routes_k)
        return x, kv_caches, routes

    def compute_logits(self, hidden, live=None):
        """[R, D] -> [R, V] float32, whatever the model's dtype. live: [R] bool, the rows
        whose logits are used (None: all); on the float32 kernel the others are not computed
        and come out zero."""
        logits = self._lm_head(hidden, live)
        cap = getattr(self.cfg, "final_logit_softcap", None)
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def _lm_head(self, hidden, live):
        f32 = jnp.float32
        if self.cfg.tie_word_embeddings:
            table = self.embed_tokens.get_value()
            if isinstance(table, QuantizedWeight):  # [V, D]: the [Out, In] layout
                return matmul(hidden, table, f32)
            if table.dtype == hidden.dtype and bf16_matmul.head_applies(
                hidden.dtype, hidden.shape[0]
            ):
                product = bf16_matmul.bf16_matmul
                return product(hidden, table, live=live, transposed=True, out_dtype=f32)
            if table.dtype == hidden.dtype and f32_matmul.applies(hidden.dtype):
                product = f32_matmul.f32_matmul
                return product(hidden, table, live=live, transposed=True, out_dtype=f32)
            return jnp.einsum("RD,VD->RV", hidden, table, preferred_element_type=f32)
        w = self.lm_head.weight.get_value()
        kernel = isinstance(w, jax.Array) and w.dtype == hidden.dtype
        if kernel and f32_matmul.applies(hidden.dtype):
            return f32_matmul.f32_matmul(hidden, w, live=live, out_dtype=f32)  # [D, V], no bias
        return self.lm_head(hidden, out_dtype=f32)

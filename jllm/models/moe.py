"""The mixture-of-experts MLP: a router, top-k experts per token, one grouped product per
projection over the tokens sorted by expert, and the weighted sum back per token.

Routing (`route`): softmax over the router's logits in float32, the top k, and (Mixtral
always; Qwen3-MoE with `norm_topk_prob`) the k weights renormalised to sum to one, which is
the same as a softmax over the top k logits.

Dispatch (`sort_by_expert`): the T * k (token, expert) pairs sorted by expert with a stable
argsort of the flattened expert ids, and each expert's row count; every product then reads
one expert's weights for a contiguous run of rows.

The grouped product (`grouped_ffn`), act(x W_gate) * (x W_up) W_down over each expert's
run (with per-expert biases after each product where the checkpoint has them, gpt-oss's, and
its clamped SwiGLU `SwigluOai` in place of act(gate) * up):
- "ragged": `jax.lax.ragged_dot`, which TPU and GPU lower to grouped matrix products;
- "tiles" (the CPU's): ragged_dot's CPU lowering multiplies every row by every expert, so
  each expert's run is padded to whole tiles of `TILE` rows and a loop runs only the tiles
  in use, each one product against its expert's weights: the work is that of the routed
  rows (plus at most one partial tile per expert), and an expert that no token chose is
  never read. The tile count is static per bucket (cdiv(T * k, TILE) + min(E, T * k)), the
  trip count is the tiles in use. Where the CPU's layer-product kernels run (bf16_matmul,
  f32_matmul) a tile's gated MLP is theirs, reading the expert in the stack in place; else
  XLA's products of the expert's slice.

Quantized experts (`quantization="fp8"` or `"tpu_int8"`, made on load per output channel)
are QuantizedWeights [E, F, D] / [E, D, F] in transformers' [Out, In] layout: the tiled
product multiplies each tile by its expert's codes (`quantization.weights.matmul`); the
ragged one dequantizes the layer's experts first.

Parallelism: tensor parallelism splits each expert's intermediate axis F over the mesh's model
axis, as for a dense MLP (the down product's partial sums are reduced by XLA). Expert
parallelism (`enable_expert_parallel`) places whole experts instead: device i holds experts
[i E/n, (i+1) E/n). The step's activations are replicated on every device already (the
attention's heads are split, its output is not), so no token needs to travel: each device
routes every token, runs the sorted rows of its own experts (a contiguous run), and one
all-reduce (`psum`) sums the devices' partial outputs. An all-to-all dispatch would move
only the routed rows, but it pays when the tokens start split over devices, which they do
not here.

Routing record (`enable_return_routed_experts`, RL's routing replay): when the step context
carries a `RouteLog`, the layer leaves its top-k expert ids [T, k] there; the decoder's scan
gathers them per layer (models/context.py, models/decoder.py: `CausalLM.forward`).

Glossary: T tokens, D model dim, F expert ffn dim, E experts, k experts per token, N = T * k
routed rows, M tile rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jllm.config import batch_invariant
from jllm.models import bf16_matmul, f32_matmul, invariant
from jllm.models.blocks import layer_window, split_kind
from jllm.models.decoder import CausalLM
from jllm.models.layers import (
    Linear,
    StackedWeight,
    activation,
    gated_product,
    on_bf16_kernel,
    param,
)
from jllm.quantization.weights import QuantizedWeight, dequantize, matmul
from sharding import DATA_AXIS, MODEL_AXIS

TILE = 16  # rows per tile of the CPU's grouped product


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """A mixture of experts' shape, for the families that have one: per layer whether its
    MLP is sparse, the experts, how many each token takes, their width, whether the top-k
    routing weights are renormalised (Mixtral always; Qwen3-MoE's `norm_topk_prob`), a
    shared expert's width (Qwen2-MoE's; 0: none) and, the engine's, whether whole experts
    sit per device (`enable_expert_parallel`)."""

    sparse_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    expert_parallel: bool = False
    # gpt-oss's: a bias on the router's logits, and on each expert's projections.
    router_bias: bool = False
    expert_bias: bool = False
    # Llama 4's: a token's routing weight scales its input to the expert, not the output
    # (vLLM's apply_router_weight_on_input).
    weight_on_input: bool = False

    @classmethod
    def from_hf(
        cls, hf, *, sparse_layers, num_experts, intermediate_size, norm_topk_prob, shared=0
    ):
        """The experts of a config whose router is a softmax over a linear gate (others are
        refused by name)."""
        scoring = getattr(hf, "scoring_func", "softmax")
        if scoring != "softmax" or getattr(hf, "topk_method", None) not in (None, "greedy"):
            raise ValueError(
                f"MoE router {scoring!r} / {getattr(hf, 'topk_method', None)!r} is not "
                "supported by jllm yet (supported: softmax over a linear gate, then top-k)."
            )
        return cls(
            sparse_layers=tuple(sparse_layers),
            num_experts=int(num_experts),
            num_experts_per_tok=int(hf.num_experts_per_tok),
            intermediate_size=int(intermediate_size),
            norm_topk_prob=bool(norm_topk_prob),
            shared_expert_intermediate_size=int(shared or 0),
        )


def route(logits, k: int, normalize: bool):
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32). In the
    batch-invariant mode the softmax's and the renormalisation's sums run in one order
    (models/invariant.py): XLA's reductions over E may not for another token count."""
    logits = logits.astype(jnp.float32)
    exact = batch_invariant.enabled()
    if exact:
        e = invariant.exp_rows(logits - logits.max(-1, keepdims=True))  # a max is exact
        probs = e / invariant.row_sum(e)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        total = invariant.row_sum(weights) if exact else weights.sum(-1, keepdims=True)
        weights = weights / total
    return weights, ids.astype(jnp.int32)


@dataclass(frozen=True, kw_only=True)
class GroupedRouting:
    """DeepSeek's routers (V2: softmax scores, `topk_method` "greedy" or
    "group_limited_greedy"; V3: sigmoid scores, "noaux_tc", an `e_score_correction_bias`):
    experts chosen within the `topk_group` best of `n_group` groups (a group's score: its
    best expert's, or with the bias its two best's sum), the chosen experts' scores as
    weights, renormalised with `norm_topk_prob`, times `routed_scaling_factor`."""

    scoring: str = "softmax"  # or "sigmoid"
    biased: bool = False  # noaux_tc: the choice adds e_score_correction_bias
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    scale: float = 1.0

    @classmethod
    def from_hf(cls, hf, default_method: str = "greedy") -> GroupedRouting:
        """`default_method`: a config without `topk_method` (transformers' DeepSeek-V3 always
        routes by "noaux_tc")."""
        method = getattr(hf, "topk_method", None) or default_method
        default_scoring = "sigmoid" if method == "noaux_tc" else "softmax"
        scoring = getattr(hf, "scoring_func", None) or default_scoring
        if method not in ("greedy", "group_limited_greedy", "noaux_tc") or scoring not in (
            "softmax",
            "sigmoid",
        ):
            raise ValueError(f"MoE router {scoring!r} / {method!r} is not supported by jllm yet.")
        grouped = method != "greedy"
        return cls(
            scoring=scoring,
            biased=method == "noaux_tc",
            n_group=int(getattr(hf, "n_group", None) or 1) if grouped else 1,
            topk_group=int(getattr(hf, "topk_group", None) or 1) if grouped else 1,
            normalize=bool(getattr(hf, "norm_topk_prob", False)),
            scale=float(getattr(hf, "routed_scaling_factor", None) or 1.0),
        )


def route_grouped(logits, k: int, r: GroupedRouting, bias=None):
    """logits [T, E] (and with `r.biased` the correction bias [E]) -> (weights [T, k]
    float32, expert ids [T, k] int32) by DeepSeek's rule (`GroupedRouting`)."""
    logits = logits.astype(jnp.float32)
    exact = batch_invariant.enabled()
    if r.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    elif exact:
        e = invariant.exp_rows(logits - logits.max(-1, keepdims=True))
        scores = e / invariant.row_sum(e)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores + bias.astype(jnp.float32) if r.biased else scores
    T, E = choice.shape
    if r.n_group > 1:
        grouped = choice.reshape(T, r.n_group, E // r.n_group)
        if r.biased:  # the sum of each group's two best, in one order
            best = jax.lax.top_k(grouped, 2)[0]
            group_score = best[..., 0] + best[..., 1]
        else:
            group_score = grouped.max(-1)
        _, groups = jax.lax.top_k(group_score, r.topk_group)  # [T, topk_group]
        keep = jnp.zeros((T, r.n_group), bool).at[jnp.arange(T)[:, None], groups].set(True)
        choice = jnp.where(jnp.repeat(keep, E // r.n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if r.normalize:
        total = invariant.row_sum(weights) if exact else weights.sum(-1, keepdims=True)
        weights = weights / (total + 1e-20)
    return weights * r.scale, ids.astype(jnp.int32)


def sort_by_expert(ids, num_experts: int):
    """ids [T, k] -> (order [N]: the flat (token, slot) index of each sorted row,
    group_sizes [E] int32)."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)
    return order, sizes


@dataclass(frozen=True)
class SwigluOai:
    """gpt-oss's clamped SwiGLU (vLLM's `swigluoai`): the gate clamped above at `limit`, the
    up projection to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate, up):
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def glu(act):
    """The gated half of an expert's MLP, (gate, up) -> h: act(gate) * up for transformers'
    activation name `act`, or `act` itself when it is such a function (`SwigluOai`)."""
    if callable(act):
        return act
    f = activation(act)
    return lambda gate, up: f(gate) * up


def grouped_ffn(x, w_gate, w_up, w_down, group_sizes, act, method: str, bias=None):
    """x [N, D] sorted by expert, w_gate/w_up [E, D, F], w_down [E, F, D], group_sizes [E]
    -> [N, D]: each row through its expert's gated MLP (`act`: as `glu` takes it). The
    weights may be the layer's view of the stacked experts (`StackedWeight`). `bias`: None, or
    the experts' (gate [E, F], up [E, F], down [E, D]) added after each product."""
    h = glu(act)
    if method == "ragged":
        w_gate, w_up, w_down = (_layer(w, x.dtype) for w in (w_gate, w_up, w_down))
        gate = jax.lax.ragged_dot(x, w_gate, group_sizes)
        up = jax.lax.ragged_dot(x, w_up, group_sizes)
        if bias is not None:  # each sorted row's expert's
            E, N = group_sizes.shape[0], x.shape[0]
            expert = jnp.repeat(jnp.arange(E), group_sizes, total_repeat_length=N)
            gate, up = gate + bias[0][expert], up + bias[1][expert]
        y = jax.lax.ragged_dot(h(gate, up).astype(x.dtype), w_down, group_sizes)
        return y if bias is None else y + bias[2][expert]
    if method != "tiles":
        raise ValueError(f"grouped product method must be 'ragged' or 'tiles', got {method!r}")
    expert_ffn = None if bias is not None else _kernel_expert_ffn(x, w_gate, w_up, w_down, act)
    return _tiled_ffn(x, w_gate, w_up, w_down, group_sizes, h, expert_ffn, bias)


def _is_view(a) -> bool:
    return isinstance(a, StackedWeight)


def _expert(w, e):
    """Expert e's weight, from [E, ...] or from the layer stack (`StackedWeight`), float or
    quantized (a QuantizedWeight whose arrays are such views)."""
    return jax.tree.map(lambda a: a.stack[a.layer, e] if _is_view(a) else a[e], w, is_leaf=_is_view)


def _layer(w, dtype):
    """The whole [E, In, Out] of a layer in `dtype` (a copy when it comes from the stack;
    quantized experts dequantized, [E, Out, In] -> [E, In, Out])."""
    w = jax.tree.map(lambda a: a.stack[a.layer] if _is_view(a) else a, w, is_leaf=_is_view)
    if isinstance(w, QuantizedWeight):
        return jnp.swapaxes(dequantize(w, dtype), -1, -2)
    return w


def _dot(x, w):
    """x [M, In] times one expert's weight: float [In, Out], or quantized [Out, In]."""
    return matmul(x, w) if isinstance(w, QuantizedWeight) else x @ w


def _kernel_expert_ffn(x, w_gate, w_up, w_down, act):
    """One tile's gated MLP through expert e on the C++ layer-product kernels, reading the
    expert in the stack in place: (rows [M, D], e) -> [M, D]. XLA's product copies the
    expert out of the stack first (a dynamic slice per tile); and a row's place in its tile
    depends on the other tokens, where the kernels sum each row in one order wherever it
    sits (the batch-invariant mode needs that). None where they do not apply (quantized
    experts, another activation, another dtype, several devices)."""
    ws = (w_gate, w_up, w_down)
    if act != "silu":
        return None
    if any(isinstance(w, QuantizedWeight) for w in ws):
        return None
    if not (bf16_matmul.applies(x.dtype) or f32_matmul.applies(x.dtype)):
        return None
    if any((w.stack.dtype if _is_view(w) else w.dtype) != x.dtype for w in ws):
        return None

    def flat(w):  # [L * E, In, Out] (a bitcast) and where layer l's expert e sits in it
        if not _is_view(w):
            return w, lambda e: e
        E = w.stack.shape[1]
        return w.stack.reshape(-1, *w.stack.shape[2:]), lambda e: w.layer * E + e

    (gate, at), (up, _), (down, _) = (flat(w) for w in ws)
    if on_bf16_kernel(x):
        return lambda rows, e: bf16_matmul.bf16_matmul(
            bf16_matmul.bf16_gated_matmul(rows, gate, up, at(e)), down, at(e)
        )
    return lambda rows, e: f32_matmul.f32_matmul(
        f32_matmul.f32_gated_matmul(rows, gate, up, at(e), out_dtype=x.dtype), down, at(e)
    )


def _tiled_ffn(x, w_gate, w_up, w_down, sizes, h, expert_ffn=None, bias=None):
    N, D = x.shape
    E = sizes.shape[0]
    M = TILE
    num_tiles = -(-N // M) + min(E, N)  # each expert adds at most one partial tile
    tiles = (sizes + M - 1) // M  # [E]
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    row_start = jnp.cumsum(sizes) - sizes
    expert = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=N)  # [N] each row's
    slot = tile_start[expert] * M + jnp.arange(N) - row_start[expert]  # [N] padded row
    # Rows past the groups (expert parallelism's run of local rows is shorter) go nowhere.
    slot = jnp.where(jnp.arange(N) < sizes.sum(), slot, num_tiles * M)
    padded = jnp.zeros((num_tiles * M, D), x.dtype).at[slot].set(x, mode="drop")
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(num_tiles), "right"), E - 1)

    def body(t, out):
        rows = jax.lax.dynamic_slice_in_dim(padded, t * M, M)  # [M, D]
        e = tile_expert[t]
        if expert_ffn is not None:
            return jax.lax.dynamic_update_slice_in_dim(out, expert_ffn(rows, e), t * M, 0)
        gate, up = _dot(rows, _expert(w_gate, e)), _dot(rows, _expert(w_up, e))  # [M, F]
        if bias is not None:
            gate, up = gate + bias[0][e], up + bias[1][e]
        y = _dot(h(gate, up).astype(x.dtype), _expert(w_down, e))
        if bias is not None:  # float32 biases beside bf16 rows: the rows' dtype
            y = y + bias[2][e]
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), t * M, 0)

    out = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros_like(padded))
    return out.at[slot].get(mode="fill", fill_value=0)


def dense_ffn_reference(x, weights, ids, w_gate, w_up, w_down, act, bias=None):
    """The test oracle: every expert on every token, weighted by the routing (zero where not
    chosen). x [T, D] -> [T, D]."""
    gate, up = jnp.einsum("TD,EDF->ETF", x, w_gate), jnp.einsum("TD,EDF->ETF", x, w_up)
    if bias is not None:
        gate, up = gate + bias[0][:, None], up + bias[1][:, None]
    y = jnp.einsum("ETF,EFD->ETD", glu(act)(gate, up), w_down)  # [E, T, D]
    if bias is not None:
        y = y + bias[2][:, None]
    E = w_gate.shape[0]
    mix = (jax.nn.one_hot(ids, E, dtype=jnp.float32) * weights[..., None]).sum(1)  # [T, E]
    return jnp.einsum("TE,ETD->TD", mix, y.astype(jnp.float32)).astype(x.dtype)


class Experts(nnx.Module):
    """E experts' gated MLPs, stacked on a leading expert axis: under tensor parallelism each
    expert's F axis is split, under expert parallelism (`split`) the expert axis. With `bias`,
    each projection's per-expert bias (`gate_bias`, `up_bias` [E, F], `down_bias` [E, D])."""

    def __init__(
        self, E: int, D: int, F: int, dtype, rngs: nnx.Rngs, split: bool = False, bias=False
    ):
        experts, mlp = ("experts_split", None) if split else ("experts", "mlp")
        # Read from the layer stack in place (decoder.py), one routed expert at a time.
        kw = dict(stacked_experts=True)
        self.gate_proj = param(rngs, (E, D, F), (experts, "embed", mlp), dtype, **kw)
        self.up_proj = param(rngs, (E, D, F), (experts, "embed", mlp), dtype, **kw)
        self.down_proj = param(rngs, (E, F, D), (experts, mlp, "embed"), dtype, **kw)
        self.bias = bias
        if bias:
            self.gate_bias = param(rngs, (E, F), (experts, mlp), dtype)
            self.up_bias = param(rngs, (E, F), (experts, mlp), dtype)
            self.down_bias = param(rngs, (E, D), (experts, "embed"), dtype)

    def weights(self) -> tuple:
        return self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value()

    def biases(self) -> tuple | None:
        if not self.bias:
            return None
        return self.gate_bias[...], self.up_bias[...], self.down_bias[...]


class SharedExpert(nnx.Module):
    """Qwen2-MoE's expert every token takes: a dense gated MLP of width `F`."""

    def __init__(self, D: int, F: int, act: str, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs)
        self.up_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs)
        self.down_proj = Linear("TF,FD->TD", (F, D), ("mlp", "embed"), dtype, rngs)
        self.act = act

    def __call__(self, x, ctx=None):  # [T, D]
        return self.down_proj(gated_product(self.gate_proj, self.up_proj, x, ctx, self.act), ctx)


class MoE(nnx.Module):
    """The sparse MLP block: `gate` (the router, a Linear [D, E], with a bias where
    `router_bias`) and `experts` (biased where `expert_bias`); with `shared` > 0 also a
    shared expert of that width, added to every token's output through a sigmoid gate of its
    own (`shared_expert_gate`, Qwen2-MoE's). `act`: as `glu` takes it. With
    `weight_on_input` a token's routing weight scales its input to each expert instead of the
    expert's output (Llama 4's)."""

    def __init__(
        self,
        D,
        F,
        E,
        k,
        normalize: bool,
        act,
        dtype,
        rngs,
        expert_parallel: bool = False,
        shared: int = 0,
        router_bias: bool = False,
        expert_bias: bool = False,
        weight_on_input: bool = False,
    ):
        self.gate = Linear("TD,DE->TE", (D, E), ("embed", None), dtype, rngs, int(router_bias))
        self.experts = Experts(E, D, F, dtype, rngs, expert_parallel, expert_bias)
        self.num_experts, self.k, self.normalize, self.act = E, k, normalize, act
        self.expert_parallel = expert_parallel
        self.weight_on_input = weight_on_input
        if shared:
            self.shared_expert = SharedExpert(D, shared, act, dtype, rngs)
            self.shared_expert_gate = Linear("TD,DO->TO", (D, 1), ("embed", None), dtype, rngs)

    @classmethod
    def of(cls, D: int, moe: MoeConfig, act, dtype, rngs):
        """The block of a family's `MoeConfig`, for a model of width D."""
        return cls(
            D,
            moe.intermediate_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.norm_topk_prob,
            act,
            dtype,
            rngs,
            moe.expert_parallel,
            moe.shared_expert_intermediate_size,
            moe.router_bias,
            moe.expert_bias,
            moe.weight_on_input,
        )

    def __call__(self, x, ctx=None):  # [T, D]
        out = self._routed(x, ctx)
        if getattr(self, "shared_expert", None) is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(x, ctx).astype(jnp.float32))
            out = out + (gate * self.shared_expert(x, ctx).astype(jnp.float32)).astype(out.dtype)
        return out

    def choose(self, logits):
        """The router's logits [T, E] float32 -> (weights [T, k], expert ids [T, k])."""
        return route(logits, self.k, self.normalize)

    def _routed(self, x, ctx):
        """Under data parallelism with expert parallelism, a data shard's step (manual over
        `data`: runner/data_parallel.py) holds only its own tokens and its run of the
        experts: every shard's tokens are gathered, each device runs its experts' rows of
        all of them, and the partial outputs are summed and scattered back to the shards
        (the all-gather / reduce-scatter form of the dispatch)."""
        shards = self._data_shards()
        if shards == 1:
            return self._routed_all(x, ctx)
        out = self._routed_all(jax.lax.all_gather(x, DATA_AXIS, tiled=True), ctx)
        return jax.lax.psum_scatter(out, DATA_AXIS, scatter_dimension=0, tiled=True)

    def _data_shards(self) -> int:
        """The data shards the experts are split over in the step being traced: >1 only
        with expert parallelism inside a data shard's step."""
        mesh = jax.sharding.get_abstract_mesh()
        if not self.expert_parallel or mesh.empty or DATA_AXIS not in mesh.manual_axes:
            return 1
        return mesh.shape[DATA_AXIS]

    def _routed_all(self, x, ctx):
        weights, ids = self.choose(self.gate(x, ctx, out_dtype=jnp.float32))
        if ctx is not None and ctx.routes is not None:
            ctx.routes.ids = ids
        order, sizes = sort_by_expert(ids, self.num_experts)
        token = order // self.k  # [N] the token of each sorted row
        row_weight = weights.reshape(-1)[order]  # [N]
        w, b = self.experts.weights(), self.experts.biases()
        mesh = jax.sharding.get_abstract_mesh()
        devices = 1 if mesh.empty else mesh.shape.get(MODEL_AXIS, 1) * self._data_shards()
        if self.expert_parallel and devices > 1:
            return self._expert_parallel(x, token, row_weight, sizes, w, b, mesh)
        on_input = self.weight_on_input
        if batch_invariant.enabled():
            return _combine_in_order(x, order, token, weights, sizes, w, self.act, b, on_input)
        return _combine(x, token, row_weight, sizes, w, self.act, x.shape[0], b, on_input)

    def _expert_parallel(self, x, token, row_weight, sizes, w, b, mesh):
        T, N = x.shape[0], token.shape[0]
        act, on_input = self.act, self.weight_on_input
        shards = self._data_shards()  # the experts' leading split, when over data x model

        def per_device(x, token, row_weight, sizes, w_gate, w_up, w_down, b):
            local = w_gate.shape[0]
            device = jax.lax.axis_index(MODEL_AXIS)
            if shards > 1:  # experts split data-major over (data, model): sharding/
                device = jax.lax.axis_index(DATA_AXIS) * mesh.shape[MODEL_AXIS] + device
            first = device * local
            start = (jnp.cumsum(sizes) - sizes)[first]  # the local experts' run of rows
            mine = jax.lax.dynamic_slice_in_dim(sizes, first, local)

            def run(a):  # [N] -> the N entries from `start` (zeros past the end)
                padded = jnp.concatenate([a, jnp.zeros((N, *a.shape[1:]), a.dtype)])
                return jax.lax.dynamic_slice_in_dim(padded, start, N)

            w = (w_gate, w_up, w_down)
            part = _combine(x, run(token), run(row_weight), mine, w, act, T, b, on_input)
            return jax.lax.psum(part, MODEL_AXIS)

        split = P(MODEL_AXIS, None, None)
        biases = None if b is None else (P(MODEL_AXIS, None),) * 3
        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P(), P(), P(), split, split, split, biases),
            out_specs=P(),
            check_vma=False,
        )(x, token, row_weight, sizes, *(_layer(a, x.dtype) for a in w), b)


def _combine(x, token, row_weight, sizes, w, act, T: int, bias=None, on_input=False):
    """The sorted rows (`token` [N] their tokens, `row_weight` [N] their routing weights;
    only the first sum(sizes) are routed) through their experts, summed back per token
    -> [T, D]. `on_input`: each row's weight scales its input instead of its output."""
    rows = x[token]
    if on_input:
        rows = (rows * row_weight[:, None].astype(rows.dtype)).astype(x.dtype)
    y = _expert_outputs(rows, sizes, w, act, bias)  # [N, D]
    live = jnp.arange(token.shape[0]) < sizes.sum()
    y = y * jnp.where(live, 1.0 if on_input else row_weight, 0.0)[:, None].astype(y.dtype)
    return jnp.zeros((T, x.shape[1]), y.dtype).at[token].add(y)


def _expert_outputs(rows, sizes, w, act, bias=None):
    """The rows sorted by expert through their experts -> [N, D]: the CPU's tiles, TPU's
    and GPU's ragged products."""
    method = "tiles" if jax.default_backend() == "cpu" else "ragged"
    return grouped_ffn(rows, *w, sizes, act, method, bias)


def _combine_in_order(x, order, token, weights, sizes, w, act, bias=None, on_input=False):
    """`_combine` for the batch-invariant mode: each token's k expert outputs gathered back
    to its own rows and summed in its top-k order by explicit adds, where a scatter-add's
    order and fusion (a multiply folded into the add) may change with the token count."""
    T, k = weights.shape
    rows = x[token]
    if on_input:
        row_weight = weights.reshape(-1)[order]
        rows = (rows * row_weight[:, None].astype(rows.dtype)).astype(x.dtype)
        weights = jnp.ones_like(weights)
    y = _expert_outputs(rows, sizes, w, act, bias)  # [N, D] sorted by expert
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))  # [N]
    y = y[back].reshape(T, k, -1)  # [T, k, D]: token t's j-th choice at [t, j]
    out = y[:, 0] * weights[:, :1].astype(y.dtype)
    for j in range(1, k):
        out = out + y[:, j] * weights[:, j : j + 1].astype(y.dtype)
    return out


class MoeForCausalLM(CausalLM):
    """A family with experts: each layer's kind pairs its `layer_types` entry with whether
    its MLP is sparse (`MoeConfig.sparse_layers`), so dense and sparse layers stack apart."""

    @classmethod
    def layer_kinds(cls, cfg):
        types = cfg.layer_types or (None,) * cfg.num_layers
        return tuple(zip(types, cfg.moe.sparse_layers, strict=True))

    @classmethod
    def attention_kind(cls, cfg, kind):
        return layer_window(cfg, split_kind(kind)[0])

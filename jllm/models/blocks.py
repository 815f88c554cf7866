"""The blocks decoder families compose: attention, the gated MLP, and the pre-norm layer.

A family's layer builds these from its config (`models/llama.py` and the other family
files). Where two families differ by a flag, the flag is an argument of the block (q/k/v
biases, per-head q/k norms, Gemma's score scale and soft cap, a layer's window and rotation),
so a block reads no family's config fields beyond the shape every decoder has
(`models/config.py:DecoderConfig`). Submodules carry transformers' names
(`self_attn.q_proj`, `mlp.gate_proj`, ...), so a checkpoint tensor's name is its path.

Attention is the backend object's (`jllm/attention/`, through `ctx.attend`), so a block does
not care which backend runs it. The forward runs over a flat batch of T tokens (any mix of
prefill chunks and decodes) and the paged KV cache, which it returns updated.

Glossary: T tokens, D model dim, N query heads, K kv heads, H head dim, F ffn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.attention.options import AttentionOptions
from jllm.models.config import DecoderConfig
from jllm.models.context import StepContext
from jllm.models.layers import Linear, RMSNorm, gated_product
from jllm.models.rope import RopeConfig, apply_rope


class Attention(nnx.Module):
    """Grouped-query attention with rotary positions. `rope`: the layer's rotation (None:
    none, a NoPE layer); `window`: its sliding window (None: full attention); `chunk_size`:
    chunked local attention (a query sees only its own chunk of positions); `scale`: the
    scores' scale (default head_dim ** -0.5); `soft_cap`: a cap on the scores; `sinks`: a
    learned per-head logit in each softmax's denominator (`self_attn.sinks` [N], float32);
    `qkv_bias` / `o_bias`: biases on the q/k/v and output projections; `qk_norm`: per-head
    RMSNorm of q and k (Qwen3, Gemma 3), scaling by `1 + w` with `norm_offset` (Gemma's);
    `output_gate`: q_proj also yields a gate per head (each head's H query rows, then its H
    gate rows) and the heads' outputs are scaled by its sigmoid (Qwen3-Next's gated
    attention). The options reach the backend as one record (jllm/attention/options.py)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        dtype,
        rngs: nnx.Rngs,
        *,
        rope: RopeConfig | None,
        window: int | None = None,
        chunk_size: int | None = None,
        scale: float | None = None,
        soft_cap: float | None = None,
        sinks: bool = False,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_offset: bool = False,
        output_gate: bool = False,
    ):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope = rope
        self.options = AttentionOptions(
            scale=H**-0.5 if scale is None else scale,
            window=window,
            chunk_size=chunk_size,
            soft_cap=soft_cap,
            sinks=sinks,
        )
        self.qk_norm, self.kv_scales = qk_norm, cfg.kv_scales
        self.output_gate = output_gate
        b = 2 if qkv_bias else 0
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        Hq = 2 * H if output_gate else H  # the gate's rows follow each head's query rows
        self.q_proj = Linear("TD,DNH->TNH", (D, N, Hq), q_axes, dtype, rngs, b)
        self.k_proj = Linear("TD,DKH->TKH", (D, K, H), kv_axes, dtype, rngs, b)
        self.v_proj = Linear("TD,DKH->TKH", (D, K, H), kv_axes, dtype, rngs, b)
        o_axes = ("heads", "head_dim", "embed")
        self.o_proj = Linear("TNH,NHD->TD", (N, H, D), o_axes, dtype, rngs, int(o_bias))
        if qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, norm_offset)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, norm_offset)
        if sinks:  # float32 whatever the model's dtype, as the softmax's sums
            self.sinks = nnx.Param(jnp.zeros((N,), jnp.float32), logical_axes=("heads",))
        if cfg.kv_scales:  # float32 whatever the model's dtype; 1.0 unless loaded
            self.k_scale = nnx.Param(jnp.ones((), jnp.float32), logical_axes=(), kv_scale=True)
            self.v_scale = nnx.Param(jnp.ones((), jnp.float32), logical_axes=(), kv_scale=True)

    def __call__(self, x, ctx: StepContext, kv_caches):
        q, k, v = self.q_proj(x, ctx), self.k_proj(x, ctx), self.v_proj(x, ctx)  # [T, N|K, H]
        if self.output_gate:
            q, gate = jnp.split(q, 2, axis=-1)  # [T, N, H] each
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q = apply_rope(q, ctx.positions, self.rope)
            k = apply_rope(k, ctx.positions, self.rope)
        kv_scales = (self.k_scale[...], self.v_scale[...]) if self.kv_scales else None
        sinks = self.sinks[...] if self.options.sinks else None
        o, kv_caches = ctx.attend(
            q, k, v, kv_caches, options=self.options, sinks=sinks, kv_scales=kv_scales
        )
        if self.output_gate:
            o = o * jax.nn.sigmoid(gate).astype(o.dtype)
        return self.o_proj(o, ctx), kv_caches  # o: [T, N, H]


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)), with biases where the checkpoint has them."""

    def __init__(self, D: int, F: int, act: str, dtype, rngs: nnx.Rngs, bias: bool = False):
        b = int(bias)
        self.gate_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs, b)
        self.up_proj = Linear("TD,DF->TF", (D, F), ("embed", "mlp"), dtype, rngs, b)
        self.down_proj = Linear("TF,FD->TD", (F, D), ("mlp", "embed"), dtype, rngs, b)
        self.act = act

    def __call__(self, x, ctx: StepContext):  # [T, D]
        h = gated_product(self.gate_proj, self.up_proj, x, ctx, self.act)
        return self.down_proj(h, ctx)


def split_kind(kind) -> tuple:
    """A layer kind -> (its `layer_types` entry or None, whether its MLP is sparse): a
    family with experts pairs each layer's attention type with its MLP's sparsity."""
    return kind if isinstance(kind, tuple) else (kind, False)


def layer_window(cfg: DecoderConfig, kind) -> int | None:
    """The sliding window of a layer of `kind` (None: full attention)."""
    return cfg.sliding_window if split_kind(kind)[0] == "sliding_attention" else None


class DecoderLayer(nnx.Module):
    """The pre-norm layer most families share: x + attn(norm(x)), then x + mlp(norm(x)).
    A family passes its attention and MLP blocks."""

    def __init__(self, cfg: DecoderConfig, dtype, *, attention: nnx.Module, mlp: nnx.Module):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp

    def __call__(self, x, ctx: StepContext, kv_caches):
        h, kv_caches = self.self_attn(self.input_layernorm(x), ctx, kv_caches)
        x, normed = self.post_attention_layernorm.add(x, h)
        return x + self.mlp(normed, ctx), kv_caches

"""Llama 4's text model (`Llama4ForCausalLM`, and the text half of
`Llama4ForConditionalGeneration`: Scout, Maverick).

- **Attention**: layers with rotary positions (`no_rope_layers[i]` = 1) attend within their
  chunk of `attention_chunk_size` positions (chunked local attention: a KV-cache group whose
  blocks of finished chunks are freed) and normalise q and k after the rotation with a
  weightless RMS norm (`use_qk_norm`, Llama4TextL2Norm); the others (NoPE, one in four) attend
  over everything without positions, their queries scaled per position by
  1 + attn_scale * log1p(floor((p + 1) / floor_scale)) (`attn_temperature_tuning`).
- **Rotation**: Llama 4 rotates interleaved pairs (x0, x1), (x2, x3), ...; `regroup` reorders
  each head's q and k rows to the rotate-half layout on load (even lanes first), which leaves
  every q . k as it is and lets the shared rotation run.
- **Experts** on the layers `moe_layers` names (every `interleave_moe_layer_step`-th): a
  sigmoid over the top k of the router's logits (top-1 as released), the weight scaling the
  token's input to its expert (`MoeConfig.weight_on_input`), and a shared expert every token
  takes, unweighted; the other layers have a dense MLP of `intermediate_size_mlp`. The
  checkpoint stacks the experts (`feed_forward.experts.gate_up_proj` [E, D, 2F], gate the
  first half), cut per expert on load as gpt-oss's.

Checkpoint names are transformers' (`feed_forward.*`, under `language_model.` for the
multimodal class); the vision tower and projector of the latter are not loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.kv_cache_interface import ChunkedLocalAttentionSpec
from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    attention_weights,
    cut_stacked_experts,
    mlp_weights,
)
from jllm.models.blocks import Attention, DecoderLayer, GatedMLP
from jllm.models.config import DecoderConfig
from jllm.models.context import StepContext
from jllm.models.moe import MoE, MoeConfig, MoeForCausalLM
from jllm.models.rope import apply_rope

CHUNKED = "chunked_attention"


@dataclass(frozen=True, kw_only=True)
class Llama4Config(DecoderConfig):
    moe: MoeConfig
    intermediate_size_mlp: int
    rope_layers: tuple[bool, ...]  # per layer: rotary positions (else NoPE)
    attention_chunk_size: int | None
    use_qk_norm: bool
    attn_temperature_tuning: bool
    floor_scale: float
    attn_scale: float
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, hf) -> Llama4Config:
        hf = getattr(hf, "text_config", None) or hf
        layers = hf.num_hidden_layers
        sparse = set(hf.moe_layers)
        moe = MoeConfig(
            sparse_layers=tuple(i in sparse for i in range(layers)),
            num_experts=int(hf.num_local_experts),
            num_experts_per_tok=int(hf.num_experts_per_tok),
            intermediate_size=int(hf.intermediate_size),
            norm_topk_prob=False,
            weight_on_input=True,
        )
        fields = DecoderConfig.fields_of(hf, windows=False)
        return cls(
            **fields,
            layer_types=tuple(hf.layer_types),
            moe=moe,
            intermediate_size_mlp=int(hf.intermediate_size_mlp),
            rope_layers=tuple(bool(r) for r in hf.no_rope_layers),
            attention_chunk_size=getattr(hf, "attention_chunk_size", None),
            use_qk_norm=bool(hf.use_qk_norm),
            attn_temperature_tuning=bool(hf.attn_temperature_tuning),
            floor_scale=float(hf.floor_scale),
            attn_scale=float(hf.attn_scale),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
        )


def l2_norm(x, eps: float):
    """Llama4TextL2Norm: RMS-normalised over the last axis in float32, no weight."""
    f = x.astype(jnp.float32)
    return (f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Llama4Attention(Attention):
    """The shared attention block (projections, options), with Llama 4's order: rotation,
    then the weightless q/k norm; a NoPE layer's queries scaled by their temperature."""

    def __init__(self, cfg: Llama4Config, dtype, rngs: nnx.Rngs, *, rope: bool, chunk_size):
        bias = cfg.attention_bias
        super().__init__(
            cfg,
            dtype,
            rngs,
            rope=cfg.rope if rope else None,
            chunk_size=chunk_size,
            qkv_bias=bias,
            o_bias=bias,
        )
        self.l2 = cfg.use_qk_norm and rope
        self.temperature = cfg.attn_temperature_tuning and not rope
        self.eps, self.floor_scale, self.attn_scale = (
            cfg.rms_norm_eps,
            cfg.floor_scale,
            cfg.attn_scale,
        )

    def __call__(self, x, ctx: StepContext, kv_caches):
        q, k, v = self.q_proj(x, ctx), self.k_proj(x, ctx), self.v_proj(x, ctx)  # [T, N|K, H]
        if self.rope is not None:
            q = apply_rope(q, ctx.positions, self.rope)
            k = apply_rope(k, ctx.positions, self.rope)
        if self.l2:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature:
            p = ctx.positions.astype(jnp.float32)
            scale = jnp.log1p(jnp.floor((p + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q.astype(jnp.float32) * scale[:, None, None]).astype(q.dtype)
        kv_scales = (self.k_scale[...], self.v_scale[...]) if self.kv_scales else None
        o, kv_caches = ctx.attend(q, k, v, kv_caches, options=self.options, kv_scales=kv_scales)
        return self.o_proj(o, ctx), kv_caches


class Llama4MoE(MoE):
    """The routed experts (sigmoid over the top k logits, weights on the inputs) and the
    shared expert every token takes."""

    def __init__(self, cfg: Llama4Config, dtype, rngs: nnx.Rngs):
        moe, D, act = cfg.moe, cfg.hidden_size, cfg.hidden_act
        super().__init__(
            D,
            moe.intermediate_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            False,
            act,
            dtype,
            rngs,
            moe.expert_parallel,
            weight_on_input=True,
        )
        self.shared_expert = GatedMLP(D, moe.intermediate_size, act, dtype, rngs)

    def choose(self, logits):
        top, ids = jax.lax.top_k(logits.astype(jnp.float32), self.k)
        return jax.nn.sigmoid(top), ids.astype(jnp.int32)

    def __call__(self, x, ctx=None):
        return self._routed(x, ctx) + self.shared_expert(x, ctx)


class Llama4DecoderLayer(DecoderLayer):
    """`kind`: (`layer_types` entry, sparse MLP, rotary positions)."""

    def __init__(self, cfg: Llama4Config, dtype, rngs: nnx.Rngs, kind=None):
        attn_type, sparse, rope = kind
        chunk = cfg.attention_chunk_size if attn_type == CHUNKED else None
        attention = Llama4Attention(cfg, dtype, rngs, rope=rope, chunk_size=chunk)
        if sparse:
            mlp = Llama4MoE(cfg, dtype, rngs)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size_mlp, cfg.hidden_act, dtype, rngs)
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class Llama4ForCausalLM(MoeForCausalLM):
    layer_cls = Llama4DecoderLayer

    @classmethod
    def layer_kinds(cls, cfg: Llama4Config):
        return tuple(zip(cfg.layer_types, cfg.moe.sparse_layers, cfg.rope_layers, strict=True))

    @classmethod
    def attention_kind(cls, cfg: Llama4Config, kind):
        if kind[0] == CHUNKED:
            heads = dict(num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_dim)
            return ChunkedLocalAttentionSpec(**heads, attention_chunk_size=cfg.attention_chunk_size)
        return None


_LAYER = re.compile(r"(model\.layers\.\d+)\.(.+)")


def _rotate_half_rows(w: np.ndarray, head_dim: int) -> np.ndarray:
    """q/k projection rows [heads * H, ...] with each head's interleaved pairs reordered to
    the rotate-half layout: lanes 0, 2, 4, ... then 1, 3, 5, ..."""
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    heads = w.reshape(-1, head_dim, *w.shape[1:])
    return heads[:, order].reshape(w.shape)


def regroup(weights, cfg: Llama4Config):
    """The checkpoint's `feed_forward` at our `mlp`, its stacked experts cut per expert, and
    q/k rows in the rotate-half layout."""
    for name, w in weights:
        m = _LAYER.fullmatch(name)
        if m is None:
            yield name, w
            continue
        layer, local = m.group(1), m.group(2).replace("feed_forward.", "mlp.", 1)
        if local in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            proj = local.rsplit(".", 1)[1]
            w = np.asarray(w)
            yield from cut_stacked_experts(f"{layer}.mlp.experts", proj, w, interleaved=False)
        elif local.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
            yield f"{layer}.{local}", _rotate_half_rows(np.asarray(w), cfg.head_dim)
        else:
            yield f"{layer}.{local}", w


def layer_weights(cfg: Llama4Config) -> dict:
    bias = cfg.attention_bias
    names = attention_weights(qkv_bias=bias, o_bias=bias) | LAYER_NORMS
    if not all(cfg.moe.sparse_layers):
        names |= mlp_weights()
    if any(cfg.moe.sparse_layers):
        names["mlp.router.weight"] = ("mlp.gate.weight", "t")
        names |= mlp_weights("mlp.shared_expert")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"mlp.experts.*.{proj}.weight"] = (f"mlp.experts.{proj}", "t")
    return names


def _text_only(name: str) -> str | None:
    """The multimodal checkpoint's text model at the text class's names; its vision tower
    and projector are not loaded."""
    if name.startswith("language_model."):
        return name[len("language_model.") :]
    if name.startswith(("vision_model.", "multi_modal_projector.")):
        return None
    return name


def _architecture(name: str, rename) -> Architecture:
    return Architecture(
        name=name,
        config=Llama4Config.from_hf,
        module=Llama4ForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
        rename=rename,
        regroup=regroup,
    )


ARCHITECTURES = {
    "Llama4ForCausalLM": _architecture("Llama4ForCausalLM", lambda name: name),
    "Llama4ForConditionalGeneration": _architecture("Llama4ForConditionalGeneration", _text_only),
}

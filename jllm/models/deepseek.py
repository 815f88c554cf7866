"""DeepSeek-V2 and V3 (and the checkpoints that share their shape: Kimi K2, DeepSeek-R1):
multi-head latent attention over a latent KV cache, and a mixture of experts with DeepSeek's
grouped routing and shared experts after the first `first_k_dense_replace` dense layers.

Attention (MLA) in the absorbed form, for every row kind: each token's cache entry is one
vector of `kv_lora_rank + qk_rope_head_dim` lanes (the normalised latent c, then the rotated
shared key k_pe: vLLM's layout, 576 lanes for V3 against 2 x 128 heads x 192 dense), read by
every head. A head's query is its q_nope absorbed into the latent space through kv_b_proj's
key half (q_nope W_UK: [T, N, R]) beside its rotated q_pe; the attention's output is a
mix of latents [T, N, R], projected out once through kv_b_proj's value half (W_UV) and
o_proj. This equals transformers' expanded form (keys and values per head from kv_b_proj)
up to the order of the sums. The query comes from `q_proj`, or through `q_a_proj`, its
norm and `q_b_proj` when the config has a `q_lora_rank`. The softmax scale is
qk_head_dim^-1/2 times YaRN's mscale(factor, mscale_all_dim)^2 (DeepSeek's). The rotary
lanes are interleaved pairs in the checkpoints (`rope_interleave`, unless a config says
false): they are
de-interleaved before the rotate-half rotation, which leaves q_pe . k_pe as it is.

Experts: `GroupedRouting` (models/moe.py) picks each token's experts; the shared experts
are one dense gated MLP every token takes, with no gate of their own.

Glossary: T tokens, D model dim, N heads, R kv_lora_rank, r qk_rope_head_dim, h
qk_nope_head_dim, v v_head_dim, Q q_lora_rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.attention.options import AttentionOptions
from jllm.kv_cache_interface import MLAAttentionSpec
from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    GgufFamily,
    expert_weights,
    mlp_weights,
    unstacked_experts,
)
from jllm.models.blocks import DecoderLayer, GatedMLP, split_kind
from jllm.models.config import DecoderConfig
from jllm.models.context import StepContext
from jllm.models.layers import Linear, RMSNorm, StackedWeight
from jllm.models.moe import GroupedRouting, MoE, MoeConfig, MoeForCausalLM, route_grouped
from jllm.models.rope import apply_rope, yarn_mscale
from jllm.quantization.weights import QuantizedWeight, dequantize


@dataclass(frozen=True, kw_only=True)
class DeepseekConfig(DecoderConfig):
    moe: MoeConfig
    routing: GroupedRouting
    shared_experts_size: int  # the shared experts' width (moe_intermediate * n_shared)
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool
    attention_bias: bool = False
    # DeepSeek-V3's multi-token-prediction layers after the decoder's
    # (`num_nextn_predict_layers`): in its checkpoints, not in the model that generates
    draft_layers: int = 0

    @classmethod
    def from_hf(cls, hf, v3: bool) -> DeepseekConfig:
        experts = int(getattr(hf, "n_routed_experts", None) or 0)
        dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
        every = int(getattr(hf, "moe_layer_freq", 1) or 1)
        sparse = tuple(
            experts > 0 and i >= dense and i % every == 0 for i in range(hf.num_hidden_layers)
        )
        moe = MoeConfig(
            sparse_layers=sparse,
            num_experts=max(experts, 1),
            num_experts_per_tok=int(hf.num_experts_per_tok or 1),
            intermediate_size=int(hf.moe_intermediate_size),
        )
        nope, rope = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
        fields = DecoderConfig.fields_of(hf, windows=False)
        # The rotation is the latent's shared key's (qk_rope_head_dim lanes), whatever the
        # config's head_dim says.
        fields["head_dim"] = rope
        fields["rope"] = type(fields["rope"]).from_hf(hf, rope)
        scale = (nope + rope) ** -0.5
        params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", {}))
        if params.get("rope_type", params.get("type")) not in (None, "default"):
            mscale_all_dim = params.get("mscale_all_dim", 0)
            if mscale_all_dim:
                scale *= yarn_mscale(params["factor"], mscale_all_dim) ** 2
        return cls(
            **fields,
            moe=moe,
            routing=GroupedRouting.from_hf(hf, "noaux_tc" if v3 else "greedy"),
            shared_experts_size=int(hf.moe_intermediate_size * (hf.n_shared_experts or 0)),
            q_lora_rank=getattr(hf, "q_lora_rank", None) or None,
            kv_lora_rank=int(hf.kv_lora_rank),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(hf.v_head_dim),
            softmax_scale=float(scale),
            # DeepSeek's checkpoints rotate interleaved pairs (V2's transformers code always)
            rope_interleave=getattr(hf, "rope_interleave", None) is not False,
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            draft_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0),
        )


def _stored(w, shape: tuple[int, ...], dtype):
    """This layer's weight as [In..., Out...] floats: out of the layer stack (the scan hands
    a kernel's Linear the whole stack), a quantized one ([Out, In]) dequantized."""
    stacked = lambda a: isinstance(a, StackedWeight)  # noqa: E731
    w = jax.tree.map(lambda a: a.stack[a.layer] if stacked(a) else a, w, is_leaf=stacked)
    if isinstance(w, QuantizedWeight):
        R, N, H = shape
        return jnp.transpose(dequantize(w, dtype).reshape(N, H, R), (2, 0, 1))
    return w


class LatentAttention(nnx.Module):
    """MLA in the absorbed form (the module's docstring)."""

    def __init__(self, cfg: DeepseekConfig, dtype, rngs: nnx.Rngs):
        D, N, eps = cfg.hidden_size, cfg.num_heads, cfg.rms_norm_eps
        R, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        h, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        b = int(cfg.attention_bias)
        heads = (None, "heads", None)
        if cfg.q_lora_rank:
            Q = cfg.q_lora_rank
            self.q_a_proj = Linear("TD,DQ->TQ", (D, Q), ("embed", None), dtype, rngs, b)
            self.q_a_layernorm = RMSNorm(Q, eps, dtype)
            self.q_b_proj = Linear("TQ,QNH->TNH", (Q, N, h + r), heads, dtype, rngs)
        else:
            self.q_proj = Linear(
                "TD,DNH->TNH", (D, N, h + r), ("embed", "heads", None), dtype, rngs
            )
        self.kv_a_proj_with_mqa = Linear("TD,DL->TL", (D, R + r), ("embed", None), dtype, rngs, b)
        self.kv_a_layernorm = RMSNorm(R, eps, dtype)
        # Read as two halves, never applied as a projection (the absorbed form).
        self.kv_b_proj = Linear("TR,RNH->TNH", (R, N, h + v), heads, dtype, rngs)
        self.kv_b_proj.packable = False  # absorbed: __call__ reads the weight itself
        self.o_proj = Linear("TNH,NHD->TD", (N, v, D), ("heads", None, "embed"), dtype, rngs, b)
        self.R, self.h, self.rope, self.interleave = R, h, cfg.rope, cfg.rope_interleave
        self.options = AttentionOptions(scale=cfg.softmax_scale, latent=True, v_head_dim=R)

    def _rotate(self, x, ctx: StepContext):  # [T, heads, r]
        if self.interleave:  # (x0, x1), (x2, x3), ... -> the rotate-half layout
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, ctx.positions, self.rope)

    def __call__(self, x, ctx: StepContext, kv_caches):
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, ctx)), ctx)
        else:
            q = self.q_proj(x, ctx)  # [T, N, h + r]
        kv = self.kv_a_proj_with_mqa(x, ctx)  # [T, R + r]
        R, h = self.R, self.h
        latent = self.kv_a_layernorm(kv[:, :R])[:, None]  # [T, 1, R]
        k_pe = self._rotate(kv[:, None, R:], ctx)  # [T, 1, r]
        w = self.kv_b_proj.weight.get_value()
        w = _stored(w, (R, *self.kv_b_proj.out_shape), x.dtype)  # [R, N, h + v]
        q_latent = jnp.einsum("TNh,RNh->TNR", q[..., :h], w[..., :h])
        query = jnp.concatenate([q_latent.astype(x.dtype), self._rotate(q[..., h:], ctx)], -1)
        key = jnp.concatenate([latent, k_pe], axis=-1)  # [T, 1, R + r]
        o, kv_caches = ctx.attend(query, key, None, kv_caches, options=self.options)
        o = jnp.einsum("TNR,RNv->TNv", o, w[..., h:]).astype(x.dtype)  # [T, N, v]
        return self.o_proj(o, ctx), kv_caches


class DeepseekMoE(MoE):
    """The routed experts by `GroupedRouting`, with V3's correction bias, and the shared
    experts every token takes (no gate)."""

    def __init__(self, cfg: DeepseekConfig, dtype, rngs: nnx.Rngs):
        moe = cfg.moe
        super().__init__(
            cfg.hidden_size,
            moe.intermediate_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.norm_topk_prob,
            cfg.hidden_act,
            dtype,
            rngs,
            moe.expert_parallel,
        )
        self.routing = cfg.routing
        if cfg.routing.biased:  # float32 whatever the model's dtype, as the router's scores
            E = moe.num_experts
            self.e_score_correction_bias = nnx.Param(
                jnp.zeros((E,), jnp.float32), logical_axes=(None,)
            )
        if cfg.shared_experts_size:
            self.shared_experts = GatedMLP(
                cfg.hidden_size, cfg.shared_experts_size, cfg.hidden_act, dtype, rngs
            )

    def choose(self, logits):
        bias = self.e_score_correction_bias[...] if self.routing.biased else None
        return route_grouped(logits, self.k, self.routing, bias)

    def __call__(self, x, ctx=None):
        out = self._routed(x, ctx)
        if getattr(self, "shared_experts", None) is not None:
            out = out + self.shared_experts(x, ctx).astype(out.dtype)
        return out


class DeepseekDecoderLayer(DecoderLayer):
    """`kind`: (None, whether its MLP is sparse)."""

    def __init__(self, cfg: DeepseekConfig, dtype, rngs: nnx.Rngs, kind=None):
        sparse = split_kind(kind)[1]
        if sparse:
            mlp = DeepseekMoE(cfg, dtype, rngs)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)
        super().__init__(cfg, dtype, attention=LatentAttention(cfg, dtype, rngs), mlp=mlp)


class DeepseekForCausalLM(MoeForCausalLM):
    layer_cls = DeepseekDecoderLayer

    @classmethod
    def attention_kind(cls, cfg: DeepseekConfig, kind):
        return MLAAttentionSpec(
            kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim
        )


def layer_weights(cfg: DeepseekConfig) -> dict:
    a = "self_attn."
    names = dict(LAYER_NORMS)
    if cfg.q_lora_rank:
        names |= {a + "q_a_proj.weight": "t", a + "q_a_layernorm.weight": None}
        names[a + "q_b_proj.weight"] = "qkv"
    else:
        names[a + "q_proj.weight"] = "qkv"
    names |= {
        a + "kv_a_proj_with_mqa.weight": "t",
        a + "kv_a_layernorm.weight": None,
        a + "kv_b_proj.weight": "qkv",
        a + "o_proj.weight": "o",
    }
    if cfg.attention_bias:
        names |= {a + "kv_a_proj_with_mqa.bias": None, a + "o_proj.bias": None}
        if cfg.q_lora_rank:
            names[a + "q_a_proj.bias"] = None
    sparse = cfg.moe.sparse_layers
    if not all(sparse):
        names |= mlp_weights()
    if any(sparse):
        experts = {p: f"mlp.experts.*.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        names |= expert_weights("mlp.gate.weight", experts)
        if cfg.routing.biased:
            names["mlp.gate.e_score_correction_bias"] = ("mlp.e_score_correction_bias", None)
        if cfg.shared_experts_size:
            names |= mlp_weights("mlp.shared_experts")
    return names


def _architecture(name: str, v3: bool) -> Architecture:
    return Architecture(
        name=name,
        config=lambda hf: DeepseekConfig.from_hf(hf, v3),
        module=DeepseekForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
    )


ARCHITECTURES = {
    "DeepseekV2ForCausalLM": _architecture("DeepseekV2ForCausalLM", v3=False),
    "DeepseekV3ForCausalLM": _architecture("DeepseekV3ForCausalLM", v3=True),
}


def _gguf_regroup(weights: Iterator[tuple[str, object]], gf=None) -> Iterator[tuple[str, object]]:
    """llama.cpp's `deepseek2` tensors as the checkpoint's: each layer's experts stacked
    ([E, out, in]) back into one tensor per expert, the router's correction bias under its
    name, and kv_b_proj from the two halves the converter splits it into for its absorbed
    attention (`attn_k_b`: [N, R, h], the key half per head transposed; `attn_v_b`:
    [N, v, R]). Files from before the split hold kv_b_proj whole."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, w in weights:
        if name.endswith(".e_score_correction.bias"):
            yield name.removesuffix(".bias") + "_bias", w
        elif name.endswith(("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")):
            layer, part = name.rsplit(".self_attn.", 1)
            pair = halves.setdefault(layer, {})
            pair[part[0]] = np.asarray(w)
            if len(pair) == 2:
                del halves[layer]
                k_b, v_b = pair["k"], pair["v"]
                kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [N, h + v, R]
                yield f"{layer}.self_attn.kv_b_proj.weight", kv_b.reshape(-1, v_b.shape[2])
        elif ".mlp.experts." in name and np.ndim(w) == 3:
            yield from unstacked_experts(name, w)
        else:
            yield name, w
    if halves:
        raise ValueError(f"GGUF layers {sorted(halves)} hold one half of kv_b_proj only.")


_GGUF_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction",
    **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")},
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")},
}
# One llama.cpp architecture for V2 and V3: the reader (model_loader/gguf_config.py) tells
# them apart by the router and names the class.
GGUF = {
    "deepseek2": GgufFamily(
        model_type="deepseek_v3",
        class_name="DeepseekV3ForCausalLM",
        layer_names=_GGUF_NAMES,
        regroup=_gguf_regroup,
    )
}

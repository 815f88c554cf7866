"""Qwen3-Next and Qwen3.5's text models: hybrids of gated DeltaNet layers (linear attention:
a fixed-size state per request) and gated full attention, in the order `layer_types` gives
(three linear layers to one full in the released models), with Qwen's mixture of experts and
its shared expert (Qwen3-Next, Qwen3.5-MoE) or a dense MLP (Qwen3.5).

A gated DeltaNet layer (`GatedDeltaNet`) projects each token to q, k, v (per key head q
and k, `Hv / Hk` value heads per key head), an output gate z, a write strength b and a decay
input a; runs q, k, v through a short causal depthwise convolution (width
`linear_conv_kernel_dim`, SiLU after); then the gated delta rule (pallas_kernels/
gated_delta_rule: beta = sigmoid(b), log decay g = -exp(A_log) * softplus(a + dt_bias), q and
k L2-normalised); then an RMSNorm per value head gated by SiLU(z), and the output
projection. Its per-request state, a KV-cache spec of its own (`MambaSpec`), is the
recurrent state [Hv, K, V] and the conv window [J - 1, channels], both float32 (vLLM's
"mamba" cache); the step's rows load and store them through the step context
(models/state.py). Qwen3-Next fuses the projections per key head (`in_proj_qkvz`,
`in_proj_ba`); Qwen3.5 keeps them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`).

A full-attention layer is Qwen3's with an output gate (q_proj yields each head's gate,
sigmoid-scaled outputs: `blocks.Attention(output_gate=True)`), per-head q/k norms, and
rotary positions on the first `partial_rotary_factor` of each head. Every RMSNorm but the
DeltaNet's gated one scales by `1 + w` (Gemma's form).

Under tensor parallelism a DeltaNet layer is split by key head (with its Hv / Hk value
heads): the projections by output heads, the conv by channel (ordered key head by key head:
each head's q, k and v), the state by head, the output projection by input heads (one
reduction, as attention's). Prefix hits resume from state snapshots, and n-gram drafts that
are rejected put the state back (engine/single_type_manager.py: StateManager). Not yet: draft
models and MTP as proposers.

Glossary: T tokens, D model dim, Hk key heads, Hv value heads, K key dim, V value dim,
G key-head groups of a fused projection, X a group's fused (or conv) width, J taps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.kv_cache_interface import MambaSpec
from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    GgufFamily,
    attention_weights,
    unstacked_experts,
)
from jllm.models.blocks import Attention, GatedMLP, split_kind
from jllm.models.config import DecoderConfig
from jllm.models.context import StepContext
from jllm.models.decoder import CausalLM
from jllm.models.layers import Linear, RMSNorm, activation
from jllm.models.moe import MoE, MoeConfig
from jllm.models.qwen_moe import mlp_names, sparse_layers
from pallas_kernels.gated_delta_rule import causal_conv

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class LinearAttentionConfig:
    """A gated DeltaNet layer's shape (transformers' `linear_*` fields)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(Hk key heads, Hv value heads, K key dim, V value dim)."""
        return self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim

    @property
    def group_width(self) -> int:
        """A key head's conv channels: its q and k, and its Hv / Hk heads' v."""
        Hk, Hv, K, V = self.dims
        return 2 * K + Hv // Hk * V

    def spec(self) -> MambaSpec:
        """One layer's per-request state: the recurrent state [Hv, K, V] and the conv window
        [J - 1, Hk, X], split over tensor-parallel devices by their heads."""
        Hk, Hv, K, V = self.dims
        window = (self.conv_kernel_dim - 1, Hk, self.group_width)
        return MambaSpec(
            shapes=((Hv, K, V), window), dtypes=("float32", "float32"), head_axes=(0, 1)
        )


@dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(DecoderConfig):
    linear: LinearAttentionConfig
    moe: MoeConfig | None = None  # None: every layer's MLP is dense (Qwen3.5)
    attention_bias: bool = False
    norm_unit_offset: bool = True  # the final norm's 1 + w (models/decoder.py)

    @classmethod
    def from_hf(cls, hf, *, fused: bool) -> Qwen3NextConfig:
        types = tuple(hf.layer_types)
        unknown = sorted(set(types) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"Qwen3-Next layer types {unknown} are not supported by jllm yet.")
        linear = LinearAttentionConfig(
            num_key_heads=hf.linear_num_key_heads,
            num_value_heads=hf.linear_num_value_heads,
            key_head_dim=hf.linear_key_head_dim,
            value_head_dim=hf.linear_value_head_dim,
            conv_kernel_dim=hf.linear_conv_kernel_dim,
            fused_projections=fused,
        )
        if linear.num_value_heads % linear.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({linear.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({linear.num_key_heads})."
            )
        moe = None
        if getattr(hf, "num_experts", 0):
            normalize = getattr(hf, "norm_topk_prob", None)  # Qwen3.5-MoE's: always
            moe = MoeConfig.from_hf(
                hf,
                sparse_layers=sparse_layers(hf),
                num_experts=hf.num_experts,
                intermediate_size=hf.moe_intermediate_size,
                norm_topk_prob=True if normalize is None else normalize,
                shared=hf.shared_expert_intermediate_size,
            )
        return cls(
            **DecoderConfig.fields_of(hf, windows=False),
            layer_types=types,
            linear=linear,
            moe=moe,
            attention_bias=bool(getattr(hf, "attention_bias", False)),
        )


class GatedDeltaNet(nnx.Module):
    """The gated DeltaNet token mixer (module docstring)."""

    def __init__(self, cfg: Qwen3NextConfig, dtype, rngs: nnx.Rngs):
        lin, D = cfg.linear, cfg.hidden_size
        Hk, Hv, K, V = lin.dims
        r, J = Hv // Hk, lin.conv_kernel_dim
        self.lin, self.act = lin, activation(cfg.hidden_act)
        heads = ("embed", "heads", None)
        if lin.fused_projections:  # per key head: q, k, r values, r gates; r b's, r a's
            X = 2 * K + 2 * r * V
            self.in_proj_qkvz = Linear("TD,DGX->TGX", (D, Hk, X), heads, dtype, rngs)
            self.in_proj_ba = Linear("TD,DGX->TGX", (D, Hk, 2 * r), heads, dtype, rngs)
        else:
            for name, N, H in (("q", Hk, K), ("k", Hk, K), ("v", Hv, V), ("z", Hv, V)):
                proj = Linear("TD,DNH->TNH", (D, N, H), heads, dtype, rngs)
                setattr(self, f"in_proj_{name}", proj)
            self.in_proj_b = Linear("TD,DN->TN", (D, Hv), ("embed", "heads"), dtype, rngs)
            self.in_proj_a = Linear("TD,DN->TN", (D, Hv), ("embed", "heads"), dtype, rngs)
        self.conv1d_q = Conv1d(Hk, K, J, dtype)
        self.conv1d_k = Conv1d(Hk, K, J, dtype)
        self.conv1d_v = Conv1d(Hv, V, J, dtype)
        self.A_log = nnx.Param(jnp.zeros((Hv,), jnp.float32), logical_axes=("heads",))
        self.dt_bias = nnx.Param(jnp.ones((Hv,), jnp.float32), logical_axes=("heads",))
        self.norm = RMSNorm(V, cfg.rms_norm_eps, dtype)
        self.out_proj = Linear("TNV,NVD->TD", (Hv, V, D), ("heads", None, "embed"), dtype, rngs)

    def projections(self, x, ctx):
        """x [T, D] -> (q, k [T, Hk, K], v, z [T, Hv, V], b, a [T, Hv])."""
        lin, T = self.lin, x.shape[0]
        Hk, Hv, K, V = lin.dims
        if not lin.fused_projections:
            qkvz = (self.in_proj_q, self.in_proj_k, self.in_proj_v, self.in_proj_z)
            return (*(p(x, ctx) for p in qkvz), self.in_proj_b(x, ctx), self.in_proj_a(x, ctx))
        r = Hv // Hk
        qkvz = self.in_proj_qkvz(x, ctx)  # [T, Hk, X]
        q, k, v, z = jnp.split(qkvz, [K, 2 * K, 2 * K + r * V], axis=-1)
        ba = self.in_proj_ba(x, ctx)  # [T, Hk, 2r]
        b, a = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
        return q, k, v.reshape(T, Hv, V), z.reshape(T, Hv, V), b, a

    def conv(self, q, k, v, window, md):
        """The causal conv (SiLU after) over each key head's channels [q | k | v], in that
        group-major order so that a device's heads hold whole groups: q, k [T, Hk, K], v
        [T, Hv, V], window [R, J - 1, Hk, X] -> (q, k, v as given, the new window)."""
        T, (Hk, Hv, K, V) = q.shape[0], self.lin.dims
        R, J = window.shape[0], self.lin.conv_kernel_dim
        mixed = jnp.concatenate([q, k, v.reshape(T, Hk, -1)], axis=-1)  # [T, Hk, X]
        parts = (self.conv1d_q, self.conv1d_k, self.conv1d_v)
        w = [c.weight[...] for c in parts]
        taps = jnp.concatenate([w[0], w[1], w[2].reshape(Hk, -1, J)], axis=1)  # [Hk, X, J]
        y, new = causal_conv(
            mixed.reshape(T, -1),
            taps.reshape(-1, J).T,
            window.reshape(R, J - 1, -1),
            md.query_start,
            md.query_lens,
        )
        y = self.act(y).astype(q.dtype).reshape(T, Hk, -1)
        q, k, v = jnp.split(y, [K, 2 * K], axis=-1)
        return q, k, v.reshape(T, Hv, V), new.reshape(window.shape)

    def __call__(self, x, ctx: StepContext, kv_caches):
        f32 = jnp.float32
        md = ctx.attn[ctx.group]
        state, window = ctx.load_state(kv_caches)  # [R, Hv, K, V], [R, J - 1, Hk, X]
        q, k, v, z, b, a = self.projections(x, ctx)
        q, k, v, window = self.conv(q, k, v, window, md)
        beta = jax.nn.sigmoid(b.astype(f32))  # [T, Hv]
        g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(
            a.astype(f32) + self.dt_bias[...].astype(f32)
        )
        o, state = ctx.backend.gated_delta_rule(q, k, v, g, beta, state, md)
        o = self.norm(o.astype(x.dtype)).astype(f32) * jax.nn.silu(z.astype(f32))
        kv_caches = ctx.store_state(kv_caches, (state, window))
        return self.out_proj(o.astype(x.dtype), ctx), kv_caches


class Conv1d(nnx.Module):
    """Depthwise convolution taps of N heads of H channels: [N, H, J] (transformers' [C, 1,
    J] conv1d, split by the loader into its q, k and v channels)."""

    def __init__(self, heads: int, width: int, taps: int, dtype):
        self.weight = nnx.Param(
            jnp.zeros((heads, width, taps), dtype), logical_axes=("heads", None, None)
        )


class Qwen3NextDecoderLayer(nnx.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)), the norms scaling by 1 + w. `kind`: (the
    layer's `layer_types` entry, whether its MLP is sparse); the mixer sits at
    `linear_attn` or `self_attn`, as in the checkpoint."""

    def __init__(self, cfg: Qwen3NextConfig, dtype, rngs: nnx.Rngs, kind=None):
        attn_kind, sparse = split_kind(kind)
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)
        self.linear = attn_kind == LINEAR
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype, rngs)
        else:
            bias = cfg.attention_bias
            self.self_attn = Attention(
                cfg,
                dtype,
                rngs,
                rope=cfg.rope,
                qkv_bias=bias,
                o_bias=bias,
                qk_norm=True,
                norm_offset=True,
                output_gate=True,
            )
        self.post_attention_layernorm = RMSNorm(D, eps, dtype, unit_offset=True)
        if sparse:
            self.mlp = MoE.of(D, cfg.moe, cfg.hidden_act, dtype, rngs)
        else:
            self.mlp = GatedMLP(D, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)

    def __call__(self, x, ctx: StepContext, kv_caches):
        mixer = self.linear_attn if self.linear else self.self_attn
        h, kv_caches = mixer(self.input_layernorm(x), ctx, kv_caches)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), ctx), kv_caches


class Qwen3NextForCausalLM(CausalLM):
    layer_cls = Qwen3NextDecoderLayer

    @classmethod
    def layer_kinds(cls, cfg: Qwen3NextConfig):
        sparse = cfg.moe.sparse_layers if cfg.moe else (False,) * cfg.num_layers
        return tuple(zip(cfg.layer_types, sparse, strict=True))

    @classmethod
    def attention_kind(cls, cfg: Qwen3NextConfig, kind):
        return cfg.linear.spec() if split_kind(kind)[0] == LINEAR else None


def layer_weights(cfg: Qwen3NextConfig) -> dict:
    """Both mixers' names (each layer has one; a name its layer lacks is not in its
    checkpoint) and the MLPs' (`qwen_moe.mlp_names`)."""
    bias = cfg.attention_bias
    names = attention_weights(qkv_bias=bias, o_bias=bias, qk_norm=True) | LAYER_NORMS
    if cfg.linear.fused_projections:
        names |= {"linear_attn.in_proj_qkvz.weight": "qkv", "linear_attn.in_proj_ba.weight": "qkv"}
    else:
        names |= {f"linear_attn.in_proj_{p}.weight": "qkv" for p in "qkvz"}
        names |= {f"linear_attn.in_proj_{p}.weight": "t" for p in "ba"}
    names |= {f"linear_attn.conv1d_{p}.weight": "heads" for p in "qkv"}
    names |= {
        "linear_attn.A_log": None,
        "linear_attn.dt_bias": None,
        "linear_attn.norm.weight": None,
        "linear_attn.out_proj.weight": "o",
    }
    return names | mlp_names(cfg.moe)


def fused_weights(cfg: Qwen3NextConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """The conv's channels (and Qwen3.5's in_proj_qkv's rows), q | k | v, split into their
    parts, each with a head axis tensor parallelism splits."""
    Hk, Hv, K, V = cfg.linear.dims
    widths = {"q": Hk * K, "k": Hk * K, "v": Hv * V}
    fused = {"linear_attn.conv1d.weight": "linear_attn.conv1d_{}.weight"}
    if not cfg.linear.fused_projections:
        fused["linear_attn.in_proj_qkv.weight"] = "linear_attn.in_proj_{}.weight"
    return {
        name: tuple((part.format(p), n) for p, n in widths.items()) for name, part in fused.items()
    }


def _architecture(name: str, fused: bool) -> Architecture:
    return Architecture(
        name=name,
        config=lambda hf: Qwen3NextConfig.from_hf(hf, fused=fused),
        module=Qwen3NextForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
        fused_weights=fused_weights,
    )


def _gguf_regroup(weights: Iterator[tuple[str, object]], gf) -> Iterator[tuple[str, object]]:
    """llama.cpp's `qwen3next` tensors as the checkpoint's (its converter,
    Qwen3NextModel.modify_tensors, undone): `ssm_a` is -exp(A_log); the norms scaling by
    1 + w hold 1 + w (the DeltaNet's gated norm does not); the conv taps are squeezed to
    [C, J]; in_proj_qkvz is split into `attn_qkv` (every key head's q, then k, then v:
    the conv's channel order) and `attn_gate` (z), from which each key head's group
    [q, k, v, z] is rebuilt (files from before that split hold it whole, as `ssm_in`);
    each layer's experts are stacked."""
    held: dict[str, dict[str, np.ndarray]] = {}
    key_heads, key_dim = int(gf.arch_key("ssm.group_count")), int(gf.arch_key("ssm.state_size"))
    for name, w in weights:
        layer, _, part = name.partition(".linear_attn.")
        if part == "A_log":
            yield name, np.log(-np.asarray(w))
        elif part == "dt_proj.bias":
            yield f"{layer}.linear_attn.dt_bias", w
        elif part == "conv1d.weight":
            yield name, np.asarray(w)[:, None, :]
        elif part in ("attn_qkv.weight", "attn_gate.weight"):
            pair = held.setdefault(layer, {})
            pair[part] = np.asarray(w)
            if len(pair) == 2:
                del held[layer]
                qkvz = _qkvz(pair["attn_qkv.weight"], pair["attn_gate.weight"], key_heads, key_dim)
                yield f"{layer}.linear_attn.in_proj_qkvz.weight", qkvz
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            yield name, np.asarray(w) - np.float32(1.0)
        elif name.endswith("mlp.shared_expert_gate.weight") and np.ndim(w) == 1:
            yield name, np.asarray(w)[None]  # converters that squeezed it
        elif ".mlp.experts." in name and np.ndim(w) == 3:
            yield from unstacked_experts(name, w)
        else:
            yield name, w
    if held:
        raise ValueError(f"GGUF layers {sorted(held)} hold one of attn_qkv and attn_gate only.")


def _qkvz(qkv: np.ndarray, z: np.ndarray, Hk: int, K: int) -> np.ndarray:
    """in_proj_qkvz [Hk * X, D] (per key head: q, k, its values, its gates) from `attn_qkv`
    [2 Hk K + Hv V, D] (all q, all k, all v) and `attn_gate` [Hv V, D]."""
    D = qkv.shape[1]
    q, k, v = np.split(qkv, [Hk * K, 2 * Hk * K])
    parts = [q.reshape(Hk, K, D), k.reshape(Hk, K, D), v.reshape(Hk, -1, D), z.reshape(Hk, -1, D)]
    return np.concatenate(parts, axis=1).reshape(-1, D)


_GGUF_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ssm_in": "linear_attn.in_proj_qkvz",  # files from before attn_qkv / attn_gate
    "attn_qkv": "linear_attn.attn_qkv",
    "attn_gate": "linear_attn.attn_gate",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")},
    **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")},
}
GGUF = {
    "qwen3next": GgufFamily(
        model_type="qwen3_next",
        class_name="Qwen3NextForCausalLM",
        layer_names=_GGUF_NAMES,
        regroup=_gguf_regroup,
        float_parts=frozenset({"attn_qkv", "attn_gate"}),
    )
}


ARCHITECTURES = {
    "Qwen3NextForCausalLM": _architecture("Qwen3NextForCausalLM", fused=True),
    "Qwen3_5ForCausalLM": _architecture("Qwen3_5ForCausalLM", fused=False),
    "Qwen3_5MoeForCausalLM": _architecture("Qwen3_5MoeForCausalLM", fused=False),
}

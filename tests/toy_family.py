"""A test family on the model seams: Llama's layer with the attention kinds no served family
of this wave's start had, chunked local attention, attention sinks and an MLA-shaped latent
(DeepSeek's absorbed form: one vector per token shared by every head, its first lanes the
values), beside sliding and full layers; registered out of tree (`registry.register`), and
its numpy oracle.

A checkpoint is a tiny random transformers Llama whose config names this family
(`model_type` "jllm_toy") with `layer_types` of "chunked_attention", "sliding_attention",
"full_attention" and "latent_attention", an `attention_chunk_size`, a `sliding_window` and
the latent's sizes, plus one `self_attn.sinks` [N] tensor per attention layer; a latent
layer's q/k/v/o are replaced by `q_proj` [N*(R+r), D], `kv_proj` [R+r, D] and `o_proj`
[D, N*R]. The oracle (`reference_logits`) reads the safetensors file itself and runs dense
float64 attention with the masks, sinks and latents written out here, so it shares no code
with the engine's paged path.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jllm.attention.options import AttentionOptions
from jllm.kv_cache_interface import ChunkedLocalAttentionSpec, MLAAttentionSpec
from jllm.models import registry
from jllm.models.architecture import (
    LAYER_NORMS,
    TOP_WEIGHTS,
    Architecture,
    attention_weights,
    mlp_weights,
)
from jllm.models.blocks import Attention, DecoderLayer, GatedMLP
from jllm.models.config import DecoderConfig
from jllm.models.context import StepContext
from jllm.models.layers import Linear
from jllm.models.llama import LlamaForCausalLM
from jllm.models.rope import RopeConfig, apply_rope

MODEL_TYPE = "jllm_toy"
LAYER_TYPES = ("chunked_attention", "sliding_attention", "full_attention", "chunked_attention")
LATENT_TYPES = ("latent_attention", "full_attention", "latent_attention")
LATENT = dict(kv_lora_rank=32, qk_rope_head_dim=8)


class ToyHFConfig(transformers.LlamaConfig):
    model_type = MODEL_TYPE


@dataclass(frozen=True, kw_only=True)
class ToyConfig(DecoderConfig):
    attention_chunk_size: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    latent_rope: RopeConfig | None = None

    @classmethod
    def from_hf(cls, hf) -> ToyConfig:
        fields = DecoderConfig.fields_of(hf, windows=False)
        r = getattr(hf, "qk_rope_head_dim", 0)
        return cls(
            **fields,
            sliding_window=getattr(hf, "sliding_window", None),
            layer_types=tuple(hf.layer_types),
            attention_chunk_size=getattr(hf, "attention_chunk_size", None),
            kv_lora_rank=getattr(hf, "kv_lora_rank", 0),
            qk_rope_head_dim=r,
            latent_rope=RopeConfig.from_hf(hf, r) if r else None,
        )


class LatentAttention(nnx.Module):
    """MLA's shape in the absorbed form: queries already in latent space [T, N, R + r], one
    latent [T, R + r] per token (its last r lanes rotated, as DeepSeek's k_pe), attention
    over the latents with their first R lanes as values, then [T, N, R] -> [T, D]."""

    def __init__(self, cfg: ToyConfig, dtype, rngs: nnx.Rngs):
        D, N, R, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.R, self.rope = R, cfg.latent_rope
        self.q_proj = Linear("TD,DNH->TNH", (D, N, R + r), ("embed", "heads", None), dtype, rngs)
        self.kv_proj = Linear("TD,DH->TH", (D, R + r), ("embed", None), dtype, rngs)
        self.o_proj = Linear("TNH,NHD->TD", (N, R, D), ("heads", None, "embed"), dtype, rngs)
        self.options = AttentionOptions(scale=(R + r) ** -0.5, latent=True, v_head_dim=R)

    def _rotate(self, x, ctx):  # the last r lanes of [T, heads, R + r]
        return jnp.concatenate(
            [x[..., : self.R], apply_rope(x[..., self.R :], ctx.positions, self.rope)], axis=-1
        )

    def __call__(self, x, ctx: StepContext, kv_caches):
        q = self._rotate(self.q_proj(x, ctx), ctx)
        latent = self._rotate(self.kv_proj(x, ctx)[:, None], ctx)  # [T, 1, R + r]
        o, kv_caches = ctx.attend(q, latent, None, kv_caches, options=self.options)
        return self.o_proj(o, ctx), kv_caches


class ToyLayer(DecoderLayer):
    def __init__(self, cfg: ToyConfig, dtype, rngs: nnx.Rngs, kind=None):
        attention = (
            LatentAttention(cfg, dtype, rngs)
            if kind == "latent_attention"
            else Attention(
                cfg,
                dtype,
                rngs,
                rope=cfg.rope,
                window=cfg.sliding_window if kind == "sliding_attention" else None,
                chunk_size=cfg.attention_chunk_size if kind == "chunked_attention" else None,
                sinks=True,
            )
        )
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class ToyForCausalLM(LlamaForCausalLM):
    layer_cls = ToyLayer

    @classmethod
    def attention_kind(cls, cfg: ToyConfig, kind):
        if kind == "chunked_attention":
            heads = dict(num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_dim)
            return ChunkedLocalAttentionSpec(**heads, attention_chunk_size=cfg.attention_chunk_size)
        if kind == "latent_attention":
            return MLAAttentionSpec(
                kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim
            )
        return super().attention_kind(cfg, kind)


def layer_weights(cfg: ToyConfig) -> dict:
    names = attention_weights() | {"self_attn.sinks": None} | mlp_weights() | LAYER_NORMS
    if "latent_attention" in cfg.layer_types:
        names["self_attn.kv_proj.weight"] = "t"
    return names


ARCHITECTURES = {
    "ToyForCausalLM": Architecture(
        name="ToyForCausalLM",
        config=ToyConfig.from_hf,
        module=ToyForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
    )
}


def register() -> None:
    transformers.AutoConfig.register(MODEL_TYPE, ToyHFConfig, exist_ok=True)
    registry.register(MODEL_TYPE, __name__, "ToyForCausalLM")


def save_toy(
    path: pathlib.Path, tokenizer_dir: str, *, chunk=None, window=None, layer_types=LAYER_TYPES
) -> str:
    """A toy checkpoint at `path`, one layer per entry of `layer_types`; sinks drawn around
    0 on the attention layers, the latent layers' projections drawn as transformers draws
    Llama's."""
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.25,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(0)
    N, D, R, r = config.num_attention_heads, config.hidden_size, *LATENT.values()
    for i, kind in enumerate(layer_types):
        p = f"model.layers.{i}.self_attn."
        if kind == "latent_attention":
            for name in ("q", "k", "v", "o"):
                del tensors[p + f"{name}_proj.weight"]
            for name, shape in (("q", (N * (R + r), D)), ("kv", (R + r, D)), ("o", (D, N * R))):
                tensors[p + f"{name}_proj.weight"] = rng.normal(0, 0.25, shape).astype(np.float32)
            continue
        tensors[p + "sinks"] = rng.normal(0.0, 1.0, N).astype(np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg |= {
        "model_type": MODEL_TYPE,
        "architectures": ["ToyForCausalLM"],
        "layer_types": list(layer_types),
        "attention_chunk_size": chunk,
        "sliding_window": window,
        **(LATENT if "latent_attention" in layer_types else {}),
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):  # x [T, heads, H], transformers' rotate_half layout
    H = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, H, 2) / H)
    angles = positions[:, None] * inv[None]  # [T, H/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    a, b = x[..., : H // 2], x[..., H // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def reference_logits(path: str, tokens: list[int], layer_types=None, sinks=True) -> np.ndarray:
    """[T, V] float64 logits of the toy model over `tokens`, dense and unpaged; with other
    `layer_types`, or without the sinks, for the tests that show they matter."""
    cfg = json.loads((pathlib.Path(path) / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(f"{path}/model.safetensors").items()}
    N, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    H = cfg["hidden_size"] // N
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = w["model.embed_tokens.weight"][tokens]
    for i, kind in enumerate(layer_types or cfg["layer_types"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        if kind == "latent_attention":
            x = x + _latent_attention(w, p, h, cfg, theta)
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
            continue
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, N, H)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, K, H)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, K, H)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
        scores = np.einsum("qnh,knh->nqk", q, k) * H**-0.5
        qi, ki = np.arange(T)[:, None], np.arange(T)[None]
        seen = ki <= qi
        if kind == "sliding_attention":
            seen &= ki > qi - cfg["sliding_window"]
        if kind == "chunked_attention":
            chunk = cfg["attention_chunk_size"]
            seen &= ki >= qi // chunk * chunk
        scores = np.where(seen[None], scores, -np.inf)
        sink = w[p + "self_attn.sinks"][:, None, None] if sinks else np.full((N, 1, 1), -np.inf)
        m = np.maximum(scores.max(-1, keepdims=True), sink)  # [N, T, 1]
        e = np.exp(scores - m)
        probs = e / (e.sum(-1, keepdims=True) + np.exp(sink - m))
        o = np.einsum("nqk,knh->qnh", probs, v).reshape(T, N * H)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ w["model.embed_tokens.weight"].T


def _latent_attention(w, p, h, cfg, theta):
    """One latent layer, dense: scores of each head's latent query against every earlier
    token's latent, values the latents' first R lanes."""
    T, N = h.shape[0], cfg["num_attention_heads"]
    R, r = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    pos = np.arange(T, dtype=np.float64)
    q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, N, R + r)
    c = (h @ w[p + "self_attn.kv_proj.weight"].T)[:, None]  # [T, 1, R + r]
    q = np.concatenate([q[..., :R], _rope(q[..., R:], pos, theta)], axis=-1)
    c = np.concatenate([c[..., :R], _rope(c[..., R:], pos, theta)], axis=-1)[:, 0]
    scores = np.einsum("qnh,kh->nqk", q, c) * (R + r) ** -0.5
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("nqk,kh->qnh", probs, c[:, :R]).reshape(T, N * R)
    return o @ w[p + "self_attn.o_proj.weight"].T

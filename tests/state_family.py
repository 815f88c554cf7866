"""A test family on the per-request state seam (`MambaSpec`, the one Qwen3-Next's gated
DeltaNet layers use): Llama's layers where some are a toy linear attention, registered out of
tree (`registry.register`), and its numpy oracle.

A linear-attention layer, over its (normed) input h [T, D]: a causal depthwise convolution
of width 4 (c_t = sum_j w_j * h_{t-3+j}, its last 3 inputs per request being the conv
state), then q, k, v projections of c per head and a gated linear recurrence per head n,
S_t = g_n * S_{t-1} + k_t^T v_t with a fixed decay g_n in (0, 1) (a parameter), and
o_t = q_t S_t * H^-0.5, then the output projection. The recurrent state S [N, H, H] and the
conv window [3, D] (both float32) are the layer's two per-request state arrays. It runs
over the flat batch's tokens with `jax.lax.scan`, each row from its slot's state (zeros when
it starts fresh), and stores every row's state after its last token.

The checkpoint is a tiny random transformers Llama (multi-head: k and v have N heads) whose
config names this family (`model_type` "jllm_state") with `layer_types` of
"linear_attention" and "full_attention", plus `self_attn.conv` [4, D] and `self_attn.decay`
[N] for each linear layer. The oracle (`reference_logits`) reads the safetensors file itself
and runs each whole sequence in float64, token by token for the recurrence.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jllm.kv_cache_interface import MambaSpec
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

MODEL_TYPE = "jllm_state"
LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL, LINEAR, FULL)  # group 0 is the state group
CONV = 4  # the convolution's width: the state keeps CONV - 1 inputs


class StateHFConfig(transformers.LlamaConfig):
    model_type = MODEL_TYPE


@dataclass(frozen=True, kw_only=True)
class StateConfig(DecoderConfig):
    @classmethod
    def from_hf(cls, hf) -> StateConfig:
        fields = DecoderConfig.fields_of(hf, windows=False)
        return cls(**fields, layer_types=tuple(hf.layer_types))


class LinearAttention(nnx.Module):
    """The toy linear attention (module docstring). Glossary: T tokens, R request rows,
    D model dim, N heads, H head dim (keys and values), J the conv's taps."""

    def __init__(self, cfg: StateConfig, dtype, rngs: nnx.Rngs):
        D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        axes = ("embed", "heads", "head_dim")
        self.q_proj = Linear("TD,DNH->TNH", (D, N, H), axes, dtype, rngs)
        self.k_proj = Linear("TD,DNH->TNH", (D, N, H), axes, dtype, rngs)
        self.v_proj = Linear("TD,DNH->TNH", (D, N, H), axes, dtype, rngs)
        self.o_proj = Linear("TNH,NHD->TD", (N, H, D), ("heads", "head_dim", "embed"), dtype, rngs)
        self.conv = nnx.Param(jnp.zeros((CONV, D), jnp.float32), logical_axes=(None, "embed"))
        self.decay = nnx.Param(jnp.full((N,), 0.5, jnp.float32), logical_axes=("heads",))
        self.scale = H**-0.5

    @staticmethod
    def spec(cfg: StateConfig) -> MambaSpec:
        N, H, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        return MambaSpec(shapes=((N, H, H), (CONV - 1, D)), dtypes=("float32", "float32"))

    def __call__(self, x, ctx: StepContext, kv_caches):
        md = ctx.attn[ctx.group]
        S0, W0 = ctx.load_state(kv_caches)  # [R, N, H, H], [R, J - 1, D]
        live, row = md.token_row >= 0, jnp.maximum(md.token_row, 0)  # [T]
        w, g = self.conv[...], self.decay[...]  # [J, D], [N]

        def conv_step(W, inp):  # W [R, J - 1, D]: each row's last inputs
            h, r, ok = inp
            taps = jnp.concatenate([W[r], h[None]])  # [J, D]
            W = W.at[r].set(jnp.where(ok, taps[1:], W[r]))
            return W, jnp.einsum("JD,JD->D", taps, w)

        W, c = jax.lax.scan(conv_step, W0, (x.astype(jnp.float32), row, live))  # c [T, D]
        c = c.astype(x.dtype)
        f32 = jnp.float32
        q, k, v = (p(c, ctx).astype(f32) for p in (self.q_proj, self.k_proj, self.v_proj))

        def recur_step(S, inp):  # S [R, N, H, H]
            qt, kt, vt, r, ok = inp  # [N, H] each
            s = g[:, None, None] * S[r] + jnp.einsum("NK,NV->NKV", kt, vt)
            S = S.at[r].set(jnp.where(ok, s, S[r]))
            return S, jnp.einsum("NK,NKV->NV", qt, s) * self.scale

        S, o = jax.lax.scan(recur_step, S0, (q, k, v, row, live))  # o [T, N, H]
        kv_caches = ctx.store_state(kv_caches, (S, W))
        return self.o_proj(o.astype(x.dtype), ctx), kv_caches


class StateLayer(DecoderLayer):
    def __init__(self, cfg: StateConfig, dtype, rngs: nnx.Rngs, kind=None):
        if kind == LINEAR:
            attention = LinearAttention(cfg, dtype, rngs)
        else:
            attention = Attention(cfg, dtype, rngs, rope=cfg.rope)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class StateForCausalLM(LlamaForCausalLM):
    layer_cls = StateLayer

    @classmethod
    def attention_kind(cls, cfg: StateConfig, kind):
        return LinearAttention.spec(cfg) if kind == LINEAR else None


def layer_weights(cfg: StateConfig) -> dict:
    state = {"self_attn.conv": None, "self_attn.decay": None}
    return attention_weights() | state | mlp_weights() | LAYER_NORMS


ARCHITECTURES = {
    "StateForCausalLM": Architecture(
        name="StateForCausalLM",
        config=StateConfig.from_hf,
        module=StateForCausalLM,
        layer_weights=layer_weights,
        top_weights=TOP_WEIGHTS,
    )
}


def register() -> None:
    transformers.AutoConfig.register(MODEL_TYPE, StateHFConfig, exist_ok=True)
    registry.register(MODEL_TYPE, __name__, "StateForCausalLM")


def save_state_model(path: pathlib.Path, tokenizer_dir: str) -> str:
    """The checkpoint at `path`: 4 layers of LAYER_TYPES; conv taps around 1/2 and decays
    drawn in (0.5, 0.95)."""
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=4,
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
    for i, kind in enumerate(LAYER_TYPES):
        if kind == LINEAR:
            conv = rng.normal(0.5, 0.3, (CONV, config.hidden_size)).astype(np.float32)
            decay = rng.uniform(0.5, 0.95, config.num_attention_heads).astype(np.float32)
            tensors[f"model.layers.{i}.self_attn.conv"] = conv
            tensors[f"model.layers.{i}.self_attn.decay"] = decay
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg |= {
        "model_type": MODEL_TYPE,
        "architectures": ["StateForCausalLM"],
        "layer_types": list(LAYER_TYPES),
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


def _linear_attention(h, w, p, N, H):
    """The toy linear attention over one whole sequence h [T, D], from zero state."""
    T, D = h.shape
    padded = np.concatenate([np.zeros((CONV - 1, D)), h])
    c = sum(padded[j : j + T] * w[p + "self_attn.conv"][j] for j in range(CONV))  # [T, D]
    q, k, v = ((c @ w[p + f"self_attn.{n}_proj.weight"].T).reshape(T, N, H) for n in "qkv")
    g = w[p + "self_attn.decay"]
    S, out = np.zeros((N, H, H)), np.zeros((T, N, H))
    for t in range(T):
        S = g[:, None, None] * S + np.einsum("nk,nv->nkv", k[t], v[t])
        out[t] = np.einsum("nk,nkv->nv", q[t], S) * H**-0.5
    return out.reshape(T, N * H)


def _attention(h, w, p, N, H, theta):
    T = h.shape[0]
    pos = np.arange(T, dtype=np.float64)
    q, k, v = ((h @ w[p + f"self_attn.{n}_proj.weight"].T).reshape(T, N, H) for n in "qkv")
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    scores = np.einsum("qnh,knh->nqk", q, k) * H**-0.5
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("nqk,knh->qnh", probs, v).reshape(T, N * H)


def reference_logits(path: str, tokens: list[int], layer_types=None) -> np.ndarray:
    """[T, V] float64 logits of the model over `tokens`, from scratch; with other
    `layer_types`, for the test that shows the linear layers matter."""
    cfg = json.loads((pathlib.Path(path) / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(f"{path}/model.safetensors").items()}
    N = cfg["num_attention_heads"]
    H = cfg["hidden_size"] // N
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    x = w["model.embed_tokens.weight"][tokens]
    for i, kind in enumerate(layer_types or cfg["layer_types"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        if kind == LINEAR:
            o = _linear_attention(h, w, p, N, H)
        else:
            o = _attention(h, w, p, N, H, theta)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ w["model.embed_tokens.weight"].T

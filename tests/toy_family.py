"""A test family on the model seams: Llama's layer with the attention kinds no served family
of this wave's start had, chunked local attention and attention sinks, beside sliding and
full layers; registered out of tree (`registry.register`), and its numpy oracle.

The checkpoint is a tiny random transformers Llama of 4 layers whose config names this
family (`model_type` "jllm_toy") with `layer_types` of "chunked_attention",
"sliding_attention" and "full_attention", an `attention_chunk_size` and a `sliding_window`,
plus one `self_attn.sinks` [N] tensor per layer. The oracle (`reference_logits`) reads the
safetensors file itself and runs dense float64 attention with the masks and sinks written
out here, so it shares no code with the engine's paged path.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

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
from jllm.models.llama import LlamaForCausalLM

MODEL_TYPE = "jllm_toy"
LAYER_TYPES = ("chunked_attention", "sliding_attention", "full_attention", "chunked_attention")


class ToyHFConfig(transformers.LlamaConfig):
    model_type = MODEL_TYPE


@dataclass(frozen=True, kw_only=True)
class ToyConfig(DecoderConfig):
    attention_chunk_size: int

    @classmethod
    def from_hf(cls, hf) -> ToyConfig:
        fields = DecoderConfig.fields_of(hf, windows=False)
        return cls(
            **fields,
            sliding_window=hf.sliding_window,
            layer_types=tuple(hf.layer_types),
            attention_chunk_size=hf.attention_chunk_size,
        )


class ToyLayer(DecoderLayer):
    def __init__(self, cfg: ToyConfig, dtype, rngs: nnx.Rngs, kind=None):
        attention = Attention(
            cfg,
            dtype,
            rngs,
            rope=cfg.rope,
            window=cfg.sliding_window if kind == "sliding_attention" else None,
            chunk_size=cfg.attention_chunk_size if kind == "chunked_attention" else None,
            sinks=True,
        )
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)
        super().__init__(cfg, dtype, attention=attention, mlp=mlp)


class ToyForCausalLM(LlamaForCausalLM):
    layer_cls = ToyLayer


def layer_weights(cfg: ToyConfig) -> dict:
    return attention_weights() | {"self_attn.sinks": None} | mlp_weights() | LAYER_NORMS


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


def save_toy(path: pathlib.Path, tokenizer_dir: str, *, chunk: int, window: int) -> str:
    """The toy checkpoint at `path`: 4 layers of LAYER_TYPES, sinks drawn around 0."""
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
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
    for i in range(len(LAYER_TYPES)):
        sinks = rng.normal(0.0, 1.0, config.num_attention_heads).astype(np.float32)
        tensors[f"model.layers.{i}.self_attn.sinks"] = sinks
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg |= {
        "model_type": MODEL_TYPE,
        "architectures": ["ToyForCausalLM"],
        "layer_types": list(LAYER_TYPES),
        "attention_chunk_size": chunk,
        "sliding_window": window,
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

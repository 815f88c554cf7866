"""Qwen3-VL: Qwen2.5-VL's images at their own size (models/qwen2_5_vl.py: the packing, the 2-D
rotary positions, the patch merger's 2x2 squares) with 16-pixel patches, a learned grid of
positions resampled to each image (bilinear, taps computed on the host), LayerNorm blocks
attending to the whole image in every layer, and DeepStack: the features of
`deepstack_visual_indexes` layers, merged each by its own merger, added to the hidden states
of the first decoder layers at the image's tokens (`StepContext.deep_embeds`,
models/decoder.py). The language model is Qwen3's (or Qwen3-MoE's) with interleaved M-RoPE.

An image token's row in the encoder cache holds its embedding and its DeepStack features
side by side ([D * (1 + len(deepstack))]); the step splits them.

Glossary: B patches (a bucket), E vision width, F its MLP width, U merged tokens, D the
language model's width, Ld DeepStack layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.models.qwen2_5_vl import (
    QwenVisionConfig,
    QwenVisionLanguageModel,
    VisionAttention,
    axial_rope,
    rename_from,
    tower_fields,
)
from jllm.models.vision import Dense, LayerNorm, VisionFamily, vision_activation


def qwen3_vision_config(hf) -> QwenVisionConfig:
    v = hf.vision_config
    side = math.isqrt(v.num_position_embeddings)
    if side * side != v.num_position_embeddings:
        raise ValueError(f"num_position_embeddings {v.num_position_embeddings} is not a square.")
    return QwenVisionConfig(
        **tower_fields(hf),
        window_size=0,
        full_layers=tuple(range(v.depth)),
        position_side=side,
        deepstack=tuple(v.deepstack_visual_indexes),
    )


class VisionBlock(nnx.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype, rngs):
        E, F = cfg.hidden_size, cfg.intermediate_size
        self.norm1 = LayerNorm(E, 1e-6, dtype)
        self.attn = VisionAttention(cfg, dtype, rngs)
        self.norm2 = LayerNorm(E, 1e-6, dtype)
        self.mlp = VisionMLP(E, F, cfg.hidden_act, dtype, rngs)

    def __call__(self, x, hw, seg, rope):
        x = x + self.attn(self.norm1(x), hw, seg, rope)
        return x + self.mlp(self.norm2(x))


class VisionMLP(nnx.Module):
    def __init__(self, E: int, F: int, act: str, dtype, rngs):
        self.linear_fc1, self.linear_fc2 = Dense(E, F, dtype, rngs), Dense(F, E, dtype, rngs)
        self.act = act

    def __call__(self, x):
        return self.linear_fc2(vision_activation(self.act)(self.linear_fc1(x)))


class PatchMerger(nnx.Module):
    """LayerNorm over a patch (the final merger) or over the merged square (DeepStack's
    `use_postshuffle_norm`), then linear-GELU-linear."""

    def __init__(self, cfg: QwenVisionConfig, dtype, rngs, after_shuffle: bool):
        E, W = cfg.hidden_size, cfg.hidden_size * cfg.unit
        self.norm = LayerNorm(W if after_shuffle else E, 1e-6, dtype)
        self.linear_fc1 = Dense(W, W, dtype, rngs)
        self.linear_fc2 = Dense(W, cfg.text_hidden_size, dtype, rngs)
        self.width, self.after_shuffle = W, after_shuffle

    def __call__(self, x):  # [B, E] -> [U, D]
        if self.after_shuffle:
            x = self.norm(x.reshape(-1, self.width))
        else:
            x = self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class PositionGrid(nnx.Module):
    """The learned square grid of positions (transformers' nn.Embedding `pos_embed`)."""

    def __init__(self, n: int, E: int, dtype):
        self.weight = nnx.Param(
            jnp.zeros((n, E), dtype), logical_axes=(None, "vision_out"), vision=True
        )


class VisionTower(nnx.Module):
    """[B, K] packed patches -> [U, D * (1 + Ld)]: the merged tokens, then each DeepStack
    layer's merged features."""

    def __init__(self, cfg: QwenVisionConfig, dtype, rngs):
        self.cfg = cfg
        self.patch_embed = Dense(cfg.patch_pixels, cfg.hidden_size, dtype, rngs)
        self.pos_embed = PositionGrid(cfg.position_side**2, cfg.hidden_size, dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def stack(rngs: nnx.Rngs):
            return VisionBlock(cfg, dtype, rngs)

        self.blocks = stack(rngs)
        self.merger = PatchMerger(cfg, dtype, rngs, after_shuffle=False)
        for k in range(len(cfg.deepstack)):
            setattr(self, f"deepstack_{k}", PatchMerger(cfg, dtype, rngs, after_shuffle=True))

    def __call__(self, inputs: dict):
        cfg = self.cfg
        hw, seg = inputs["hw"], inputs["image"]
        x = self.patch_embed(inputs["patches"].astype(self.patch_embed.weight.dtype))
        table = self.pos_embed.weight[...]
        pos = jnp.einsum("BkE,Bk->BE", table[inputs["taps"]], inputs["tap_weights"].astype(x.dtype))
        x = x + pos.astype(x.dtype)
        graphdef, state = nnx.split(self.blocks)
        rope = axial_rope(cfg)
        taken = jnp.asarray(cfg.deepstack, jnp.int32)

        def body(carry, layer):
            x, deep = carry  # deep [Ld, B, E]: the DeepStack layers' outputs so far
            layer_state, i = layer
            x = nnx.merge(graphdef, layer_state)(x, hw, seg, rope)
            deep = jnp.where((taken == i)[:, None, None], x[None], deep)
            return (x, deep), None

        deep = jnp.zeros((len(cfg.deepstack), *x.shape), x.dtype)
        layers = jnp.arange(cfg.num_layers)
        (x, deep), _ = jax.lax.scan(body, (x, deep), (state, layers))
        features = [self.merger(x)]
        for k in range(len(cfg.deepstack)):
            features.append(getattr(self, f"deepstack_{k}")(deep[k]))
        return jnp.concatenate(features, axis=-1)


class Qwen3VisionLanguageModel(QwenVisionLanguageModel):
    def init_vision(self, cfg: QwenVisionConfig, dtype, rngs):
        self.visual = VisionTower(cfg, dtype, rngs)


def _rename(name: str) -> str | None:
    name = rename_from(name)
    prefix = "visual.deepstack_merger_list."
    if name.startswith(prefix):
        k, rest = name[len(prefix) :].split(".", 1)
        name = f"visual.deepstack_{k}.{rest}"
    return name


def _family(name: str) -> VisionFamily:
    return VisionFamily(
        name=name,
        vision_config=qwen3_vision_config,
        projector=None,
        mixin=Qwen3VisionLanguageModel,
        rename=_rename,
    )


ARCHITECTURES = {
    name: _family(name)
    for name in ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
}

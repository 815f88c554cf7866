"""Gemma 3's vision-language model: SigLIP's vision tower (models/vision.py), its projector
(the patch grid average-pooled, Gemma's RMSNorm, a product), and Gemma 3's text model
(models/gemma.py) as its language model; an image's tokens attend to each other in both
directions.

Glossary: N images, P patches, E vision width, D the language model's width.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from jllm.models.layers import RMSNorm
from jllm.models.vision import VisionConfig, VisionFamily, image_token_id, vision_fields


def gemma3_vision_config(hf) -> VisionConfig:
    """Gemma 3's: SigLIP's last hidden state, average-pooled to `mm_tokens_per_image`, the
    image's tokens attending to each other in both directions."""
    v = hf.vision_config
    return VisionConfig(
        **vision_fields(v),
        num_layers=v.num_hidden_layers,
        class_token=False,
        post_norm=True,
        drop_class=False,
        projector_act="",
        projector_bias=False,
        text_hidden_size=hf.text_config.hidden_size,
        image_token_id=image_token_id(hf),
        tokens_per_image=int(hf.mm_tokens_per_image),
        bidirectional=True,
        text_eps=hf.text_config.rms_norm_eps,
    )


class Gemma3Projector(nnx.Module):
    """The patch grid average-pooled to `tokens_per_image` (a square), Gemma's RMSNorm, then
    a product with `mm_input_projection_weight` [E, D]."""

    def __init__(self, cfg: VisionConfig, dtype, rngs):
        E, D = cfg.hidden_size, cfg.text_hidden_size
        self.side = cfg.image_size // cfg.patch_size
        self.tokens_side = math.isqrt(cfg.tokens_per_image)
        if self.tokens_side**2 != cfg.tokens_per_image or self.side % self.tokens_side:
            raise ValueError(
                f"mm_tokens_per_image {cfg.tokens_per_image} does not pool a {self.side}x"
                f"{self.side} patch grid."
            )
        self.mm_soft_emb_norm = RMSNorm(E, cfg.text_eps, dtype, unit_offset=True)
        self.mm_input_projection_weight = nnx.Param(
            jnp.zeros((E, D), dtype), logical_axes=("vision_in", "vision_out"), vision=True
        )

    def __call__(self, x):  # [N, P, E] -> [N, tokens, D]
        N, _, E = x.shape
        s, t = self.side, self.tokens_side
        k = s // t
        grid = x.reshape(N, t, k, t, k, E).astype(jnp.float32).mean(axis=(2, 4))
        pooled = self.mm_soft_emb_norm(grid.reshape(N, t * t, E).astype(x.dtype))
        return pooled @ self.mm_input_projection_weight[...]


ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": VisionFamily(
        name="Gemma3ForConditionalGeneration",
        vision_config=gemma3_vision_config,
        projector=Gemma3Projector,
    )
}

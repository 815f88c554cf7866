"""LLaVA-1.5: CLIP's vision tower (models/vision.py), a two-layer MLP projector, and any
text family as its language model (the config's `text_config`; Llama's in the hub's
checkpoints).

Glossary: N images, P patches, E vision width, D the language model's width.
"""

from __future__ import annotations

from flax import nnx

from jllm.models.vision import (
    Dense,
    VisionConfig,
    VisionFamily,
    image_token_id,
    vision_activation,
    vision_fields,
)


def llava_vision_config(hf) -> VisionConfig:
    """LLaVA-1.5's: CLIP's features at `vision_feature_layer` (the hidden states after that
    many layers; -2: all but the last), the class token dropped ("default") or kept ("full"),
    then linear-GELU-linear."""
    v = hf.vision_config
    layer = hf.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"LLaVA with several vision feature layers {layer} is not supported.")
    strategy = hf.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported.")
    used = layer if layer >= 0 else v.num_hidden_layers + 1 + layer
    patches = (v.image_size // v.patch_size) ** 2
    return VisionConfig(
        **vision_fields(v),
        num_layers=used,
        class_token=True,
        post_norm=False,
        drop_class=strategy == "default",
        projector_act=hf.projector_hidden_act,
        projector_bias=bool(getattr(hf, "multimodal_projector_bias", True)),
        text_hidden_size=hf.text_config.hidden_size,
        image_token_id=image_token_id(hf),
        tokens_per_image=patches + (strategy == "full"),
        bidirectional=False,
    )


class LlavaProjector(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, rngs):
        E, D, b = cfg.hidden_size, cfg.text_hidden_size, cfg.projector_bias
        self.linear_1, self.linear_2 = Dense(E, D, dtype, rngs, b), Dense(D, D, dtype, rngs, b)
        self.act = cfg.projector_act

    def __call__(self, x):  # [N, P, E] -> [N, P, D]
        return self.linear_2(vision_activation(self.act)(self.linear_1(x)))


ARCHITECTURES = {
    "LlavaForConditionalGeneration": VisionFamily(
        name="LlavaForConditionalGeneration",
        vision_config=llava_vision_config,
        projector=LlavaProjector,
    )
}

"""Image inputs: the vision encoder the vision-language families share (CLIP's and SigLIP's
ViT), and the vision-language model built from a text family, the encoder and a family's
projector, which maps the encoder's features into the language model's embedding space
(LLaVA's two-layer MLP in models/llava.py, Gemma 3's average-pooled RMSNorm projection in
models/gemma3_mm.py). A family file declares a `VisionFamily`; its language model is the
text family its config's `text_config` names (models/registry.py composes them).

An image arrives as the model's Hugging Face processor prepared it (`pixel_values`
[C, H, W]) and leaves the encoder as `tokens_per_image` embeddings [P, D] of the language
model, which the step writes over the image's placeholder tokens (`StepContext.embeds`,
`models/decoder.py`). The encoder is its own executable (`runner/encoder.py`), run before
the step that first reads its output; the language model never sees pixels.

The encoder's weights carry the "vision" logical axes, which `sharding/` replicates: under
tensor parallelism every device runs the whole (small) tower, and its output is replicated
like the token embeddings it replaces.

Glossary: N images, C channels, P patches (tokens), E vision width, F its MLP width, A
heads, D the language model's width.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from functools import cache, partial

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.models.architecture import Architecture
from jllm.models.layers import activation, param

ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP's
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),  # SigLIP's
    "silu": jax.nn.silu,  # Qwen2.5-VL's
}


def vision_activation(name: str):
    return activation(name, ACTIVATIONS, "Vision")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A ViT (CLIP's or SigLIP's) and the projector after it, and how the language model
    takes its output: `image_token_id` placeholders, `tokens_per_image` of them per image,
    attending to each other in both directions (`bidirectional`, Gemma 3) or causally."""

    hidden_size: int
    intermediate_size: int
    num_layers: int  # the layers run: LLaVA stops at its feature layer
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    class_token: bool  # CLIP: a class embedding before the patches, and pre_layrnorm
    post_norm: bool  # SigLIP: post_layernorm on the last layer's output
    drop_class: bool  # LLaVA's "default" feature strategy drops the class token
    projector_act: str  # LLaVA's projector (models/llava.py)
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    tokens_per_image: int
    bidirectional: bool
    text_eps: float = 1e-6  # Gemma 3's projector norm

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def vision_fields(hf, **kw) -> dict:
    """The ViT fields every vision config reads (CLIP's and SigLIP's)."""
    return dict(
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_heads=hf.num_attention_heads,
        image_size=hf.image_size,
        patch_size=hf.patch_size,
        num_channels=getattr(hf, "num_channels", 3),
        layer_norm_eps=hf.layer_norm_eps,
        hidden_act=hf.hidden_act,
        **kw,
    )


def image_token_id(hf) -> int:
    value = getattr(hf, "image_token_id", None)
    return int(value if value is not None else hf.image_token_index)


def _dense(rngs, fan_in: int, fan_out: int, dtype, axes=("vision_in", "vision_out")):
    """A vision Linear's weight [in, out] and bias [out] (transformers' nn.Linear)."""
    w = param(rngs, (fan_in, fan_out), axes, dtype, contract=1, vision=True)
    b = nnx.Param(jnp.zeros((fan_out,), dtype), logical_axes=axes[1:], vision=True)
    return w, b


class Dense(nnx.Module):
    def __init__(self, fan_in: int, fan_out: int, dtype, rngs, bias: bool = True):
        self.weight, bias_param = _dense(rngs, fan_in, fan_out, dtype)
        self.bias = bias_param if bias else None

    def __call__(self, x):
        y = x @ self.weight[...]
        return y if self.bias is None else y + self.bias[...]


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), logical_axes=("norm",), vision=True)
        self.bias = nnx.Param(jnp.zeros((dim,), dtype), logical_axes=("norm",), vision=True)
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.weight[...] + self.bias[...]).astype(x.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, rngs):
        E = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_proj, self.k_proj = Dense(E, E, dtype, rngs), Dense(E, E, dtype, rngs)
        self.v_proj, self.out_proj = Dense(E, E, dtype, rngs), Dense(E, E, dtype, rngs)

    def __call__(self, x):  # [N, P, E]
        N, P, E = x.shape
        A = self.num_heads

        def heads(y):
            return y.reshape(N, P, A, E // A)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        s = jnp.einsum("NPAH,NQAH->NAPQ", q, k, preferred_element_type=jnp.float32)
        p = jax.nn.softmax(s * (E // A) ** -0.5, axis=-1).astype(v.dtype)
        o = jnp.einsum("NAPQ,NQAH->NPAH", p, v)
        return self.out_proj(o.reshape(N, P, E))


class VisionLayer(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, rngs):
        E, F, eps = cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps
        self.layer_norm1 = LayerNorm(E, eps, dtype)
        self.self_attn = VisionAttention(cfg, dtype, rngs)
        self.layer_norm2 = LayerNorm(E, eps, dtype)
        self.mlp = VisionMLP(E, F, cfg.hidden_act, dtype, rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionMLP(nnx.Module):
    def __init__(self, E: int, F: int, act: str, dtype, rngs):
        self.fc1, self.fc2 = Dense(E, F, dtype, rngs), Dense(F, E, dtype, rngs)
        self.act = act

    def __call__(self, x):
        return self.fc2(vision_activation(self.act)(self.fc1(x)))


class Embeddings(nnx.Module):
    """Patches (transformers' Conv2d of stride = kernel, as a product over each patch's
    C*p*p pixels), the class token (CLIP) and learned positions."""

    def __init__(self, cfg: VisionConfig, dtype, rngs):
        E, p, C = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        self.patch_size = p
        self.patch_embedding = Dense(C * p * p, E, dtype, rngs, bias=not cfg.class_token)
        self.position_embedding = PositionTable(cfg.patches + cfg.class_token, E, dtype)
        if cfg.class_token:
            self.class_embedding = nnx.Param(
                jnp.zeros((E,), dtype), logical_axes=("vision_out",), vision=True
            )

    def __call__(self, pixels):  # [N, C, H, W] -> [N, P, E]
        N, C, H, W = pixels.shape
        p = self.patch_size
        patches = pixels.reshape(N, C, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)
        x = self.patch_embedding(patches.reshape(N, (H // p) * (W // p), C * p * p))
        if hasattr(self, "class_embedding"):
            cls = jnp.broadcast_to(self.class_embedding[...], (N, 1, x.shape[-1]))
            x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
        return x + self.position_embedding.weight[...]


class PositionTable(nnx.Module):
    """transformers' nn.Embedding of the positions: its `weight` [P, E]."""

    def __init__(self, positions: int, E: int, dtype):
        self.weight = nnx.Param(
            jnp.zeros((positions, E), dtype), logical_axes=(None, "vision_out"), vision=True
        )


class VisionTower(nnx.Module):
    """CLIP's or SigLIP's ViT: [N, C, H, W] pixels -> [N, P, E] features of its last run
    layer (after SigLIP's post_layernorm)."""

    def __init__(self, cfg: VisionConfig, dtype, rngs):
        self.embeddings = Embeddings(cfg, dtype, rngs)
        if cfg.class_token:
            self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def stack(rngs: nnx.Rngs):
            return VisionLayer(cfg, dtype, rngs)

        self.encoder = Encoder(stack(rngs))
        if cfg.post_norm:
            self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def __call__(self, pixels):
        x = self.embeddings(pixels)
        if hasattr(self, "pre_layrnorm"):
            x = self.pre_layrnorm(x)
        graphdef, state = nnx.split(self.encoder.layers)

        def body(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x), None

        x, _ = jax.lax.scan(body, x, state)
        if hasattr(self, "post_layernorm"):
            x = self.post_layernorm(x)
        return x


class Encoder(nnx.Module):
    """Holds the stacked layers at transformers' `encoder.layers`."""

    def __init__(self, layers):
        self.layers = layers


class VisionLanguageModel:
    """Mixed into a text family's CausalLM (`vision_model(LlamaForCausalLM)`): the encoder
    and projector beside its decoder, at transformers' names (`vision_tower`,
    `multi_modal_projector`), and `encode_images`."""

    projector_cls: type  # the family's projector (models/llava.py, models/gemma3_mm.py)

    def init_vision(self, cfg: VisionConfig, dtype, rngs):
        self.vision_tower = VisionTower(cfg, dtype, rngs)
        self.multi_modal_projector = self.projector_cls(cfg, dtype, rngs)

    def encode_images(self, pixels):
        """[N, C, H, W] pixels -> [N, tokens_per_image, D] embeddings, in the model's
        dtype."""
        cfg = self.cfg.vision
        features = self.vision_tower(pixels.astype(self.dtype))
        if cfg.drop_class:
            features = features[:, 1:]
        return self.multi_modal_projector(features).astype(self.dtype)


@cache
def vision_model(text_cls: type, projector_cls: type | None, mixin: type) -> type:
    """The vision-language model class of a text family's CausalLM, a vision mixin (its
    `init_vision`: `VisionLanguageModel`'s ViT and `projector_cls`, or a family's own)."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        text_cls.__init__(self, cfg, dtype, rngs)
        self.init_vision(cfg.vision, dtype, rngs)

    parts = projector_cls or mixin
    return type(
        f"{text_cls.__name__}With{parts.__name__}",
        (mixin, text_cls),
        {"__init__": __init__, "__module__": __name__, "projector_cls": projector_cls},
    )


_PREFIXES = (
    ("model.language_model.", "model."),  # transformers >= 4.52's layout
    ("language_model.model.", "model."),  # the hub's LLaVA-1.5 and Gemma 3 checkpoints
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_TOWER_LAYER = re.compile(r"vision_tower\.encoder\.layers\.(\d+)\..+")


def vision_rename(vision: VisionConfig):
    """A vision-language checkpoint's names -> the text family's and the vision modules'
    (`vision_tower.vision_model.X` -> `vision_tower.X`); None for what the model does not run:
    SigLIP's pooling head, CLIP's post_layernorm, and the layers past LLaVA's feature layer."""

    def rename(name: str) -> str | None:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if name.startswith("vision_tower.vision_model."):
            name = "vision_tower." + name[len("vision_tower.vision_model.") :]
        if name.startswith("vision_tower.head."):
            return None
        if name.startswith("vision_tower.post_layernorm.") and not vision.post_norm:
            return None
        m = _TOWER_LAYER.fullmatch(name)
        if m and int(m.group(1)) >= vision.num_layers:
            return None
        return name

    return rename


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionFamily:
    """A vision-language family (a family file's entry): its transformers class name, its
    vision config builder (the transformers config -> VisionConfig) and its projector, or
    its own vision mixin and checkpoint renaming (Qwen-VL: models/qwen2_5_vl.py). Its
    language model is whatever text family the config's `text_config` names."""

    name: str
    vision_config: Callable[[object], object]
    projector: type | None
    mixin: type = VisionLanguageModel
    rename: Callable[[str], str | None] | None = None

    def architecture(self, hf_config, text: Architecture) -> Architecture:
        """The text architecture `text` with this encoder and projector beside it."""

        def config(hf):
            cfg = text.config(hf.text_config)
            # transformers ties the LM head by the top-level config's flag, not the text's.
            tied = bool(getattr(hf, "tie_word_embeddings", cfg.tie_word_embeddings))
            return dataclasses.replace(cfg, vision=self.vision_config(hf), tie_word_embeddings=tied)

        return dataclasses.replace(
            text,
            name=self.name,
            config=config,
            module=vision_model(text.module, self.projector, self.mixin),
            rename=self.rename or vision_rename(self.vision_config(hf_config)),
        )

"""Image inputs: the vision encoders (CLIP's and SigLIP's ViT), the projectors that map their
features into the language model's embedding space (LLaVA's two-layer MLP, Gemma 3's
average-pooled RMSNorm projection), and the vision-language models built from a text family
plus both.

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
import math
from functools import cache, partial

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.models.layers import RMSNorm, activation, param

ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP's
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),  # SigLIP's
}


def _activation(name: str):
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
    projector: str  # "llava" (linear-act-linear) or "gemma3" (pool, norm, projection)
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    tokens_per_image: int
    bidirectional: bool
    text_eps: float = 1e-6  # Gemma 3's projector norm

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _vision(hf, **kw) -> dict:
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
        **_vision(v),
        num_layers=used,
        class_token=True,
        post_norm=False,
        drop_class=strategy == "default",
        projector="llava",
        projector_act=hf.projector_hidden_act,
        projector_bias=bool(getattr(hf, "multimodal_projector_bias", True)),
        text_hidden_size=hf.text_config.hidden_size,
        image_token_id=image_token_id(hf),
        tokens_per_image=patches + (strategy == "full"),
        bidirectional=False,
    )


def gemma3_vision_config(hf) -> VisionConfig:
    """Gemma 3's: SigLIP's last hidden state, average-pooled to `mm_tokens_per_image`, the
    image's tokens attending to each other in both directions."""
    v = hf.vision_config
    return VisionConfig(
        **_vision(v),
        num_layers=v.num_hidden_layers,
        class_token=False,
        post_norm=True,
        drop_class=False,
        projector="gemma3",
        projector_act="",
        projector_bias=False,
        text_hidden_size=hf.text_config.hidden_size,
        image_token_id=image_token_id(hf),
        tokens_per_image=int(hf.mm_tokens_per_image),
        bidirectional=True,
        text_eps=hf.text_config.rms_norm_eps,
    )


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
        return self.fc2(_activation(self.act)(self.fc1(x)))


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


class LlavaProjector(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, rngs):
        E, D, b = cfg.hidden_size, cfg.text_hidden_size, cfg.projector_bias
        self.linear_1, self.linear_2 = Dense(E, D, dtype, rngs, b), Dense(D, D, dtype, rngs, b)
        self.act = cfg.projector_act

    def __call__(self, x):  # [N, P, E] -> [N, P, D]
        return self.linear_2(_activation(self.act)(self.linear_1(x)))


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


class VisionLanguageModel:
    """Mixed into a text family's CausalLM (`vision_model(LlamaForCausalLM)`): the encoder
    and projector beside its decoder, at transformers' names (`vision_tower`,
    `multi_modal_projector`), and `encode_images`."""

    def init_vision(self, cfg: VisionConfig, dtype, rngs):
        self.vision_tower = VisionTower(cfg, dtype, rngs)
        projector = LlavaProjector if cfg.projector == "llava" else Gemma3Projector
        self.multi_modal_projector = projector(cfg, dtype, rngs)

    def encode_images(self, pixels):
        """[N, C, H, W] pixels -> [N, tokens_per_image, D] embeddings, in the model's
        dtype."""
        cfg = self.cfg.vision
        features = self.vision_tower(pixels.astype(self.dtype))
        if cfg.drop_class:
            features = features[:, 1:]
        return self.multi_modal_projector(features).astype(self.dtype)


@cache
def vision_model(text_cls: type) -> type:
    """The vision-language model class of a text family's CausalLM."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        text_cls.__init__(self, cfg, dtype, rngs)
        self.init_vision(cfg.vision, dtype, rngs)

    return type(
        f"{text_cls.__name__}WithVision",
        (VisionLanguageModel, text_cls),
        {"__init__": __init__, "__module__": __name__},
    )

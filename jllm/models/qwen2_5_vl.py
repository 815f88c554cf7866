"""Qwen2.5-VL: images cut at their own resolution into 14x14 patches (two frames of one image:
`temporal_patch_size`), a ViT with 2-D rotary positions whose layers attend within 112-pixel
windows but for the full-attention layers (`fullatt_block_indexes`), the patch merger (each
2x2 square of patches one token), and Qwen2's text model with M-RoPE (models/rope.py,
jllm/mrope.py) as its language model.

An image's patches arrive as its processor prepared them ([patches, C*t*p*p], each merge
square's four patches consecutive, squares row-major) with its (t, h, w) grid. The encoder
runs on buckets of patches holding several images (`pack` lays them out on the host): the
patches in window order, each patch's (row, column), each patch's window and image, and where
each merged token goes in the encoder cache. Attention is masked to the patch's window or
image, so images packed together never see each other, and padding sees only padding.

Glossary: B patches (a bucket), K a patch's pixels (C*t*p*p), E vision width, F its MLP
width, A heads, Hd head size, U merged tokens (B / 4), D the language model's width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.models.layers import RMSNorm
from jllm.models.rope import RopeConfig, apply_rope
from jllm.models.vision import Dense, VisionFamily, vision_activation

QUERY_BLOCK = 1024  # queries per block of whole-image attention: scores [A, 1024, B]
WINDOW_BLOCK = 128  # queries per block of window attention: scores [A, 128, 128 + 2 span]


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision tower, and how the engine feeds it (images of any size: the
    encoder cache in pages of `tokens_per_image` tokens, models/vision.py's name for it)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    num_channels: int
    merge: int  # spatial_merge_size
    window_size: int  # pixels
    full_layers: tuple[int, ...]  # fullatt_block_indexes
    hidden_act: str
    rope_theta: float
    text_hidden_size: int
    image_token_id: int
    tokens_per_image: int = 16  # the encoder cache's page
    bidirectional: bool = False
    variable: bool = True  # images at their own size
    # Qwen3-VL (models/qwen3_vl.py): the learned position grid's side (0: none) and the
    # layers whose features also go, merged, to the first decoder layers (DeepStack)
    position_side: int = 0
    deepstack: tuple[int, ...] = ()

    @property
    def embed_width(self) -> int:
        """An image token's row in the encoder cache: its embedding, then its DeepStack
        features for the first decoder layers."""
        return self.text_hidden_size * (1 + len(self.deepstack))

    @property
    def patch_pixels(self) -> int:  # K
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def unit(self) -> int:  # patches per merged token
        return self.merge**2

    @property
    def window_patches(self) -> int:
        """The most patches one window holds."""
        return (self.window_size // self.patch_size) ** 2

    def pack(self, images, B: int, page: int, pool_tokens: int) -> dict:
        """The encoder's inputs for `images` ((pages, patches [n, K], grid (t, h, w)) each)
        in a bucket of B patches: numpy arrays (module docstring)."""
        out = dict(
            patches=np.zeros((B, self.patch_pixels), np.float32),
            hw=np.zeros((2, B), np.int32),
            window=np.full(B, -1, np.int32),
            image=np.full(B, -1, np.int32),
            dest=np.full(B // self.unit, pool_tokens, np.int32),  # past the pool: dropped
        )
        if self.position_side:  # bilinear taps into the learned grid [B, 4]
            out["taps"] = np.zeros((B, 4), np.int32)
            out["tap_weights"] = np.zeros((B, 4), np.float32)
        at, windows = 0, 0
        for i, (pages, px, grid) in enumerate(images):
            order, seg, pos = self.layout(grid)
            n = len(order) * self.unit
            units = (order[:, None] * self.unit + np.arange(self.unit)).reshape(-1)
            out["patches"][at : at + n] = px[units]
            out["hw"][:, at : at + n] = pos[:, units]
            out["window"][at : at + n] = np.repeat(seg + windows, self.unit)
            out["image"][at : at + n] = i
            if self.position_side:
                taps, weights = self.position_taps(grid, pos)
                out["taps"][at : at + n], out["tap_weights"][at : at + n] = (
                    taps[units],
                    weights[units],
                )
            pages = np.asarray(pages, np.int32)
            u0 = at // self.unit
            out["dest"][u0 : u0 + len(order)] = pages[order // page] * page + order % page
            at, windows = at + n, windows + int(seg.max()) + 1
        return out

    def position_taps(self, grid, pos) -> tuple[np.ndarray, np.ndarray]:
        """Qwen3-VL: each patch's four taps into the learned square grid of positions and
        their weights, bilinear with aligned corners (transformers'
        `get_vision_interpolation_indices_and_weights`), from its (row, column) `pos`."""
        side = self.position_side
        _, h, w = (int(v) for v in grid)

        def axis(index, size):
            src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            floor = np.floor(src)
            taps = floor.astype(np.int64)[:, None] + np.arange(2)
            weights = np.maximum(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0)
            return np.clip(taps, 0, side - 1), weights.astype(np.float32)

        (ht, hw_), (wt, ww) = axis(pos[0], h), axis(pos[1], w)
        taps = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
        weights = (hw_[:, :, None] * ww[:, None, :]).reshape(-1, 4)
        return taps.astype(np.int32), weights

    def layout(self, grid) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(merged tokens in window order [U], each one's window [U], each patch's (row,
        column) [2, n] in the processor's order) of an image's grid (transformers'
        `get_vision_window_index` and `get_vision_position_ids`)."""
        t, h, w = (int(v) for v in grid)
        m = self.merge
        gh, gw = h // m, w // m
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (gh, m, gw, m)
        rows = rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        pos = np.tile(np.stack([rows, cols]), (1, t))
        if not self.window_size:  # every layer attends to the whole image (Qwen3-VL)
            return np.arange(t * gh * gw), np.zeros(t * gh * gw, np.int32), pos
        side = self.window_size // m // self.patch_size  # merged tokens per window side
        nh, nw = -(-gh // side), -(-gw // side)
        idx = np.arange(t * gh * gw).reshape(t, gh, gw)
        padded = np.full((t, nh * side, nw * side), -1)
        padded[:, :gh, :gw] = idx
        tiles = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4)
        tiles = tiles.reshape(t * nh * nw, side * side)
        seg = np.repeat(np.arange(len(tiles)), side * side).reshape(tiles.shape)
        keep = tiles >= 0
        order, seg = tiles[keep], seg[keep]
        _, seg = np.unique(seg, return_inverse=True)  # windows numbered without the empty
        return order, seg.astype(np.int32), pos


def tower_fields(hf) -> dict:
    """The fields every Qwen-VL tower's config reads from transformers'."""
    v = hf.vision_config
    params = dict(getattr(v, "rope_parameters", None) or {})
    return dict(
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_layers=v.depth,
        num_heads=v.num_heads,
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        num_channels=v.in_channels,
        merge=v.spatial_merge_size,
        hidden_act=v.hidden_act,
        rope_theta=float(params.get("rope_theta", 10000.0)),
        text_hidden_size=v.out_hidden_size,
        image_token_id=int(hf.image_token_id),
    )


def qwen2_5_vision_config(hf) -> QwenVisionConfig:
    v = hf.vision_config
    return QwenVisionConfig(
        **tower_fields(hf),
        window_size=v.window_size,
        full_layers=tuple(v.fullatt_block_indexes),
    )


def axial_rope(cfg: QwenVisionConfig) -> RopeConfig:
    """The tower's 2-D rotary: the head's first half of frequencies by row, then by column
    (a two-row M-RoPE over positions [2, B])."""
    Hd = cfg.hidden_size // cfg.num_heads
    half = Hd // 2
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, half, 2) / half)
    n = len(inv)
    return RopeConfig(tuple(map(float, [*inv, *inv])), mrope_rows=(0,) * n + (1,) * n)


def segment_attention(q, k, v, seg, span: int = 0):
    """softmax(q k^T / sqrt(Hd)) v over the keys of each query's segment: q, k, v [B, A, Hd],
    seg [B]; in blocks of queries. With `span` (the longest segment: a window's patches),
    a block of Q queries scores only the Q + 2 span keys around it, which hold every key of
    its segments (segments are contiguous); else every key of the bucket."""
    B, A, Hd = q.shape
    Q = min(B, WINDOW_BLOCK if span else QUERY_BLOCK)
    keys, kseg, width = k, seg, B
    if span:  # padded so each block's slice stays inside; padding keys match no segment
        keys = jnp.pad(k, ((span, span), (0, 0), (0, 0)))
        v = jnp.pad(v, ((span, span), (0, 0), (0, 0)))
        kseg = jnp.pad(seg, (span, span), constant_values=-2)
        width = Q + 2 * span

    def block(i):
        qb = jax.lax.dynamic_slice_in_dim(q, i * Q, Q)
        sb = jax.lax.dynamic_slice_in_dim(seg, i * Q, Q)
        at = i * Q if span else 0
        kb = jax.lax.dynamic_slice_in_dim(keys, at, width)
        vb = jax.lax.dynamic_slice_in_dim(v, at, width)
        skb = jax.lax.dynamic_slice_in_dim(kseg, at, width)
        s = jnp.einsum("QAH,KAH->AQK", qb, kb, preferred_element_type=jnp.float32)
        s = jnp.where((sb[:, None] == skb[None, :])[None], s * Hd**-0.5, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(vb.dtype)
        return jnp.einsum("AQK,KAH->QAH", p, vb)

    out = jax.lax.map(block, jnp.arange(B // Q))  # [B / Q, Q, A, Hd]
    return out.reshape(B, A, Hd)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype, rngs):
        E, F = cfg.hidden_size, cfg.intermediate_size
        self.norm1 = RMSNorm(E, 1e-6, dtype)
        self.attn = VisionAttention(cfg, dtype, rngs)
        self.norm2 = RMSNorm(E, 1e-6, dtype)
        self.mlp = VisionMLP(E, F, cfg.hidden_act, dtype, rngs)

    def __call__(self, x, hw, seg, rope, span: int = 0):
        x = x + self.attn(self.norm1(x), hw, seg, rope, span)
        return x + self.mlp(self.norm2(x))


class VisionAttention(nnx.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype, rngs):
        E = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.qkv = Dense(E, 3 * E, dtype, rngs)
        self.proj = Dense(E, E, dtype, rngs)

    def __call__(self, x, hw, seg, rope, span: int = 0):  # x [B, E]
        B, E = x.shape
        A = self.num_heads
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(B, 3, A, E // A), 1, 0)
        q, k = apply_rope(q, hw, rope), apply_rope(k, hw, rope)
        return self.proj(segment_attention(q, k, v, seg, span).reshape(B, E))


class VisionMLP(nnx.Module):
    """Qwen2.5-VL's gated MLP, with biases."""

    def __init__(self, E: int, F: int, act: str, dtype, rngs):
        self.gate_proj, self.up_proj = Dense(E, F, dtype, rngs), Dense(E, F, dtype, rngs)
        self.down_proj = Dense(F, E, dtype, rngs)
        self.act = act

    def __call__(self, x):
        return self.down_proj(vision_activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


class PatchMerger(nnx.Module):
    """RMSNorm, each merge square's patches side by side, then linear-GELU-linear."""

    def __init__(self, cfg: QwenVisionConfig, dtype, rngs):
        E, W = cfg.hidden_size, cfg.hidden_size * cfg.unit
        self.ln_q = RMSNorm(E, 1e-6, dtype)
        self.fc1 = Dense(W, W, dtype, rngs)
        self.fc2 = Dense(W, cfg.text_hidden_size, dtype, rngs)
        self.width = W

    def __call__(self, x):  # [B, E] -> [U, D]
        x = self.ln_q(x).reshape(-1, self.width)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionTower(nnx.Module):
    """[B, K] patches (packed by `QwenVisionConfig.pack`) -> [U, D] merged tokens."""

    def __init__(self, cfg: QwenVisionConfig, dtype, rngs):
        self.cfg = cfg
        self.patch_embed = Dense(cfg.patch_pixels, cfg.hidden_size, dtype, rngs, bias=False)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def stack(rngs: nnx.Rngs):
            return VisionBlock(cfg, dtype, rngs)

        self.blocks = stack(rngs)
        self.merger = PatchMerger(cfg, dtype, rngs)

    def __call__(self, inputs: dict):
        cfg = self.cfg
        hw, window, image = inputs["hw"], inputs["window"], inputs["image"]
        x = self.patch_embed(inputs["patches"].astype(self.patch_embed.weight.dtype))
        full = np.zeros(cfg.num_layers, bool)
        full[list(cfg.full_layers)] = True
        graphdef, state = nnx.split(self.blocks)
        rope = axial_rope(cfg)

        span = cfg.window_patches

        def body(x, layer):
            layer_state, is_full = layer
            block = nnx.merge(graphdef, layer_state)
            x = jax.lax.cond(
                is_full,
                lambda x: block(x, hw, image, rope),
                lambda x: block(x, hw, window, rope, span),
                x,
            )
            return x, None

        x, _ = jax.lax.scan(body, x, (state, jnp.asarray(full)))
        return self.merger(x)


class QwenVisionLanguageModel:
    """Mixed into Qwen2's CausalLM: the vision tower at transformers' name (`visual`) and
    `encode_patches`."""

    def init_vision(self, cfg: QwenVisionConfig, dtype, rngs):
        self.visual = VisionTower(cfg, dtype, rngs)

    def encode_patches(self, inputs: dict):
        """Packed patches (`QwenVisionConfig.pack`'s arrays) -> [U, embed_width] merged tokens
        in the model's dtype, in window order (`pack`'s `dest` says where each goes)."""
        return self.visual(inputs).astype(self.dtype)


def rename_from(name: str) -> str:
    """A Qwen-VL checkpoint's names -> ours: the text model's at the text family's, the
    tower's at `visual.` (the patch embedding's Conv3d and the merger's MLP renamed)."""
    for old, new in (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
        ("visual.patch_embed.proj.", "visual.patch_embed."),
        ("visual.merger.mlp.0.", "visual.merger.fc1."),
        ("visual.merger.mlp.2.", "visual.merger.fc2."),
    ):
        if name.startswith(old):
            name = new + name[len(old) :]
    return name


ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": VisionFamily(
        name="Qwen2_5_VLForConditionalGeneration",
        vision_config=qwen2_5_vision_config,
        projector=None,
        mixin=QwenVisionLanguageModel,
        rename=rename_from,
    )
}

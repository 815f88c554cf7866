"""What a family file declares to the registry and the loaders: `Architecture` (its config
builder, its module, its weight map) and, where llama.cpp writes it, `GgufFamily`.

A weight map names every checkpoint tensor the module takes (transformers' names within a
layer, or at the top level) and how its layout converts to ours; a tensor that no entry names
and that is not a known leftover is an error that names it, never silently dropped (a
checkpoint with biases the module lacks must not load without them). Layouts: "qkv"
[N*H, D] -> [D, N, H]; "o" [D, N*H] -> [N, H, D]; "bias" [N*H] -> [N, H]; "heads"
[N*H, ...] -> [N, H, ...]; "t" [out, in] -> [in, out]; None as is. An entry may also be
(our name, layout) where our name differs, and one expert's tensor is named with `*` for its
index (`mlp.experts.*.gate_proj.weight`): the loader stacks the experts.

A checkpoint that fuses projections (Phi-3's `qkv_proj` and `gate_up_proj`) names each
fused tensor's parts (`fused_weights`): the loader splits it by rows into the projections the
module has, so that tensor parallelism shards each part as it shards Llama's.

The helpers below are the names of the shared blocks (`models/blocks.py`), which families
combine into their maps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import jax
import numpy as np

from jllm.quantization.weights import QuantizedWeight


@dataclass(frozen=True, kw_only=True)
class Architecture:
    name: str  # transformers' class name, as vLLM's registry names it
    config: Callable  # transformers config -> the family's config
    module: type
    layer_weights: Callable[[object], dict]  # our config -> {checkpoint name: layout}
    top_weights: dict[str, tuple[tuple[str, ...], str | None]]  # name -> (our path, layout)
    # A fused layer tensor -> its parts' names and row counts, in order (our config -> map).
    fused_weights: Callable[[object], dict[str, tuple[tuple[str, int], ...]]] = lambda cfg: {}
    # A checkpoint name -> the name the maps use, or None for a tensor the model does not
    # use (a vision-language model's: its text model's names, the tower's layers it skips).
    rename: Callable[[str], str | None] = lambda name: name
    # The checkpoint's (renamed) tensors and our config -> the tensors the maps name, where a
    # family's checkpoint layout is more than renaming (gpt-oss's and Llama 4's stacked
    # experts: one tensor per expert and projection; Llama 4's q/k rows reordered).
    regroup: Callable[[Iterator[tuple[str, object]], object], Iterator[tuple[str, object]]] = (
        lambda weights, cfg: weights
    )


@dataclass(frozen=True, kw_only=True)
class GgufFamily:
    """How llama.cpp names one of a family's architectures (model_loader/gguf_io.py reads
    it): the transformers model type and class it converts back to, the layer tensor names
    that differ from Llama's (`layer_names`: llama.cpp's -> transformers'), and whether its
    converter interleaved the q/k rows (`permuted`: llama's) or stored RMSNorm weights as
    1 + w (`norm_plus_one`: Gemma's). What llama.cpp's metadata keys mean is the reader's
    (model_loader/gguf_config.py), as transformers keeps it in its GGUF reader."""

    model_type: str
    class_name: str
    layer_names: dict[str, str] = field(default_factory=dict)
    permuted: bool = False
    norm_plus_one: bool = False
    # The transformers-named tensors -> the checkpoint's, where llama.cpp's converter did
    # more than rename (DeepSeek's: the experts stacked, kv_b_proj split in two), given the
    # file (its metadata: `arch_key`).
    regroup: (
        Callable[[Iterator[tuple[str, object]], object], Iterator[tuple[str, object]]] | None
    ) = None
    # llama.cpp's parts (`attn_qkv`, ...) the regrouping takes as float arrays: never kept
    # quantized.
    float_parts: frozenset[str] = frozenset()


def unstacked_experts(name: str, w) -> Iterator[tuple[str, object]]:
    """A GGUF layer's stacked experts ([E, out, in], llama.cpp's `ffn_*_exps`; an array or
    a QuantizedWeight whose arrays lead with E) as the checkpoint's one tensor per expert."""
    stem, proj = name.rsplit(".mlp.experts.", 1)
    if isinstance(w, QuantizedWeight):
        for e in range(w.codes.shape[0]):
            yield f"{stem}.mlp.experts.{e}.{proj}", jax.tree.map(lambda a, e=e: a[e], w)
        return
    for e, expert in enumerate(np.asarray(w)):
        yield f"{stem}.mlp.experts.{e}.{proj}", expert


def cut_stacked_experts(prefix: str, proj: str, w: np.ndarray, interleaved: bool, bias=False):
    """One stacked expert tensor of transformers' fused layout (gpt-oss's and Llama 4's:
    `gate_up_proj` [E, D, 2F], `down_proj` [E, F, D], or their biases [E, 2F] / [E, D]) as
    one tensor per expert and projection in transformers' [Out, In]
    (`{prefix}.{e}.gate_proj.weight`, ...; `.bias` with `bias`). `interleaved`: gate and up
    alternate column by column (gpt-oss), else gate is the first half (Llama 4)."""
    kind = "bias" if bias else "weight"
    for e, expert in enumerate(w):
        if proj == "down_proj":
            parts = {"down_proj": expert}
        elif interleaved:
            parts = {"gate_proj": expert[..., 0::2], "up_proj": expert[..., 1::2]}
        else:
            gate, up = np.split(expert, 2, axis=-1)
            parts = {"gate_proj": gate, "up_proj": up}
        for part, value in parts.items():
            yield f"{prefix}.{e}.{part}.{kind}", value if bias else value.T


TOP_WEIGHTS = {
    "model.embed_tokens.weight": (("embed_tokens",), None),
    "model.norm.weight": (("norm", "weight"), None),
    "lm_head.weight": (("lm_head", "weight"), "t"),
}


def attention_weights(*, qkv_bias=False, o_bias=False, qk_norm=False) -> dict:
    """The names of `blocks.Attention` under `self_attn`."""
    names = {f"self_attn.{p}_proj.weight": "qkv" for p in "qkv"}
    names["self_attn.o_proj.weight"] = "o"
    if qkv_bias:
        names |= {f"self_attn.{p}_proj.bias": "bias" for p in "qkv"}
    if o_bias:
        names["self_attn.o_proj.bias"] = None
    if qk_norm:
        names |= {"self_attn.q_norm.weight": None, "self_attn.k_norm.weight": None}
    return names


def mlp_weights(prefix: str = "mlp", bias: bool = False) -> dict:
    """The names of a `blocks.GatedMLP` at `prefix`."""
    names = {f"{prefix}.{p}_proj.weight": "t" for p in ("gate", "up", "down")}
    if bias:
        names |= {f"{prefix}.{p}_proj.bias": None for p in ("gate", "up", "down")}
    return names


LAYER_NORMS = {"input_layernorm.weight": None, "post_attention_layernorm.weight": None}


def expert_weights(router: str, experts: dict[str, str]) -> dict:
    """The names of a `moe.MoE` block: its router (`router`, the checkpoint's name) and
    its experts (`experts`: our projection -> the checkpoint's name, `*` for the index)."""
    names = {router: ("mlp.gate.weight", "t")}
    for ours, theirs in experts.items():
        names[theirs] = (f"mlp.experts.{ours}", "t")
    return names

"""What every decoder's config holds, and what the engine settles on it.

A family's config (`LlamaConfig`, `GemmaConfig`, ...) is a subclass with that family's own
fields only, built from the Hugging Face config by its `from_hf`; `DecoderConfig.fields_of`
reads the fields every decoder has, so a family's builder states only what differs. The
shared decoder (`models/decoder.py`) and the engine read the fields here and nothing else;
a field one family needs (Gemma's soft caps, MoE's experts) lives on that family's config,
or on the shared block that reads it (`models/moe.py:MoeConfig`).

Four fields are the engine's, not the checkpoint's: `kv_scales` (a float8 KV cache with
per-layer scales, model_loader/kv_scales.py), `stage_repeats` or `stage_segments` (pipeline
stages, models/pipeline.py) and `vision` (a vision-language family's encoder, models/vision.py).

Sliding windows follow transformers: a layer whose `layer_types` entry is
"sliding_attention" attends over `sliding_window`. `settle` fixes what depends on the engine:
`max_model_len` (a window that long never binds and is dropped; LongRoPE's factors) and
`disable_sliding_window`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jllm.models.rope import RopeConfig


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str = "silu"
    sliding_window: int | None = None  # the window of the layers marked "sliding_attention"
    # Per layer: "sliding_attention" or "full_attention" (transformers' `layer_types`).
    layer_types: tuple[str, ...] | None = None
    # The engine's: per-layer float8 KV-cache scales exist; each pipeline stage's repeats of
    # the layer pattern (unequal counts pad the stacks, decoder.py), or, for layers that are
    # not one pattern, each stage's repeats of each segment's; the vision encoder.
    kv_scales: bool = False
    stage_repeats: tuple[int, ...] | None = None
    stage_segments: tuple[tuple[int, ...], ...] | None = None
    vision: object | None = None

    @staticmethod
    def fields_of(hf, *, windows: bool = True) -> dict:
        """The fields every decoder reads from a transformers config; with `windows`, the
        sliding window and layer types as transformers reads them (Qwen2 and Qwen3 drop
        their window without `use_sliding_window`)."""
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        fields = dict(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope=RopeConfig.from_hf(hf, head_dim),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
            hidden_act=getattr(hf, "hidden_act", None) or "silu",
        )
        return fields | (window_fields(hf) if windows else {})


def window_fields(hf) -> dict:
    """The config's sliding window and per-layer types (every layer slides when the config
    has a window but no `layer_types`: Mistral's and Phi-3's)."""
    window = getattr(hf, "sliding_window", None)
    if not getattr(hf, "use_sliding_window", True):
        window = None
    if window is None:
        return {}
    types = getattr(hf, "layer_types", None) or ("sliding_attention",) * hf.num_hidden_layers
    return dict(sliding_window=int(window), layer_types=tuple(types))


def sliding_window(cfg) -> int | None:
    """The model's largest sliding window, or None when no layer slides."""
    return getattr(cfg, "sliding_window", None) if getattr(cfg, "layer_types", None) else None


def settle(cfg, max_model_len: int, disable_sliding_window: bool = False):
    """`cfg` for an engine of `max_model_len`: each rotation's LongRoPE factors (short or
    long); windows off with `disable_sliding_window` (the engine caps `max_model_len` at the
    window first) or when no request can outgrow them (they would mask nothing)."""
    changes = {}
    for field in dataclasses.fields(cfg):
        rope = getattr(cfg, field.name)
        if isinstance(rope, RopeConfig):
            changes[field.name] = rope.for_length(max_model_len)
    window = sliding_window(cfg)
    if window is not None and (disable_sliding_window or window >= max_model_len):
        changes["sliding_window"] = None
    return dataclasses.replace(cfg, **changes)

"""A transformers config rebuilt from a GGUF file's metadata, without torch.

transformers can do this itself (`AutoConfig.from_pretrained(dir, gguf_file=...)`), but for the
llama and qwen2 architectures its GGUF reader imports torch, which jllm does not depend on at run
time, and for Gemma and Phi-3 it drops what the file states (rope scaling, LongRoPE factors) or
what llama.cpp infers (Gemma's score scale). The metadata is small and regular, so we map it
ourselves; tests check the result against transformers' own reading where it reads a field.

What the file states: sizes, head counts, context length, norm epsilon, rope base and scaling, and
the special token ids. What it implies: `tie_word_embeddings` (llama.cpp writes `output.weight`
only when the output projection is not the embedding matrix), `attention_bias` (q/k/v biases are
present), the vocabulary size (the embedding's row count), and Llama 3.1-style rope scaling,
which llama.cpp stores as a `rope_freqs` tensor of per-frequency divisors instead of parameters.
The families' own keys and what llama.cpp assumes where its files are silent are in
`_gemma` and `_phi3`.
"""

import math

import numpy as np
from transformers import AutoConfig, PretrainedConfig

from jllm.model_loader.gguf_io import GgufFile

# Meta's llama3 rope scaling parameters, the same in every Llama 3.1/3.2/3.3 release; only the
# overall factor varies, and it is the largest divisor in `rope_freqs`.
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# What llama.cpp assumes where a Gemma file is silent (llama-hparams.h, llama-model.cpp): Gemma 2's
# window and soft caps, Gemma 3's local rope base, and which layers are global: the last of every
# N, a period fixed per family that it does not read from the file. Its score scale is
# `query_pre_attn_scalar ** -0.5` in transformers' terms, a value no GGUF key carries: llama.cpp
# takes the head dim, except for the 27B models (known by their layer count), whose hidden size
# over heads (144, 168) it takes instead, as Google's configs do.
_GEMMA2_DEFAULTS = {
    "attention.sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_hf_config(gf: GgufFile) -> PretrainedConfig:
    """The transformers config (LlamaConfig, Qwen2Config, Qwen3Config, Gemma2Config,
    Gemma3TextConfig, Phi3Config, DeepseekV2Config, DeepseekV3Config, Qwen3NextConfig) a GGUF
    file describes."""
    arch = gf.architecture
    if gf.arch_key("expert_count") and arch not in ("deepseek2", "qwen3next", "gpt-oss"):
        raise ValueError(
            f"{gf.path} is a mixture-of-experts GGUF of architecture {arch!r}; jllm loads "
            "the experts of deepseek2, qwen3next and gpt-oss files only. Use the model's "
            "safetensors checkpoint."
        )
    num_heads = int(gf.arch_key("attention.head_count"))
    num_kv_heads = gf.arch_key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError(f"{gf.path} has a per-layer KV head count, which jllm does not support.")
    hidden_size = int(gf.arch_key("embedding_length"))
    head_dim = int(gf.arch_key("attention.key_length", hidden_size // num_heads))
    names = set(gf.tensors)
    model_type, class_name = gf.family.model_type, gf.family.class_name
    kwargs = {
        "architectures": [class_name],
        "vocab_size": int(gf.tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden_size,
        "intermediate_size": int(gf.arch_key("feed_forward_length")),
        "num_hidden_layers": int(gf.arch_key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "max_position_embeddings": int(gf.arch_key("context_length")),
        "rms_norm_eps": _f32(gf.arch_key("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gf.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gf.metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": gf.metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "deepseek2":
        model_type, class_name, own = _deepseek2(gf)
        kwargs |= own | {"architectures": [class_name]}
        return AutoConfig.for_model(model_type, **kwargs)
    if arch == "qwen3next":
        return AutoConfig.for_model(model_type, **kwargs, **_qwen3next(gf, head_dim))
    if arch == "gpt-oss":
        return AutoConfig.for_model(model_type, **(kwargs | _gpt_oss(gf, head_dim)))
    if arch in ("llama", "qwen3", "gemma2", "gemma3"):
        kwargs["head_dim"] = head_dim
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if arch in ("gemma2", "gemma3"):
        kwargs |= _gemma(gf, head_dim)
    elif arch == "phi3":
        kwargs |= _phi3(gf, head_dim)
    else:
        kwargs["rope_parameters"] = _rope_parameters(gf, head_dim)
    return AutoConfig.for_model(model_type, **kwargs)


def _qwen3next(gf: GgufFile, head_dim: int) -> dict:
    """llama.cpp's `qwen3next` (Qwen3-Next): the DeltaNet's shape from its `ssm.*` keys, the
    layer order from `full_attention_interval` (the last of every N layers is full
    attention: llama.cpp's rule and transformers' default), the rotated share of each head
    from `rope.dimension_count`, and the experts (the layers without a router are dense)."""
    layers = int(gf.arch_key("block_count"))
    every = int(gf.arch_key("full_attention_interval", 4))
    value_heads = int(gf.arch_key("ssm.time_step_rank"))
    rotary = int(gf.arch_key("rope.dimension_count", head_dim // 4))
    names = set(gf.tensors)
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)]
    own = {
        "head_dim": head_dim,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
        "layer_types": [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ],
        "linear_conv_kernel_dim": int(gf.arch_key("ssm.conv_kernel")),
        "linear_key_head_dim": int(gf.arch_key("ssm.state_size")),
        "linear_num_key_heads": int(gf.arch_key("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(gf.arch_key("ssm.inner_size")) // value_heads,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": _f32(gf.arch_key("rope.freq_base", 10000.0)),
            "partial_rotary_factor": rotary / head_dim,
        },
    }
    if any(sparse):
        own |= {
            "num_experts": int(gf.arch_key("expert_count")),
            "num_experts_per_tok": int(gf.arch_key("expert_used_count")),
            "moe_intermediate_size": int(gf.arch_key("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(
                gf.arch_key("expert_shared_feed_forward_length", 0)
            ),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, s in enumerate(sparse) if not s],
        }
    return own


def _gpt_oss(gf: GgufFile, head_dim: int) -> dict:
    """llama.cpp's `gpt-oss`: the experts' keys, the window (llama.cpp slides every other
    layer, the first included, as gpt-oss's `layer_types` do), biases, and YaRN with
    gpt-oss's betas where the file has none."""
    layers = int(gf.arch_key("block_count"))
    rope = _rope_parameters(gf, head_dim)
    if rope["rope_type"] == "yarn":
        rope["beta_fast"] = _f32(gf.arch_key("rope.scaling.yarn_beta_fast", 32.0))
        rope["beta_slow"] = _f32(gf.arch_key("rope.scaling.yarn_beta_slow", 1.0))
        rope["truncate"] = False
    window = gf.arch_key("attention.sliding_window")
    return {
        "head_dim": head_dim,
        "intermediate_size": int(gf.arch_key("expert_feed_forward_length")),
        "num_local_experts": int(gf.arch_key("expert_count")),
        "num_experts_per_tok": int(gf.arch_key("expert_used_count")),
        "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
        "sliding_window": int(window) if window else None,
        "layer_types": [
            "sliding_attention" if window and i % 2 == 0 else "full_attention"
            for i in range(layers)
        ],
        "rope_parameters": rope,
    }


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from: 1e-05, not 9.9999997e-06."""
    return float(str(np.float32(value)))


def _rope_parameters(gf: GgufFile, head_dim: int) -> dict:
    theta = _f32(gf.arch_key("rope.freq_base", 10000.0))
    if "rope_freqs.weight" in gf.tensors:
        return _llama3_rope(gf.tensor("rope_freqs.weight"), theta, head_dim, gf.path)
    scaling = gf.arch_key("rope.scaling.type", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    factor = _f32(gf.arch_key("rope.scaling.factor"))
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if scaling == "yarn":
        original = int(gf.arch_key("rope.scaling.original_context_length"))
        return {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": factor,
            "original_max_position_embeddings": original,
        }
    raise ValueError(f"{gf.path} uses rope scaling {scaling!r}; jllm supports linear and yarn.")


def llama3_rope_divisors(theta: float, head_dim: int, factor: float) -> np.ndarray:
    """How much llama3 rope scaling divides each of the `head_dim / 2` rotary frequencies by."""
    low_ff, high_ff = _LLAMA3_ROPE["low_freq_factor"], _LLAMA3_ROPE["high_freq_factor"]
    original = _LLAMA3_ROPE["original_max_position_embeddings"]
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [H/2]
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low_ff) / (high_ff - low_ff), 0.0, 1.0)
    # smooth = 1 at high frequencies (divisor 1), 0 at low ones (divisor `factor`)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _llama3_rope(divisors: np.ndarray, theta: float, head_dim: int, path: str) -> dict:
    factor = float(divisors.max())
    expected = llama3_rope_divisors(theta, head_dim, factor)
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-4):
        raise ValueError(
            f"{path} has a rope_freqs tensor that is not Llama 3's rope scaling "
            f"(factor {factor}, {_LLAMA3_ROPE}); jllm cannot load this rope variant."
        )
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, **_LLAMA3_ROPE}


def _gemma(gf: GgufFile, head_dim: int) -> dict:
    """Gemma 2's and Gemma 3's own fields: score scale, soft caps, window, layer types, and
    Gemma 3's two rotations (global layers: the file's base and scaling; local: no scaling)."""
    arch = gf.architecture
    layers = int(gf.arch_key("block_count"))
    hidden, heads = int(gf.arch_key("embedding_length")), int(gf.arch_key("attention.head_count"))
    out = {
        "query_pre_attn_scalar": hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    }
    rope = _rope_parameters(gf, head_dim)
    if arch == "gemma2":
        out["rope_parameters"] = rope
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            out[key] = _f32(gf.arch_key(key, _GEMMA2_DEFAULTS[key]))
        window = gf.arch_key(
            "attention.sliding_window", _GEMMA2_DEFAULTS["attention.sliding_window"]
        )
    else:
        theta = _f32(gf.arch_key("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
        local = {"rope_type": "default", "rope_theta": theta}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        cap = gf.arch_key("final_logit_softcapping")
        out["final_logit_softcapping"] = _f32(cap) if cap else None
        window = gf.arch_key("attention.sliding_window")
    if not window:  # llama.cpp: without a window every layer is global
        return out | {"sliding_window": None, "layer_types": ["full_attention"] * layers}
    return out | {"sliding_window": int(window), "layer_types": _layer_types(gf, layers)}


def _layer_types(gf: GgufFile, layers: int) -> list[str]:
    """transformers' `layer_types`: the file's `attention.sliding_window_pattern` (a period, or
    one flag per layer, true where it slides) if it has one, else the family's period."""
    pattern = gf.arch_key("attention.sliding_window_pattern", _GEMMA_GLOBAL_EVERY[gf.architecture])
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"{gf.path} has a sliding_window_pattern of {len(pattern)} layers for {layers}."
            )
        sliding = [bool(flag) for flag in pattern]
    else:  # llama.cpp's period: the last layer of each is global; 0 makes every layer slide
        period = int(pattern)
        sliding = [period == 0 or (i + 1) % period != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _phi3(gf: GgufFile, head_dim: int) -> dict:
    """Phi-3's own fields: the context it was trained at before LongRoPE, the rotated share of
    each head, LongRoPE's factors (stored as tensors), and its window (0 for none: Phi-4).

    llama.cpp ignores Phi-3's window (its converters wrote no layer pattern); we keep it, as
    transformers and jllm's safetensors loading do, so a file runs as the model it came from."""
    context = int(gf.arch_key("context_length"))
    original = int(gf.arch_key("rope.scaling.original_context_length", context))
    rope = {
        "rope_type": "default",
        "rope_theta": _f32(gf.arch_key("rope.freq_base", 10000.0)),
        "partial_rotary_factor": int(gf.arch_key("rope.dimension_count", head_dim)) / head_dim,
    }
    factors = [f"rope_factors_{kind}.weight" for kind in ("long", "short")]
    present = [name in gf.tensors for name in factors]
    scaling = gf.arch_key("rope.scaling.type", "none")
    if scaling not in ("none", "longrope") or any(present) != all(present):
        raise ValueError(
            f"{gf.path} is a phi3 GGUF with rope scaling {scaling!r} and rope factor tensors "
            f"{[n for n, p in zip(factors, present, strict=True) if p]}; jllm loads Phi-3 files "
            "with no rope scaling or with LongRoPE's long and short factors."
        )
    if all(present):
        rope |= _longrope(gf, context, original)
    window = int(gf.arch_key("attention.sliding_window", 0))
    return {
        "rope_parameters": rope,
        "original_max_position_embeddings": original,
        "sliding_window": window or None,
    }


def _longrope(gf: GgufFile, context: int, original: int) -> dict:
    """LongRoPE's parameters from the factor tensors. llama.cpp scales the rotation by
    `rope.scaling.attn_factor`, which its converter sets to LongRoPE's default for the two
    lengths (what transformers derives itself); a different value is kept as
    `attention_factor`."""
    long, short = (gf.tensor(f"rope_factors_{kind}.weight") for kind in ("long", "short"))
    params = {
        "rope_type": "longrope",
        "long_factor": [_f32(f) for f in long],
        "short_factor": [_f32(f) for f in short],
        "original_max_position_embeddings": original,
    }
    scale = context / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    attn_factor = gf.arch_key("rope.scaling.attn_factor")
    if attn_factor is not None and not math.isclose(attn_factor, default, rel_tol=1e-6):
        params["attention_factor"] = _f32(attn_factor)
    return params


def _deepseek2(gf: GgufFile) -> tuple[str, str, dict]:
    """llama.cpp's `deepseek2` (DeepSeek-V2, V3, R1, Kimi K2): (model type, class, fields).

    Its converter writes MLA as one shared KV head (`head_count_kv` 1, `key_length` the
    latent's kv_lora_rank + rope lanes) and the per-head widths under `key_length_mla` /
    `value_length_mla`; files from before it (kv_b_proj whole) state the per-head widths
    under the plain keys. Sigmoid gating with the `exp_probs_b` correction bias is V3's router
    ("noaux_tc"); softmax is V2's, grouped where the file has groups. YaRN's
    `yarn_log_multiplier` is 0.1 x mscale_all_dim; llama.cpp rotates with no magnitude
    correction, which is transformers' with mscale equal to mscale_all_dim (as DeepSeek's
    released configs have them)."""
    if gf.arch_key("nextn_predict_layers"):
        raise ValueError(
            f"{gf.path} holds DeepSeek's multi-token-prediction layers, which jllm does not "
            "load from GGUF; use a file converted without them or the safetensors checkpoint."
        )
    heads = int(gf.arch_key("attention.head_count"))
    rope_dim = int(gf.arch_key("rope.dimension_count"))
    key = gf.arch_key("attention.key_length_mla", gf.arch_key("attention.key_length"))
    value = gf.arch_key("attention.value_length_mla", gf.arch_key("attention.value_length"))
    q_lora = gf.arch_key("attention.q_lora_rank")
    experts = int(gf.arch_key("expert_count", 0))
    groups = int(gf.arch_key("expert_group_count", 1) or 1)
    sigmoid = gf.arch_key("expert_gating_func") == _SIGMOID
    biased = "blk.{}.exp_probs_b.bias".format(gf.arch_key("leading_dense_block_count", 0))
    if experts and sigmoid != (biased in gf.tensors):
        raise ValueError(
            f"{gf.path} gates its experts by {'sigmoid' if sigmoid else 'softmax'} "
            f"{'without' if sigmoid else 'with'} a correction bias (exp_probs_b); jllm "
            "loads DeepSeek-V3's router (sigmoid, biased) and V2's (softmax)."
        )
    fields = {
        "num_key_value_heads": heads,
        "kv_lora_rank": int(gf.arch_key("attention.kv_lora_rank")),
        "q_lora_rank": int(q_lora) if q_lora else None,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": int(key) - rope_dim,
        "v_head_dim": int(value),
        "head_dim": rope_dim,
        "n_routed_experts": experts or None,
        "num_experts_per_tok": int(gf.arch_key("expert_used_count", 1)),
        "n_shared_experts": int(gf.arch_key("expert_shared_count", 0)),
        "moe_intermediate_size": int(gf.arch_key("expert_feed_forward_length")),
        "first_k_dense_replace": int(gf.arch_key("leading_dense_block_count", 0)),
        "routed_scaling_factor": _f32(gf.arch_key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(gf.arch_key("expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": int(gf.arch_key("expert_group_used_count", 1) or 1),
        "rope_parameters": _deepseek2_rope(gf),
    }
    if sigmoid:
        return "deepseek_v3", "DeepseekV3ForCausalLM", fields | {"rope_interleave": True}
    method = "group_limited_greedy" if groups > 1 else "greedy"
    return "deepseek_v2", "DeepseekV2ForCausalLM", fields | {"topk_method": method}


_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)


def _deepseek2_rope(gf: GgufFile) -> dict:
    theta = _f32(gf.arch_key("rope.freq_base", 10000.0))
    scaling = gf.arch_key("rope.scaling.type", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise ValueError(f"{gf.path} uses rope scaling {scaling!r}; DeepSeek's is yarn.")
    mscale = round(_f32(gf.arch_key("rope.scaling.yarn_log_multiplier", 0.0)) * 10, 6)
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": _f32(gf.arch_key("rope.scaling.factor")),
        "original_max_position_embeddings": int(
            gf.arch_key("rope.scaling.original_context_length")
        ),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }

"""A transformers config rebuilt from a GGUF file's metadata, without torch.

transformers can do this itself (`AutoConfig.from_pretrained(dir, gguf_file=...)`), but for the
llama and qwen2 architectures its GGUF reader imports torch, which jllm does not depend on at run
time. The metadata is small and regular, so we map it ourselves; tests check the result against
transformers' own reading.

What the file states: sizes, head counts, context length, norm epsilon, rope base and scaling, and
the special token ids. What it implies: `tie_word_embeddings` (llama.cpp writes `output.weight`
only when the output projection is not the embedding matrix), `attention_bias` (q/k/v biases are
present), the vocabulary size (the embedding's row count), and Llama 3.1-style rope scaling,
which llama.cpp stores as a `rope_freqs` tensor of per-frequency divisors instead of parameters.
"""

import math

import numpy as np
from transformers import AutoConfig, PretrainedConfig

from jllm.model_loader.gguf_io import GgufFile

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Meta's llama3 rope scaling parameters, the same in every Llama 3.1/3.2/3.3 release; only the
# overall factor varies, and it is the largest divisor in `rope_freqs`.
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def gguf_hf_config(gf: GgufFile) -> PretrainedConfig:
    """The transformers config (LlamaConfig, Qwen2Config, Qwen3Config) a GGUF file describes."""
    arch = gf.architecture
    if gf.arch_key("expert_count"):
        raise ValueError(f"{gf.path} is a mixture-of-experts GGUF; jllm loads dense models only.")
    num_heads = int(gf.arch_key("attention.head_count"))
    num_kv_heads = gf.arch_key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError(f"{gf.path} has a per-layer KV head count, which jllm does not support.")
    hidden_size = int(gf.arch_key("embedding_length"))
    head_dim = int(gf.arch_key("attention.key_length", hidden_size // num_heads))
    names = set(gf.tensors)
    kwargs = {
        "architectures": [_MODEL_TYPES[arch]],
        "vocab_size": int(gf.tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden_size,
        "intermediate_size": int(gf.arch_key("feed_forward_length")),
        "num_hidden_layers": int(gf.arch_key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "max_position_embeddings": int(gf.arch_key("context_length")),
        "rms_norm_eps": _f32(gf.arch_key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": _rope_parameters(gf, head_dim),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gf.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gf.metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": gf.metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if arch in ("llama", "qwen3"):
        kwargs["head_dim"] = head_dim
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
    return AutoConfig.for_model(arch, **kwargs)


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

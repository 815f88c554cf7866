"""The model registry: config -> module, and checkpoints whose tensors the module does not
take are refused by name instead of loading without them."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import transformers
from oracle import SMALL
from safetensors.numpy import load_file, save_file

from jllm import LLM
from jllm.models import registry
from jllm.models.config import settle


@pytest.mark.parametrize(
    "model_type, name",
    [
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("phi3", "Phi3ForCausalLM"),
        ("mixtral", "MixtralForCausalLM"),
        ("qwen2_moe", "Qwen2MoeForCausalLM"),
        ("qwen3_moe", "Qwen3MoeForCausalLM"),
        ("gemma2", "Gemma2ForCausalLM"),
        ("gemma3_text", "Gemma3ForCausalLM"),
    ],
)
def test_resolve_by_model_type(model_type, name):
    config = transformers.AutoConfig.for_model(model_type)
    assert registry.resolve(config).name == name


def test_resolve_by_architectures_and_unknown():
    config = transformers.PretrainedConfig(architectures=["Qwen3ForCausalLM"])
    assert registry.resolve(config).name == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="'gpt2' is not supported by jllm yet"):
        registry.resolve(transformers.AutoConfig.for_model("gpt2"))


def test_flags_follow_the_config():
    qwen3 = registry.resolve(transformers.AutoConfig.for_model("qwen3"))
    cfg = qwen3.config(transformers.Qwen3Config(head_dim=32))
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 32
    names = qwen3.layer_weights(cfg)
    assert "self_attn.q_norm.weight" in names and "self_attn.q_proj.bias" not in names
    llama = transformers.LlamaConfig(attention_bias=True, mlp_bias=True)
    cfg = registry.resolve(llama).config(llama)
    assert cfg.attention_bias and cfg.mlp_bias
    names = registry.resolve(llama).layer_weights(cfg)
    assert "self_attn.o_proj.bias" in names and "mlp.down_proj.bias" in names


def _with_extra_tensor(src: str, dst, name: str, value: np.ndarray) -> str:
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = value
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def test_unknown_checkpoint_tensor_is_an_error(llama_dir, tmp_path):
    # A bias the config does not announce: loading without it would change the model.
    bias = np.ones(64, np.float32)
    model = _with_extra_tensor(
        llama_dir, tmp_path / "m", "model.layers.0.self_attn.o_proj.bias", bias
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        LLM(model, **SMALL)


def test_known_leftovers_are_ignored(llama_dir, tmp_path):
    inv_freq = np.ones(8, np.float32)
    model = _with_extra_tensor(
        llama_dir, tmp_path / "m", "model.layers.1.self_attn.rotary_emb.inv_freq", inv_freq
    )
    assert LLM(model, **SMALL).llm_engine.model_config.num_layers == 2


def test_windows_follow_transformers():
    """Which layers slide, as transformers reads each config: Qwen2 only with
    use_sliding_window and from max_window_layers on; Mistral every layer; Gemma 3 by its
    pattern; a window no request can outgrow is dropped, and disable_sliding_window drops
    every window."""
    qwen2 = transformers.Qwen2Config(num_hidden_layers=4, sliding_window=32)
    assert registry.resolve(qwen2).config(qwen2).sliding_window is None
    qwen2 = transformers.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=32, max_window_layers=2
    )
    cfg = registry.resolve(qwen2).config(qwen2)
    assert cfg.sliding_window == 32 and cfg.layer_types[1:3] == (
        "full_attention",
        "sliding_attention",
    )
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=64)
    cfg = registry.resolve(mistral).config(mistral)
    assert cfg.layer_types == ("sliding_attention",) * 3
    assert settle(cfg, 64).sliding_window is None  # never binds at 64 tokens
    assert settle(cfg, 65).sliding_window == 64
    assert settle(cfg, 65, disable_sliding_window=True).sliding_window is None
    gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=8, sliding_window=16)
    cfg = registry.resolve(gemma3).config(gemma3)
    groups = registry.resolve(gemma3).module.kv_cache_groups(cfg)
    assert [(g.window, g.layers) for g in groups] == [(16, (0, 1, 2, 3, 4, 6, 7)), (None, (5,))]
    assert cfg.local_rope.inv_freq != cfg.rope.inv_freq  # local base 10k, global 1M


def test_phi3_long_rope_follows_max_model_len():
    """LongRoPE's short factors while no request can pass the original length, its long
    ones otherwise (and its attention scaling either way)."""
    short, long = [1.0] * 48, [4.0] * 48
    phi3 = transformers.Phi3Config(
        max_position_embeddings=8192,
        original_max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "short_factor": short, "long_factor": long},
    )
    cfg = registry.resolve(phi3).config(phi3)
    at_4k, at_8k = settle(cfg, 4096).rope, settle(cfg, 8192).rope
    np.testing.assert_allclose(np.array(at_4k.inv_freq), 4.0 * np.array(at_8k.inv_freq))
    assert at_4k.attention_scaling == at_8k.attention_scaling > 1.0

"""The model registry: config -> module, and checkpoints whose tensors the module does not
take are refused by name instead of loading without them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import transformers
from oracle import SMALL
from safetensors.numpy import load_file, save_file

from jllm import LLM
from jllm.models import registry


@pytest.mark.parametrize(
    "model_type, name",
    [
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
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
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias


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


def test_sliding_window_is_refused(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding window"):
        LLM(str(tmp_path / "m"), **SMALL)

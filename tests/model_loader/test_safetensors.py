"""Hugging Face safetensors directories, checked against the torch models that saved them."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jllm.model_loader import resolve_model
from jllm.model_loader.safetensors_io import INDEX_FILE


def expected_weights(model) -> dict[str, np.ndarray]:
    """The torch state dict as float32 numpy, without a tied lm_head (save_pretrained drops it)."""
    tied = model.config.tie_word_embeddings
    return {
        name: tensor.float().numpy()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_weights_equal_state_dict(arch, tie, save_tiny):
    path, model = save_tiny(arch, tie=tie)
    source = resolve_model(path)
    assert source.kind == "hf" and source.path == path

    got = dict(source.iter_weights())
    expected = expected_weights(model)
    assert sorted(got) == sorted(expected)
    for name, array in got.items():
        assert array.dtype == np.float32 and array.shape == expected[name].shape, name
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in got
    assert source.num_params == sum(a.size for a in got.values())
    assert source.checkpoint_nbytes == 4 * source.num_params

    cfg = source.hf_config
    assert type(cfg) is type(model.config)
    assert cfg.to_diff_dict() == model.config.to_diff_dict() | {"architectures": cfg.architectures}
    assert source.checkpoint_dtype == "float32"


def test_bfloat16_checkpoint(save_tiny):
    path, model = save_tiny("llama", dtype=torch.bfloat16)
    source = resolve_model(path)
    assert source.checkpoint_dtype == "bfloat16"
    got = dict(source.iter_weights())
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        np.testing.assert_array_equal(got[name], tensor.float().numpy(), err_msg=name)
    assert source.checkpoint_nbytes == 2 * source.num_params


def test_checkpoint_dtype_from_file_when_config_has_none(save_tiny):
    path, _ = save_tiny("llama", dtype=torch.float16)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    with open(config_path, "w") as f:
        json.dump(config, f)
    assert resolve_model(path).checkpoint_dtype == "float16"


def test_sharded_checkpoint_follows_index(save_tiny, tmp_path):
    path, model = save_tiny("qwen2")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / INDEX_FILE).exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    # a stray file outside the index (Mistral repos ship consolidated.safetensors) is ignored
    save_file({"junk": torch.zeros(3)}, str(sharded / "consolidated.safetensors"))
    got = dict(resolve_model(str(sharded)).iter_weights())
    expected = expected_weights(model)
    assert sorted(got) == sorted(expected)
    for name, array in got.items():
        np.testing.assert_array_equal(array, expected[name], err_msg=name)


def test_tokenizer_from_model_directory(save_tiny, smollm_source):
    path, _ = save_tiny("llama")
    source = resolve_model(path)
    tok = source.load_tokenizer()
    reference = smollm_source.load_tokenizer()
    text = "Hello world, <|im_start|> hi"
    assert tok(text)["input_ids"] == reference(text)["input_ids"]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>system\n"
    )
    assert source.load_tokenizer(tokenizer_mode="slow")(text)["input_ids"] == tok(text)["input_ids"]
    with pytest.raises(ValueError, match="tokenizer_mode='mistral'"):
        source.load_tokenizer(tokenizer_mode="mistral")


def test_tokenizer_override_with_gguf(save_tiny, smollm_source):
    path, _ = save_tiny("llama")
    source = resolve_model(path, tokenizer=smollm_source.path)
    tok = source.load_tokenizer()
    assert tok.name_or_path == smollm_source.path
    assert tok.chat_template == smollm_source.load_tokenizer().chat_template


def test_directory_without_safetensors(tmp_path, save_tiny):
    path, _ = save_tiny("llama")
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            os.replace(os.path.join(path, name), os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="only safetensors") as info:
        resolve_model(path)
    assert "pytorch_model.bin" in str(info.value)


def test_quantized_checkpoint_is_rejected(save_tiny):
    path, _ = save_tiny("llama")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="quantized checkpoint"):
        resolve_model(path)

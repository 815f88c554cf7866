"""GGUF loading checked against transformers' own GGUF reader (torch) and against the torch
models tiny GGUF files were written from."""

import os

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jllm.model_loader import resolve_model
from jllm.model_loader.gguf_io import unpermute_rope_rows

CONFIG_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
]


def transformers_gguf_weights(path: str, config) -> dict[str, np.ndarray]:
    """transformers' GGUF loader (dequantize, rename, undo llama.cpp's q/k order), as numpy.

    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` runs exactly this, but insists on
    `accelerate`, which is not installed; the model is only used for its parameter names.
    """
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    return {name: t.float().numpy() for name, t in tensors.items()}


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm_source):
    """Every tensor of the embedded Q4_1/Q8_0 file, against transformers' GGUF loading."""
    expected = transformers_gguf_weights(smollm_source.path, smollm_source.hf_config)
    got = dict(smollm_source.iter_weights())
    assert sorted(got) == sorted(expected)
    assert "lm_head.weight" not in got and smollm_source.hf_config.tie_word_embeddings
    for name, array in got.items():
        assert array.dtype == np.float32, name
        assert array.shape == expected[name].shape, name
        # both dequantize with gguf-py, so they agree to the bit
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
    assert smollm_source.num_params == sum(a.size for a in got.values())


def test_smollm2_config_matches_transformers(smollm_source):
    cfg = smollm_source.hf_config
    expected = transformers.AutoConfig.from_pretrained(
        os.path.dirname(smollm_source.path), gguf_file=os.path.basename(smollm_source.path)
    )
    for field in [*CONFIG_FIELDS, "head_dim", "attention_bias", "mlp_bias"]:
        value = getattr(expected, field)
        if isinstance(value, float):  # transformers keeps the float32 eps as 9.99999975e-06
            value = pytest.approx(value, rel=1e-6)
        assert getattr(cfg, field) == value, field
    assert cfg.architectures == ["LlamaForCausalLM"]
    # Q4_1 matrices (float16 block scales): a 16-bit checkpoint for `dtype="auto"`.
    assert smollm_source.kind == "gguf" and smollm_source.checkpoint_dtype == "float16"


def test_smollm2_tokenizer_matches_transformers(smollm_source):
    tok = smollm_source.load_tokenizer()
    expected = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm_source.path), gguf_file=os.path.basename(smollm_source.path)
    )
    texts = [
        "Hello world, <|im_start|> hi",
        "  leading spaces\nand\ttabs, digits 1234567 and émojis 🙂",
        "def f(x):\n    return x ** 2  # code",
    ]
    for text in texts:
        assert tok(text)["input_ids"] == expected(text)["input_ids"], text
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == expected.decode(ids)
    assert tok.all_special_tokens == expected.all_special_tokens
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert len(tok) == len(expected) == smollm_source.hf_config.vocab_size

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == expected.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert rendered.endswith("<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")


TINY_GGUFS = [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False)]


@pytest.mark.parametrize("arch,tie", TINY_GGUFS)
def test_tiny_gguf_matches_source_model(arch, tie, tmp_path, make_tiny, gguf_writer):
    overrides = {"attention_bias": True} if arch == "llama" else {}
    model = make_tiny(arch, tie=tie, **overrides)
    path = str(tmp_path / f"{arch}.gguf")
    stored = gguf_writer(path, model, arch)
    source = resolve_model(path)

    got = dict(source.iter_weights())
    assert sorted(got) == sorted(stored)
    for name, array in got.items():
        np.testing.assert_array_equal(array, stored[name], err_msg=name)
    # and transformers' reader agrees, including the q/k row order and the biases
    expected = transformers_gguf_weights(path, source.hf_config)
    assert sorted(expected) == sorted(got)
    for name, array in got.items():
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
    # Q8_0 round trip of the original weights: close, and in the right order
    for name, tensor in model.state_dict().items():
        if name in got:
            np.testing.assert_allclose(got[name], tensor.numpy(), atol=2e-2, err_msg=name)

    cfg = source.hf_config
    for field in CONFIG_FIELDS:
        assert getattr(cfg, field) == getattr(model.config, field), field
    if arch != "qwen2":
        assert cfg.head_dim == model.config.head_dim
        assert cfg.attention_bias == model.config.attention_bias


def test_llama3_rope_scaling_from_rope_freqs(tmp_path, make_tiny, gguf_writer):
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors; we recover the params."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    model = make_tiny("llama", rope_parameters=rope, max_position_embeddings=131072)
    head_dim = model.config.head_dim
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    default = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2).double() / head_dim)
    divisors = (default / scaled.double()).numpy()
    assert divisors.max() == pytest.approx(32.0) and divisors.min() == pytest.approx(1.0)

    path = str(tmp_path / "llama3.gguf")
    gguf_writer(path, model, "llama", rope_freqs=divisors)
    source = resolve_model(path)
    assert source.hf_config.rope_parameters == pytest.approx(rope)
    assert not any("rope_freqs" in name for name, _ in source.iter_weights())


def test_unpermute_inverts_llama_cpp_order():
    """Per head, llama.cpp rows [x0, y0, x1, y1, ...] go back to [x0, x1, ..., y0, y1, ...]."""
    heads, head_dim = 3, 8
    hf_rows = np.arange(heads * head_dim, dtype=np.float32)
    x, y = hf_rows.reshape(heads, 2, head_dim // 2).transpose(1, 0, 2)  # halves, per head
    gguf_rows = np.stack([x, y], axis=-1).reshape(-1)  # interleaved pairs, per head
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_rows, heads), hf_rows)
    weight = np.random.default_rng(0).normal(size=(heads * head_dim, 5)).astype(np.float32)
    gguf_weight = weight.reshape(heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(weight.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_weight, heads), weight)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = str(tmp_path / "phi.gguf")
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'phi2'"):
        resolve_model(path)

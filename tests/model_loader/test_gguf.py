"""GGUF loading checked against transformers' own GGUF reader (torch) and against the torch
models tiny GGUF files were written from: their weights, their configs, and (Gemma 2, Gemma 3,
Phi-3) their greedy generations through the engine."""

import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from oracle import SMALL, prompt_ids, teacher_forced_logprobs
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jllm import LLM, SamplingParams
from jllm.model_loader import resolve_model
from jllm.model_loader.gguf_io import unpermute_rope_rows
from jllm.quantization.weights import QuantizedWeight

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
# The families' own fields, where their config class has them.
FAMILY_FIELDS = [
    "head_dim",
    "attention_bias",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "original_max_position_embeddings",
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


TINY_GGUFS = [
    ("llama", False),
    ("llama", True),
    ("qwen2", True),
    ("qwen3", False),
    ("gemma2", True),
    ("gemma3", True),
    ("phi3", False),
    ("phi3", True),
]


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
    assert type(cfg) is type(model.config)
    for field in CONFIG_FIELDS:
        assert getattr(cfg, field) == getattr(model.config, field), field
    for field in FAMILY_FIELDS:
        if hasattr(model.config, field):
            assert getattr(cfg, field) == getattr(model.config, field), field


@pytest.mark.parametrize("arch,tie", [("gemma2", True), ("gemma3", True), ("phi3", False)])
def test_tiny_gguf_config_matches_transformers_reading(arch, tie, tmp_path, make_tiny, gguf_writer):
    """The fields transformers' GGUF reader takes from these families' files. It leaves the rest
    at its class defaults (Gemma's soft caps and score scale, Gemma 3's rope scaling, Phi-3's
    LongRoPE, window and original length), which the test above checks against the model."""
    model = make_tiny(arch, tie=tie)
    path = str(tmp_path / f"{arch}.gguf")
    gguf_writer(path, model, arch)
    cfg = resolve_model(path).hf_config
    expected = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf")
    fields = [f for f in CONFIG_FIELDS if f not in ("vocab_size", "rope_parameters")]
    if arch != "phi3":
        fields += ["head_dim", "sliding_window", "layer_types"]
    for field in fields:
        value = getattr(expected, field)
        if isinstance(value, float):  # transformers keeps the float32 eps as 9.99999975e-06
            value = pytest.approx(value, rel=1e-6)
        assert getattr(cfg, field) == value, field
    # (transformers takes the vocabulary size from the tokenizer, which these files lack)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_tiny_gguf_generates_as_its_source(arch, tmp_path, make_tiny, gguf_writer):
    """`LLM(file.gguf)` against transformers running the model the file was written from
    (float32 tensors; eager attention), on prompts longer than the windows (8 tokens) and past
    Phi-3's original 32 positions (LongRoPE's long factors): greedy tokens equal, and logprobs
    within 1e-4 of transformers', teacher-forced on those tokens."""
    model = make_tiny(arch, tie=arch != "phi3")
    path = str(tmp_path / f"{arch}.gguf")
    gguf_writer(path, model, arch, matrix_type="F32", embedding_type="F32")
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **SMALL)
    prompts = prompt_ids(3, 40, vocab=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)

    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        gen = out.outputs[0]
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
            )
        assert list(gen.token_ids) == ids[0, len(prompt) :].tolist()
        ref = teacher_forced_logprobs(model, prompt, list(gen.token_ids))
        got = [gen.logprobs[i][t].logprob for i, t in enumerate(gen.token_ids)]
        want = [ref[i, t].item() for i, t in enumerate(gen.token_ids)]
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_phi3_fused_tensors_kept_quantized(tmp_path, make_tiny, gguf_writer):
    """Phi-3's `attn_qkv` and `ffn_up` kept as Q4_0 codes are split by rows like the float
    tensors: the engine gives the dequantized-on-load engine's tokens, on one device and two."""
    path = str(tmp_path / "phi3.gguf")
    gguf_writer(path, make_tiny("phi3"), "phi3", matrix_type="Q4_0")
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(3, 40, vocab=256)]
    args = {"dtype": "float32", "skip_tokenizer_init": True, **SMALL}
    want = LLM(path, **args).generate(prompts, GREEDY, use_tqdm=False)
    for tp in (1, 2):
        kept = LLM(path, quantization="gguf", tensor_parallel_size=tp, **args)
        got = kept.generate(prompts, GREEDY, use_tqdm=False)
        for a, b in zip(want, got, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
    k_proj = kept.llm_engine.runner.state["layers"]["self_attn"]["k_proj"]["weight"].get_value()
    assert isinstance(k_proj, QuantizedWeight)


# Google's released configs: (layers, hidden, heads, kv heads, head dim, query_pre_attn_scalar).
GEMMA_SIZES = {
    "gemma-2-9b": ("gemma2", 42, 3584, 16, 8, 256, 256),
    "gemma-2-27b": ("gemma2", 46, 4608, 32, 16, 128, 144),
    "gemma-3-4b": ("gemma3", 34, 2560, 8, 4, 256, 256),
    "gemma-3-27b": ("gemma3", 62, 5376, 32, 16, 128, 168),
}


@pytest.mark.parametrize("size", GEMMA_SIZES)
def test_gemma_score_scale_as_llama_cpp_infers_it(size, tmp_path, gguf_header):
    """No GGUF key holds query_pre_attn_scalar: llama.cpp takes the head dim, or hidden / heads
    for the 27B models (known by their layer count), which gives Google's value at each size."""
    arch, layers, hidden, heads, kv_heads, head_dim, scalar = GEMMA_SIZES[size]
    config_cls = transformers.Gemma2Config if arch == "gemma2" else transformers.Gemma3TextConfig
    config = config_cls(
        vocab_size=8,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=scalar,
    )
    cfg = resolve_model(gguf_header(str(tmp_path / "g.gguf"), config, arch)).hf_config
    assert cfg.query_pre_attn_scalar == scalar
    assert cfg.layer_types == config.layer_types  # the families' fixed patterns (2:1, 5:1)


def test_gemma3_keys_a_file_may_lack_or_add(tmp_path, gguf_header):
    """Converters before `rope.freq_base_swa` wrote no local rope base: llama.cpp's, and every
    Gemma 3's, is 10000. A per-layer `sliding_window_pattern` is read where a file has one, and
    a file without a window has global layers only."""
    config = transformers.Gemma3TextConfig(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=512,
    )
    cfg = resolve_model(gguf_header(str(tmp_path / "a.gguf"), config, "gemma3", local_theta=False))
    assert cfg.hf_config.rope_parameters["sliding_attention"] == {
        "rope_type": "default",
        "rope_theta": 10000.0,
    }
    assert cfg.hf_config.layer_types == config.layer_types
    assert cfg.hf_config.layer_types.count("full_attention") == 2  # layers 5 and 11

    def alternate(writer):
        writer.add_sliding_window_pattern([True, False] * 6)

    cfg = resolve_model(gguf_header(str(tmp_path / "b.gguf"), config, "gemma3", edit=alternate))
    assert cfg.hf_config.layer_types == ["sliding_attention", "full_attention"] * 6

    config.sliding_window = None
    cfg = resolve_model(gguf_header(str(tmp_path / "c.gguf"), config, "gemma3")).hf_config
    assert cfg.sliding_window is None and set(cfg.layer_types) == {"full_attention"}


def test_phi3_without_longrope_and_what_is_refused(tmp_path, gguf_header):
    """Phi-4-mini's shape of file (a phi3 GGUF): a window of 0 is none, three quarters of each
    head rotate, no factors. Rope scaling it cannot state, or half of LongRoPE, is refused."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    config = transformers.Phi3Config(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        rope_parameters=rope,
        original_max_position_embeddings=4096,
    )
    cfg = resolve_model(gguf_header(str(tmp_path / "a.gguf"), config, "phi3")).hf_config
    assert cfg.sliding_window is None
    assert cfg.rope_parameters == rope
    assert cfg.original_max_position_embeddings == 4096

    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)

    def half(writer):
        writer.add_tensor("rope_factors_long.weight", np.ones(6, np.float32))

    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        resolve_model(gguf_header(str(tmp_path / "b.gguf"), config, "phi3", edit=yarn))
    with pytest.raises(ValueError, match="rope_factors_long"):
        resolve_model(gguf_header(str(tmp_path / "c.gguf"), config, "phi3", edit=half))


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

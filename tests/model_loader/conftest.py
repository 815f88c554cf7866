"""Fixtures for the model loader tests: the embedded SmolLM2 GGUF, tiny random transformers models
saved as safetensors directories, and tiny GGUF files written the way llama.cpp's converter
(convert_hf_to_gguf.py) writes them: its names from gguf-py's own tensor map, its q/k row order
for llama, Gemma's norms plus one, and each family's metadata keys.
"""

import math
import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from jllm.model_loader import ModelSource, resolve_model
from jllm.model_loader.gguf_io import unpermute_rope_rows
from jllm.model_loader.locate import default_model_path

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
}

# Each family's own settings: windows (8) shorter than the test prompts, Gemma 2's soft caps low
# enough to bind, Gemma 3's 5:1 pattern (llama.cpp's, the only one a GGUF holds) with linear
# scaling on its global layers, Phi-3's LongRoPE (short factors up to 32 positions) on half of
# each head. Gemma's query_pre_attn_scalar is the head dim, as llama.cpp assumes below 27B.
# Wide weights, so that random logits have clear winners.
_FAMILY = {
    "qwen3": {"head_dim": 32},
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "num_hidden_layers": 4,
        "sliding_window": 8,
        "attn_logit_softcapping": 4.0,
        "final_logit_softcapping": 8.0,
        "initializer_range": 0.25,
    },
    "gemma3": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "num_hidden_layers": 7,
        "sliding_window": 8,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        "initializer_range": 0.25,
    },
    "phi3": {
        "sliding_window": 8,
        "original_max_position_embeddings": 32,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.5, 2.0, 3.0, 5.0],
        },
        "initializer_range": 0.25,
    },
}

_GGUF_ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}


@pytest.fixture(scope="session")
def smollm_path() -> str:
    # No skip: `make test` installs the embedded model, and a missing one is a failure.
    return default_model_path()


@pytest.fixture(scope="session")
def smollm_source(smollm_path) -> ModelSource:
    return resolve_model(None)


def tiny_model(arch: str, *, tie: bool = False, seed: int = 0, **overrides):
    """A small random transformers causal LM of the given architecture (float32)."""
    config_cls, model_cls = _CONFIGS[arch]
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    kwargs.update(_FAMILY.get(arch, {}))
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # norms start at exactly 1: make them distinguishable
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_()
    return model


@pytest.fixture
def save_tiny(tmp_path, tokenizer_dir):
    """`save_tiny(arch, dtype=..., **config)` -> (model directory, torch model)."""

    def save(arch: str, dtype: torch.dtype = torch.float32, tie: bool = False, **kwargs):
        model = tiny_model(arch, tie=tie, **kwargs).to(dtype)
        path = tmp_path / f"{arch}-{str(dtype).removeprefix('torch.')}"
        model.save_pretrained(path)
        transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
        return str(path), model

    return save


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter for llama: each head's rows from [halves] to [interleaved pairs]."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


# Byte offsets of each block's float16 scales (given sane values; the rest is random bytes).
F16_AT = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype, rows: int, blocks: int, seed: int = 0, scale: float = 0.01):
    """Random bytes [rows, blocks * block_bytes] of a GGUF type, its f16 scales N(0, scale)."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    data = rng.integers(0, 256, (rows, blocks * size), dtype=np.uint8)
    view = data.reshape(rows, blocks, size)
    for at in F16_AT[qtype.name]:
        d = rng.normal(0, scale, (rows, blocks)).astype(np.float16)
        view[..., at : at + 2] = d.view(np.uint8).reshape(rows, blocks, 2)
    return data


def write_gguf(
    path: str,
    model,
    arch: str,
    *,
    rope_freqs: np.ndarray | None = None,
    matrix_type: str = "Q8_0",
    embedding_type: str = "F16",
    types: dict[str, str] | None = None,
    local_theta: bool = True,
) -> dict:
    """Write `model` as llama.cpp would; return `{hf_name: values the file holds, in HF order}`.

    2-D projection weights are stored as `matrix_type` (Q8_0), the embedding as
    `embedding_type` (F16) and the rest as F32, so the loader's dequantization is exercised;
    the returned values are what the file really holds. `types` overrides the type of single
    tensors by GGUF name; K-quant types (which gguf-py cannot quantize) are written as random
    blocks (`random_blocks`) instead of the model's values. `local_theta=False` leaves out Gemma
    3's local rope base, as converters before `rope.freq_base_swa` did.
    """
    config = model.config
    name_map = gguf.get_tensor_name_map(_GGUF_ARCHS[arch], config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    _write_hparams(writer, config, arch, local_theta)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))

    stored = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and (config.tie_word_embeddings or arch == "gemma2"):
            continue  # llama.cpp writes no output tensor for a tied head, nor Gemma 2's
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(stem)}.{suffix}"
        values = tensor.float().numpy()
        plus_one = arch.startswith("gemma") and hf_name.endswith("norm.weight")
        if plus_one:  # llama.cpp's RMSNorm scales by w, Gemma's by 1 + w
            values = values + np.float32(1.0)
        if values.ndim == 2:
            kind = embedding_type if name == "token_embd.weight" else matrix_type
            kind = (types or {}).get(name, kind)
            qtype = gguf.GGMLQuantizationType[kind]
            if kind in ("Q4_K", "Q6_K"):
                blocks = values.shape[1] // 256
                data = random_blocks(qtype, values.shape[0], blocks, seed=len(stored))
                stored[hf_name] = gguf.quants.dequantize(data, qtype)
                if arch == "llama" and name.split(".")[2] in ("attn_q", "attn_k"):
                    heads = config.num_attention_heads if ".attn_q." in name else None
                    heads = heads or config.num_key_value_heads
                    stored[hf_name] = unpermute_rope_rows(stored[hf_name], heads)
                writer.add_tensor(name, data, raw_dtype=qtype)
                continue
            # blocks run along rows, so quantizing commutes with the row permutation below
            stored[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)
        else:
            qtype = gguf.GGMLQuantizationType.F32
            stored[hf_name] = values - np.float32(1.0) if plus_one else values
        if arch == "llama" and ".attn_q." in name:
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            values = llama_cpp_permute(values, config.num_key_value_heads)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert os.path.getsize(path) > 0
    return stored


def _write_hparams(writer, config, arch: str, local_theta: bool) -> None:
    """The metadata keys llama.cpp's converter writes for `arch` (its TextModel base and the
    family's class), from the transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    if arch != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("llama", "qwen2", "qwen3"):
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_vocab_size(config.vocab_size)
    elif arch == "gemma2":  # no rope base: llama.cpp's default (10000) is Gemma 2's
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    elif arch == "gemma3":
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if local_theta:
            writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        if config.sliding_window:
            writer.add_sliding_window(config.sliding_window)
    else:
        _write_phi3_rope(writer, config, rope)


def _write_phi3_rope(writer, config, rope: dict) -> None:
    original = config.original_max_position_embeddings
    rotary = int(rope["partial_rotary_factor"] * config.hidden_size) // config.num_attention_heads
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("long_factor"):
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def write_gguf_header(path: str, config, arch: str, *, local_theta: bool = True, edit=None) -> str:
    """A GGUF of `config`'s metadata, `edit(writer)`'s additions and a zero embedding, no layers:
    enough for the config a file describes, at any model size."""
    writer = gguf.GGUFWriter(path, arch)
    _write_hparams(writer, config, arch, local_theta)
    if edit is not None:
        edit(writer)
    embedding = np.zeros((config.vocab_size, config.hidden_size), np.float32)
    writer.add_tensor("token_embd.weight", embedding)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def gguf_header():
    """`write_gguf_header` as a fixture, for test modules."""
    return write_gguf_header


@pytest.fixture
def gguf_writer():
    """`write_gguf` as a fixture, for test modules."""
    return write_gguf


@pytest.fixture
def gguf_blocks():
    """`random_blocks` as a fixture, for test modules."""
    return random_blocks


@pytest.fixture
def make_tiny():
    """`tiny_model` as a fixture, for test modules."""
    return tiny_model


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs the real SmolLM2 GGUF through an oracle")

"""bfloat16 on CPU: when `dtype="auto"` picks it, and a bf16 engine against transformers in
float32 on the same bf16 weights, teacher-forced on the tokens the engine chose."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch
from oracle import SMALL, assert_bf16_near_fp32, save_tiny

from jllm import LLM
from jllm.engine.platform import cpu_bf16_isa, min_dot_rows, resolve_dtype


def test_auto_dtype(caplog):
    # CPU: bf16 for 16-bit checkpoints when the CPU has AMX, AVX512-BF16, or AVX2 with FMA
    # (the float32 kernel widening bf16), else float32, with the reason in the log.
    with caplog.at_level("INFO", logger="jllm"):
        assert resolve_dtype("auto", "bfloat16", "cpu", isa="amx_bf16") == jnp.bfloat16
        assert "AMX-BF16" in caplog.text
        assert resolve_dtype("auto", "float16", "cpu", isa="avx512_bf16") == jnp.bfloat16
        assert "AVX512-BF16: bf16 ran W1" in caplog.text
        assert resolve_dtype("auto", "bfloat16", "cpu", isa="avx2") == jnp.bfloat16
        assert "the float32 kernel widens bf16" in caplog.text
        assert resolve_dtype("auto", "bfloat16", "cpu", isa=None) == jnp.float32
        assert "neither AMX, AVX512-BF16, nor AVX2 with FMA" in caplog.text
    assert resolve_dtype("auto", "float32", "cpu", isa="amx_bf16") == jnp.float32
    # Accelerators: the checkpoint's dtype, bf16 for float32 checkpoints.
    assert resolve_dtype("auto", "float32", "tpu") == jnp.bfloat16
    assert resolve_dtype("auto", "float16", "gpu") == jnp.float16
    # An explicit dtype is what you get.
    assert resolve_dtype("float32", "bfloat16", "cpu", isa="amx_bf16") == jnp.float32
    assert resolve_dtype("bfloat16", "float32", "cpu", isa=None) == jnp.bfloat16
    # 16-bit models on CPU never run a one-row step (XLA's 1-row bf16 products are slow).
    assert min_dot_rows(jnp.bfloat16, "cpu") == 2
    assert min_dot_rows(jnp.float32, "cpu") == 1
    assert min_dot_rows(jnp.bfloat16, "tpu") == 1


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory, tokenizer_dir):
    return save_tiny("llama", tmp_path_factory.mktemp("bf16"), tokenizer_dir, torch.bfloat16)


@pytest.mark.parametrize(
    "flags,kernel,want",
    [
        ({"avx2", "fma", "avx512_bf16", "amx_bf16"}, True, "amx_bf16"),
        ({"avx2", "fma", "avx512f", "avx512_bf16"}, True, "avx512_bf16"),
        ({"avx2", "fma"}, True, "avx2"),
        ({"avx2", "fma"}, False, None),  # the float32 kernel did not build
        ({"avx2"}, True, None),  # no FMA
        ({"sse4_2"}, True, None),
    ],
)
def test_cpu_bf16_isa(monkeypatch, flags, kernel, want):
    from jllm.engine import platform
    from jllm.models import f32_matmul

    monkeypatch.setattr(platform, "cpu_flags", lambda: flags)
    monkeypatch.setattr(f32_matmul, "cpu_flags", lambda: flags)
    monkeypatch.setattr(f32_matmul, "enabled", lambda: kernel)
    assert cpu_bf16_isa() == want


def test_auto_dtype_of_a_bf16_checkpoint(bf16_llama):
    llm = LLM(bf16_llama, **SMALL)
    assert llm.llm_engine.dtype == (jnp.bfloat16 if cpu_bf16_isa() else jnp.float32)


def test_bf16_engine_against_fp32_oracle(bf16_llama):
    """Greedy choices stay the float32 argmax (or within bf16's error of it) and the reported
    logprobs stay within bf16's error, for a batch and for a prompt decoding alone (a 1-row
    step padded to 2 rows)."""
    llm = LLM(bf16_llama, dtype="bfloat16", **SMALL)
    assert llm.llm_engine.runner.layout.decode_buckets[:2] == [0, 2]
    assert_bf16_near_fp32(llm, bf16_llama)

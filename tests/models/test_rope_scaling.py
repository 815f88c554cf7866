"""RoPE frequency scaling (models/rope.py) against transformers' own computation: YaRN as
Qwen configures it for long contexts, with DeepSeek's mscale and mscale_all_dim, without
truncation (gpt-oss), over a partial rotary share; the same frequencies and cos/sin scale."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jllm.models.rope import RopeConfig

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
CASES = {
    "qwen": (transformers.Qwen2Config, {**YARN, "original_max_position_embeddings": 4096}),
    "deepseek": (
        transformers.DeepseekV3Config,
        {
            **YARN,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    "deepseek-mscale": (
        transformers.DeepseekV3Config,
        {**YARN, "original_max_position_embeddings": 2048, "mscale": 0.707, "mscale_all_dim": 1},
    ),
    "untruncated": (
        transformers.Qwen2Config,
        {**YARN, "original_max_position_embeddings": 4096, "truncate": False, "beta_fast": 16},
    ),
    "no-original": (transformers.Qwen2Config, {**YARN, "factor": None}),
    "given-factor": (
        transformers.Qwen2Config,
        {**YARN, "original_max_position_embeddings": 1024, "attention_factor": 1.3},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_yarn_matches_transformers(name):
    cls, params = CASES[name]
    extra = {"original_max_position_embeddings": 1024} if name == "no-original" else {}
    hf = cls(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=16384,
        rope_parameters=params,
        **extra,
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf)
    head = getattr(hf, "qk_rope_head_dim", None) or hf.hidden_size // hf.num_attention_heads
    ours = RopeConfig.from_hf(hf, head)
    np.testing.assert_allclose(ours.inv_freq, inv_freq.numpy(), rtol=2e-6)
    assert ours.attention_scaling == pytest.approx(scaling, rel=1e-6)

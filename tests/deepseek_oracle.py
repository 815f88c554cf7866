"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers (float32), for the family's
tests (tests/models/test_deepseek.py) and the FP8 checkpoints' (tests/model_loader/
test_fp8_checkpoints.py)."""

from __future__ import annotations

import torch
import transformers

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,  # with kv_lora_rank, the GPU kernel's two loads
    v_head_dim=16,
    n_shared_experts=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,
    tie_word_embeddings=False,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
V3 = (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
V2 = (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
VARIANTS = {
    "v3-q-lora": (V3, dict(q_lora_rank=32, n_group=4, topk_group=2)),
    "v3-yarn": (V3, dict(q_lora_rank=None, n_group=2, topk_group=1, rope_parameters=YARN)),
    "v2": (V2, dict(q_lora_rank=None, topk_method="greedy")),
}


def save_tiny(
    variant: str, path, tokenizer_dir, dtype=torch.float32, bias_std=0.3, **overrides
) -> str:
    """A tiny random checkpoint of `variant` (VARIANTS, its config fields `overrides`d) with
    non-trivial norms and a correction bias that matters (of spread `bias_std`), saved in
    `dtype` with a tokenizer at `path`."""
    (config_cls, model_cls), extra = VARIANTS[variant]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, bias_std)
    model.to(dtype).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)

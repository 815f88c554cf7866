"""Qwen3-Next GGUF files (llama.cpp's `qwen3next`), written from a tiny random transformers
checkpoint the way llama.cpp's converter (convert_hf_to_gguf.py, Qwen3NextModel) writes
them: `A_log` as `ssm_a` = -exp(A_log), `dt_bias` as `ssm_dt.bias`, the conv taps squeezed,
the norms that scale by 1 + w stored as 1 + w (not the DeltaNet's gated norm), the fused
in_proj_qkvz split into `attn_qkv` (all q, all k, all v) and `attn_gate` (or whole, as
`ssm_in`, as converters before that split wrote it), each layer's experts stacked, and the
`ssm.*` keys. Loaded, they give the source's tensors and config, and the source model's
greedy tokens and logprobs (transformers, float32); kept quantized (Q8_0), the tokens of the
file dequantized on load."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
import transformers
from model_loader.test_gguf_deepseek import checkpoint, write_tensors, write_text_keys
from models.test_qwen3_next import VOCAB, save_hybrid
from oracle import SMALL, assert_matches, prompt_ids

from jllm import LLM, SamplingParams
from jllm.model_loader import resolve_model
from jllm.quantization.weights import QuantizedWeight

PROMPTS = prompt_ids(2, 6, vocab=VOCAB) + prompt_ids(1, 40, seed=1, vocab=VOCAB)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
FIELDS = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "tie_word_embeddings",
    "layer_types",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "mlp_only_layers",
    "norm_topk_prob",
]


def write_qwen3next_gguf(path: str, source: str, *, legacy: bool = False, quantize=False):
    """The checkpoint at `source` as llama.cpp's converter writes it (F32, or Q8_0 for each
    matrix whose rows are whole blocks of 32); `legacy`: in_proj_qkvz whole (`ssm_in`)."""
    cfg = transformers.AutoConfig.from_pretrained(source)
    L, Hk, K = cfg.num_hidden_layers, cfg.linear_num_key_heads, cfg.linear_key_head_dim
    Hv, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    rope = cfg.rope_parameters
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, L)
    w = gguf.GGUFWriter(path, "qwen3next")
    write_text_keys(w, cfg, cfg.num_key_value_heads)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    # Qwen3NextModel's
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(K)
    w.add_ssm_group_count(Hk)
    w.add_ssm_time_step_rank(Hv)
    w.add_ssm_inner_size(V * Hv)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))

    tensors, experts = {}, {}
    for name, values in checkpoint(source).items():
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            stem, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".", 1)
            experts.setdefault(f"{stem}.mlp.experts.{proj}", {})[int(e)] = values
        elif name.endswith(".A_log"):
            tensors[name] = -np.exp(values)
        elif name.endswith(".dt_bias"):
            tensors[name.replace("dt_bias", "dt_proj.bias")] = values
        elif "conv1d" in name:
            tensors[name] = values.squeeze(1)  # [C, 1, J] -> [C, J]
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensors[name] = values + np.float32(1.0)
        elif name.endswith("in_proj_qkvz.weight") and not legacy:
            D, r = values.shape[1], Hv // Hk
            g = values.reshape(Hk, -1, D)  # per key head: q, k, r values, r gates
            q, k, v, z = np.split(g, [K, 2 * K, 2 * K + r * V], axis=1)
            qkv = np.concatenate([x.reshape(-1, D) for x in (q, k, v)])
            tensors[name.replace("in_proj_qkvz", "in_proj_qkv")] = qkv
            tensors[name.replace("in_proj_qkvz", "in_proj_z")] = z.reshape(-1, D)
        else:
            tensors[name] = values
    for name, by_expert in experts.items():
        tensors[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    # the routers F32, as the converter forces them
    write_tensors(w, names, tensors, quantize, floats=("mlp.gate.", "shared_expert_gate"))


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer_dir) -> dict[str, tuple[str, str]]:
    """ "split" / "legacy" -> (the source checkpoint's directory, its F32 GGUF file)."""
    root = tmp_path_factory.mktemp("qwen3next-gguf")
    # every layer sparse, as the released model (llama.cpp's qwen3next has no dense MLP)
    source = save_hybrid("qwen3_next", root, tokenizer_dir, mlp_only_layers=[])
    out = {}
    for case in ("split", "legacy"):
        path = str(root / f"{case}.gguf")
        write_qwen3next_gguf(path, source, legacy=case == "legacy")
        out[case] = source, path
    return out


@pytest.mark.parametrize("case", ["split", "legacy"])
def test_tensors_and_config_are_the_sources(files, case):
    source, path = files[case]
    loaded = resolve_model(path)
    got = dict(loaded.iter_weights())
    want = checkpoint(source)
    assert sorted(got) == sorted(want)
    for name, array in got.items():  # A_log back through log(-(-exp)), norms through +1 - 1
        np.testing.assert_allclose(array, want[name], rtol=1e-6, atol=1e-6, err_msg=name)
    cfg, src = loaded.hf_config, transformers.AutoConfig.from_pretrained(source)
    assert type(cfg) is type(src) and cfg.architectures == src.architectures
    for field in FIELDS:
        assert getattr(cfg, field) == pytest.approx(getattr(src, field)), field
    for key in ("rope_theta", "partial_rotary_factor"):
        assert cfg.rope_parameters[key] == pytest.approx(src.rope_parameters[key]), key


def test_generates_as_its_source(files):
    source, path = files["split"]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **SMALL)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    assert_matches(oracle, PROMPTS, outs)


def test_kept_quantized_as_dequantized_on_load(files, tmp_path):
    """Q8_0 matrices kept as codes (quantization="gguf"; attn_qkv and attn_gate, which the
    loader regroups, dequantized), on one device and split over two: the tokens of the same
    file dequantized on load."""
    source, _ = files["split"]
    path = str(tmp_path / "q8.gguf")
    write_qwen3next_gguf(path, source, quantize=True)
    args = {"dtype": "float32", "skip_tokenizer_init": True, **SMALL}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = LLM(path, **args).generate(prompts, GREEDY, use_tqdm=False)
    for extra in ({}, {"tensor_parallel_size": 2}):
        kept = LLM(path, quantization="gguf", **args, **extra)
        got = kept.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    leaves = jax.tree.leaves(
        kept.llm_engine.runner.state, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )
    assert sum(isinstance(w, QuantizedWeight) for w in leaves) >= 4

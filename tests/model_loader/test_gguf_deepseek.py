"""DeepSeek GGUF files (llama.cpp's `deepseek2`), written from tiny random transformers
checkpoints the way llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) writes
them: MLA as one shared KV head with kv_b_proj split into `attn_k_b` (transposed) and
`attn_v_b` (or whole, as converters before the split wrote it), each layer's experts stacked
into one tensor, the correction bias as `exp_probs_b.bias`, the MoE and MLA keys. Loaded, they
give the source's tensors and config, and the source model's greedy tokens and logprobs
(transformers, float32); kept quantized (Q8_0), the tokens of the file dequantized on load."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
import transformers
from deepseek_oracle import YARN, save_tiny
from model_loader.test_gguf import CONFIG_FIELDS
from oracle import SMALL, assert_matches, eager, prompt_ids
from safetensors.numpy import load_file

from jllm import LLM, SamplingParams
from jllm.model_loader import resolve_model
from jllm.quantization.weights import QuantizedWeight

PROMPTS = prompt_ids(2, 6, vocab=512) + prompt_ids(1, 40, seed=1, vocab=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
# llama.cpp rotates YaRN's lanes with no magnitude correction: transformers' with mscale equal
# to mscale_all_dim, as DeepSeek's released configs have them.
EQUAL_MSCALE = {"rope_parameters": {**YARN, "mscale": YARN["mscale_all_dim"]}}
# (variant, config overrides, kv_b_proj split as the current converter writes it)
CASES = {
    "v3-q-lora": ("v3-q-lora", {}, True),
    "v3-yarn-whole-kv-b": ("v3-yarn", EQUAL_MSCALE, False),
    "v2": ("v2", {}, True),
}
# transformers' fields every GGUF config states (rope_parameters compared below: the file
# keeps YaRN's own parameters, not the defaults transformers adds), and MLA's and the MoE's.
FIELDS = [f for f in CONFIG_FIELDS if f != "rope_parameters"] + [
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "norm_topk_prob",
]


def checkpoint(source: str) -> dict[str, np.ndarray]:
    """The source's tensors, as its safetensors file names them (one per expert)."""
    return load_file(f"{source}/model.safetensors")


def write_text_keys(w, cfg, num_kv_heads: int) -> None:
    """The keys llama.cpp's TextModel writes for every architecture."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(num_kv_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for kind in ("bos", "eos", "pad"):  # the special vocabulary's ids
        if getattr(cfg, f"{kind}_token_id") is not None:
            getattr(w, f"add_{kind}_token_id")(getattr(cfg, f"{kind}_token_id"))


def write_deepseek_gguf(
    path: str, source: str, *, split_kv_b: bool, quantize: bool = False, edit=None, drop=()
) -> None:
    """The checkpoint at `source` (but its tensors `drop`) as llama.cpp's converter writes
    it (F32, or Q8_0 for each matrix whose rows are whole blocks of 32: the attention's
    projections and the experts); `edit(writer)` adds keys."""
    cfg = transformers.AutoConfig.from_pretrained(source)
    L, N = cfg.num_hidden_layers, cfg.num_attention_heads
    R, r, h, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    v3 = cfg.model_type == "deepseek_v3"
    rope = cfg.rope_parameters
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, L)
    w = gguf.GGUFWriter(path, "deepseek2")
    # num_key_value_heads is 1 once MLA is one shared head
    write_text_keys(w, cfg, 1 if split_kv_b else N)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if v3:  # transformers' V2 config has no scoring function: llama.cpp assumes softmax
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    # DeepseekV2Model's
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(R)
    if split_kv_b:
        w.add_key_length(R + r)
        w.add_value_length(R)
        w.add_key_length_mla(h + r)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(h + r)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(r)
    if edit is not None:
        edit(w)

    tensors, experts = {}, {}
    for name, values in checkpoint(source).items():
        if name in drop:
            continue
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            stem, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".", 1)
            experts.setdefault(f"{stem}.mlp.experts.{proj}", {})[int(e)] = values
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = values.reshape(N, h + v, R)
            tensors[name.replace("kv_b_proj", "k_b_proj")] = kv_b[:, :h].transpose(0, 2, 1)
            tensors[name.replace("kv_b_proj", "v_b_proj")] = kv_b[:, h:]
        elif name.endswith("e_score_correction_bias"):
            tensors[name.removesuffix("_bias") + ".bias"] = values
        else:
            tensors[name] = values
    for name, by_expert in experts.items():
        tensors[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    write_tensors(w, names, tensors, quantize)


def write_tensors(w, names, tensors: dict, quantize: bool, floats=("mlp.gate.",)) -> None:
    """Add the transformers-named `tensors` under llama.cpp's `names` (F32, or Q8_0 for
    each matrix whose rows are whole blocks of 32 but the embedding and those named in
    `floats`, which the converter keeps F32) and write the file. A name without a suffix
    (Qwen3-Next's `ssm_a`) maps whole."""
    for name, values in tensors.items():
        stem, suffix = name.rsplit(".", 1)
        if suffix in ("weight", "bias"):
            gguf_name = f"{names.get_name(stem)}.{suffix}"
        else:
            gguf_name = names.get_name(name)
        matrix = values.ndim >= 2 and "embed" not in name and not any(f in name for f in floats)
        kind = "Q8_0" if quantize and matrix and values.shape[-1] % 32 == 0 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(gguf_name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer_dir) -> dict[str, tuple[str, str]]:
    """case -> (the source checkpoint's directory, its F32 GGUF file)."""
    root = tmp_path_factory.mktemp("deepseek-gguf")
    out = {}
    for case, (variant, overrides, split) in CASES.items():
        source = save_tiny(variant, root / case, tokenizer_dir, **overrides)
        path = str(root / f"{case}.gguf")
        write_deepseek_gguf(path, source, split_kv_b=split)
        out[case] = source, path
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_tensors_and_config_are_the_sources(files, case):
    source, path = files[case]
    loaded = resolve_model(path)
    got = dict(loaded.iter_weights())
    want = checkpoint(source)
    assert sorted(got) == sorted(want)
    for name, array in got.items():
        np.testing.assert_array_equal(array, want[name], err_msg=name)

    cfg, src = loaded.hf_config, transformers.AutoConfig.from_pretrained(source)
    assert type(cfg) is type(src) and cfg.architectures == src.architectures
    for field in FIELDS:
        assert getattr(cfg, field) == pytest.approx(getattr(src, field)), field
    if src.model_type == "deepseek_v3":
        assert (cfg.n_group, cfg.topk_group) == (src.n_group, src.topk_group)
    else:
        assert cfg.topk_method == src.topk_method == "greedy"
    rope = src.rope_parameters
    for key in ("rope_type", "rope_theta", "factor", "mscale", "mscale_all_dim"):
        assert cfg.rope_parameters.get(key) == pytest.approx(rope.get(key)), key


@pytest.mark.parametrize("case", list(CASES))
def test_generates_as_its_source(files, case):
    source, path = files[case]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **SMALL)
    kv = llm.llm_engine.scheduler.kv_cache
    assert [spec.describe() for spec in kv.specs] == ["MLA latent 16+16"]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_matches(eager(source), PROMPTS, outs)


def test_kept_quantized_as_dequantized_on_load(files, tmp_path):
    """Q8_0 matrices kept as codes (quantization="gguf"), on one device and with the heads
    and experts split over two: the tokens of the same file dequantized on load."""
    source, _ = files["v3-q-lora"]
    path = str(tmp_path / "q8.gguf")
    write_deepseek_gguf(path, source, split_kv_b=True, quantize=True)
    args = {"dtype": "float32", "skip_tokenizer_init": True, **SMALL}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = LLM(path, **args).generate(prompts, GREEDY, use_tqdm=False)
    for extra in ({}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}):
        kept = LLM(path, quantization="gguf", **args, **extra)
        got = kept.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    leaves = jax.tree.leaves(
        kept.llm_engine.runner.state, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )
    assert sum(isinstance(w, QuantizedWeight) for w in leaves) >= 4  # per segment


def test_what_is_refused(files, tmp_path, make_tiny, gguf_header):
    """A sigmoid router without its correction bias (no DeepSeek checkpoint has one), the
    multi-token-prediction layers, which jllm reads from safetensors only, and the experts
    of other architectures (Mixtral's, which llama.cpp writes as `llama`)."""
    mixtral = str(tmp_path / "mixtral.gguf")
    gguf_header(mixtral, make_tiny("llama").config, "llama", edit=lambda w: w.add_expert_count(8))
    with pytest.raises(ValueError, match="mixture-of-experts GGUF of architecture 'llama'"):
        resolve_model(mixtral).hf_config  # noqa: B018
    source, _ = files["v3-q-lora"]
    biases = [n for n in checkpoint(source) if n.endswith("e_score_correction_bias")]
    path = str(tmp_path / "unbiased.gguf")
    write_deepseek_gguf(path, source, split_kv_b=True, drop=biases)
    with pytest.raises(ValueError, match="correction bias"):
        resolve_model(path).hf_config  # noqa: B018
    path = str(tmp_path / "nextn.gguf")
    nextn = lambda w: w.add_nextn_predict_layers(1)  # noqa: E731
    write_deepseek_gguf(path, source, split_kv_b=True, edit=nextn)
    with pytest.raises(ValueError, match="multi-token-prediction"):
        resolve_model(path).hf_config  # noqa: B018

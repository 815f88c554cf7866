"""gpt-oss GGUF files (llama.cpp's `gpt-oss`), written from a tiny random transformers
checkpoint the way llama.cpp's converter (GptOssModel) writes them: the sinks as
`attn_sinks.weight`, each layer's stacked experts transposed to [E, Out, In] with the
interleaved gate/up columns cut apart (`ffn_gate_exps`, `ffn_up_exps`) or fused gate rows
first (`ffn_gate_up_exps`), biases alike, the router as `ffn_gate_inp`, and the experts in
MXFP4 as the released files hold them (or F32). Loaded, they give the source's tensors and
config (MXFP4 experts kept in 4 bits, as an mxfp4 checkpoint's), and the greedy tokens and
logprobs of transformers (float32) on the values the file holds."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from model_loader.test_gguf_deepseek import checkpoint, write_text_keys
from models.test_gpt_oss import VOCAB, save_gpt_oss
from oracle import SMALL, assert_matches, prompt_ids

from jllm import LLM, SamplingParams
from jllm.model_loader import resolve_model
from jllm.models.gpt_oss import regroup
from jllm.quantization.weights import QuantizedWeight, dequantize

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
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "attention_bias",
]
PARTS = {  # transformers' layer module -> llama.cpp's part
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.sinks": "attn_sinks",
    "mlp.router": "ffn_gate_inp",
    **{f"mlp.experts.{p}_proj": f"ffn_{p}_exps" for p in ("gate", "up", "down", "gate_up")},
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem in TOP:
        return f"{TOP[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{PARTS[module]}.{suffix}"


def write_gpt_oss_gguf(path: str, source: str, *, mxfp4: bool, fused: bool = False) -> dict:
    """The checkpoint at `source` as llama.cpp's converter writes it; returns the source's
    tensors with the experts' weights as the file holds them (MXFP4 rounds them)."""
    cfg = transformers.AutoConfig.from_pretrained(source)
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(path, "gpt-oss")
    write_text_keys(w, cfg, cfg.num_key_value_heads)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(cfg.sliding_window)  # GptOssModel's
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    source_tensors = checkpoint(source)
    held = dict(source_tensors)

    def add(name, values, expert_matrix=False):
        qtype = MXFP4 if mxfp4 and expert_matrix else gguf.GGMLQuantizationType.F32
        data = gguf.quants.quantize(np.ascontiguousarray(values, np.float32), qtype)
        w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        return gguf.quants.dequantize(data, qtype)

    for name, values in source_tensors.items():
        stem = name.split(".experts.")[0]  # model.layers.L.mlp
        if name.endswith("self_attn.sinks"):
            add(name + ".weight", values)
        elif name.endswith("mlp.experts.gate_up_proj"):
            t = values.transpose(0, 2, 1)  # [E, 2F, D], gate and up rows interleaved
            gate, up = t[:, ::2], t[:, 1::2]
            if fused:
                both = add(
                    f"{stem}.experts.gate_up_proj.weight", np.concatenate([gate, up], 1), True
                )
                gate, up = np.split(both, 2, axis=1)
            else:
                gate = add(f"{stem}.experts.gate_proj.weight", gate, True)
                up = add(f"{stem}.experts.up_proj.weight", up, True)
            stacked = np.empty_like(t)
            stacked[:, ::2], stacked[:, 1::2] = gate, up
            held[name] = stacked.transpose(0, 2, 1)
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            gate, up = values[..., ::2], values[..., 1::2]
            if fused:
                add(f"{stem}.experts.gate_up_proj.bias", np.concatenate([gate, up], -1))
            else:
                add(f"{stem}.experts.gate_proj.bias", gate)
                add(f"{stem}.experts.up_proj.bias", up)
        elif name.endswith("mlp.experts.down_proj"):
            down = add(f"{stem}.experts.down_proj.weight", values.transpose(0, 2, 1), True)
            held[name] = down.transpose(0, 2, 1)
        elif name.endswith("mlp.experts.down_proj_bias"):
            add(f"{stem}.experts.down_proj.bias", values)
        else:
            add(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer_dir) -> dict:
    """case -> (the source's directory, its GGUF, the tensors the file holds)."""
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    # llama.cpp keeps gpt-oss's clamp (7.0) in code, not in the file: the source's too
    source = save_gpt_oss(root, tokenizer_dir, swiglu_limit=7.0)
    out = {}
    for case, kwargs in {
        "f32": dict(mxfp4=False),
        "mxfp4": dict(mxfp4=True),
        "fused": dict(mxfp4=True, fused=True),
    }.items():
        path = str(root / f"{case}.gguf")
        out[case] = source, path, write_gpt_oss_gguf(path, source, **kwargs)
    return out


@pytest.mark.parametrize("case", ["f32", "mxfp4", "fused"])
def test_tensors_and_config_are_the_sources(files, case):
    source, path, held = files[case]
    loaded = resolve_model(path)
    got = dict(loaded.iter_weights())
    want = dict(regroup(held.items()))
    assert sorted(got) == sorted(want)
    kept = 0
    for name, array in got.items():
        if isinstance(array, QuantizedWeight):  # MXFP4 experts stay in 4 bits
            assert array.kind == "mxfp4" and case != "f32"
            array, kept = np.asarray(dequantize(array, jnp.float32)), kept + 1
        np.testing.assert_allclose(array, want[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert kept == (0 if case == "f32" else 3 * 8 * 4)  # 3 projections, 8 experts, 4 layers
    cfg, src = loaded.hf_config, transformers.AutoConfig.from_pretrained(source)
    assert type(cfg) is type(src) and cfg.architectures == src.architectures
    for field in FIELDS:
        assert getattr(cfg, field) == pytest.approx(getattr(src, field)), field
    for key, value in src.rope_parameters.items():
        assert cfg.rope_parameters[key] == pytest.approx(value), key


@pytest.mark.parametrize("case", ["f32", "mxfp4"])
def test_generates_as_transformers_on_the_file_s_values(files, case):
    """The MXFP4 file loads as an mxfp4 checkpoint: its experts held in 4 bits."""
    source, path, held = files[case]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **SMALL)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    oracle.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in held.items()})
    assert_matches(oracle, PROMPTS, outs)
    leaves = jax.tree.leaves(
        llm.llm_engine.runner.state, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )
    kinds = {w.kind for w in leaves if isinstance(w, QuantizedWeight)}
    assert kinds == (set() if case == "f32" else {"mxfp4"})
    if case == "mxfp4":
        with pytest.raises(ValueError, match="mxfp4"):
            LLM(path, quantization="gguf", skip_tokenizer_init=True, **SMALL)

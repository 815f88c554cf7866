"""Weight updates crossed with the rest of the engine. Each engine starts from nothing
(`load_format="dummy"`, random weights) and takes a real checkpoint's weights as its first
update, then matches transformers on them (float32: greedy tokens, logprobs within 1e-4):
mixtures of experts (per-expert tensors into the stacked experts; expert parallel across two
devices; a shared expert), pipeline stages, n-gram speculation, chunked prefill under
preemption; and an update in the middle of a request under async scheduling. LoRA's cross
is tests/lora/test_lora_updates.py."""

from __future__ import annotations

import pytest
from oracle import SMALL, assert_matches, eager, generate, oracle_tokens, prompt_ids
from transformers.core_model_loading import revert_weight_conversion

from jllm import LLM, SamplingParams

PROMPTS = prompt_ids(3, 20, seed=4)


def push(llm, model, version=None) -> None:
    """`model`'s weights at its checkpoint's names: transformers fuses a layer's experts
    in memory (`mlp.experts.gate_up_proj`), and gives back the names it saves with."""
    state = revert_weight_conversion(model, model.state_dict())
    llm.start_weight_update()
    llm.update_weights((k, v.numpy()) for k, v in state.items())
    llm.finish_weight_update(version)


@pytest.mark.parametrize(
    "arch, settings",
    [
        ("mixtral", {}),
        ("mixtral", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
        ("qwen2-moe", {}),
        ("llama-l4", {"pipeline_parallel_size": 2}),
        (
            "llama",
            {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3,
                }
            },
        ),
        ("llama", {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 8}),
    ],
    ids=["moe", "moe-ep2", "shared-expert", "pp2", "ngram", "chunked-preempting"],
)
def test_an_engine_from_nothing_takes_its_weights_from_an_update(tiny_models, arch, settings):
    path = tiny_models[arch]
    llm = LLM(path, **{**SMALL, **settings}, dtype="float32", load_format="dummy")
    model = eager(path)
    push(llm, model)
    assert_matches(model, PROMPTS, generate(llm, PROMPTS))


def test_an_update_mid_request_under_async_scheduling(tiny_models):
    """The step in flight when the update lands was dispatched with the old weights: its
    tokens carry the old version, the next step's the new one."""
    path = tiny_models["llama"]
    llm = LLM(path, **SMALL, dtype="float32", load_format="dummy", async_scheduling=True)
    assert llm.llm_engine.core.async_scheduling
    model = eager(path)
    push(llm, model, "real")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("r", *engine.prepare({"prompt_token_ids": PROMPTS[0]}, params))
    done = []
    for _ in range(4):
        done += [o for o in engine.step() if o.finished]
    push(llm, model, "again")  # the same weights: the tokens stay the oracle's
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    out = done[0].outputs[0]
    spans = [(s.version, s.start, s.end) for s in out.weight_versions]
    assert [v for v, _, _ in spans] == ["real", "again"] and spans[-1][2] == 10
    assert list(out.token_ids) == oracle_tokens(model, PROMPTS[:1], 10)[0]


def _llama4_dir(root, tokenizer_dir) -> str:
    import torch
    import transformers
    from models.test_llama4 import SHAPE

    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**SHAPE)).eval()
    model.save_pretrained(root / "llama4")
    return str(root / "llama4")


@pytest.mark.parametrize("family", ["llama4", "gpt-oss"])
def test_a_family_that_regroups_takes_its_own_checkpoint(family, tmp_path, tokenizer_dir):
    """The checkpoint's own tensors, as its files hold them, take the loader's road: Llama
    4's q/k rows reordered for its rotation, gpt-oss's stacked experts cut per expert. Two
    chunks (attention, the rest); the engine from nothing then matches transformers."""
    from models.test_gpt_oss import save_gpt_oss
    from safetensors.numpy import load_file

    if family == "llama4":
        path = _llama4_dir(tmp_path, tokenizer_dir)
    else:
        path = save_gpt_oss(tmp_path, tokenizer_dir)
    tensors = load_file(f"{path}/model.safetensors")
    llm = LLM(path, **SMALL, dtype="float32", load_format="dummy", skip_tokenizer_init=True)
    llm.start_weight_update()
    llm.update_weights({k: v for k, v in tensors.items() if "self_attn" in k})
    llm.update_weights({k: v for k, v in tensors.items() if "self_attn" not in k})
    llm.finish_weight_update()
    prompts = prompt_ids(2, 20, seed=4, vocab=512)
    assert_matches(eager(path), prompts, generate(llm, prompts))

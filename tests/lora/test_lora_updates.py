"""LoRA crossed with weight updates: an engine with LoRA slots starts from random weights
(`load_format="dummy"`), takes the base model's weights as an update, and then serves the
base and each adapter as PEFT's merged models do; the adapters' slots are untouched by the
update."""

from __future__ import annotations

from lora_oracle import oracle
from oracle import SMALL, eager, prompt_ids

from jllm import LLM, SamplingParams
from jllm.lora.request import LoRARequest


def test_adapters_apply_over_updated_base_weights(llama_dir, adapters):
    llm = LLM(
        llama_dir,
        **SMALL,
        dtype="float32",
        load_format="dummy",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    llm.start_weight_update()
    llm.update_weights((k, v.numpy()) for k, v in eager(llama_dir).state_dict().items())
    llm.finish_weight_update()
    prompts = prompt_ids(4, 9, seed=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    names = [None, "all8", "attn4", "all8"]
    requests = [
        None if n is None else LoRARequest(n, i + 1, adapters[n][0]) for i, n in enumerate(names)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, requests)
    for i, name in enumerate(names):
        model_dir = llama_dir if name is None else adapters[name][1]
        assert oracle(model_dir, prompts[i : i + 1], outs[i : i + 1]) < 2e-3

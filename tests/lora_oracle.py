"""The LoRA tests' oracle: adapters made by PEFT on the tiny Llama (random, non-zero B), and
transformers running each merged into the base model."""

from __future__ import annotations

import shutil

import peft
import torch
import transformers
from oracle import teacher_forced_logprobs

from jllm import LLM, SamplingParams
from jllm.lora.request import LoRARequest

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = {  # name: (rank, alpha, targets, rsLoRA)
    "all8": (
        8,
        16,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        False,
    ),
    "attn4": (4, 8, ["q_proj", "v_proj"], False),
    "mlp16": (16, 32, ["gate_proj", "up_proj", "down_proj"], True),
}


def make_adapter(base_dir, root, name, r, alpha, targets, rslora=False, seed=100) -> tuple:
    """A PEFT adapter on the model at `base_dir` (random A and B, scaled up so outputs
    really change): (its folder, the merged model's folder: the oracle)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        init_lora_weights=False,  # random A and B: a real delta
        use_rslora=rslora,
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # deltas the size of the weights: outputs really change
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.mul_(3.0)
    model.save_pretrained(root / name)
    merged = model.merge_and_unload()
    merged.save_pretrained(root / f"{name}-merged")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{base_dir}/{f}", root / f"{name}-merged")
    return str(root / name), str(root / f"{name}-merged")


def make_adapters(llama_dir, root, names=tuple(ADAPTERS)):
    """Each adapter's PEFT folder and the merged model's folder (the oracle)."""
    return {
        name: make_adapter(llama_dir, root, name, r, alpha, targets, rslora, seed=100 + i)
        for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items())
        if name in names
    }


def oracle(model_dir, prompts, outs):
    """transformers' greedy tokens for `prompts`, and the engine's worst logprob error
    teacher-forced on its own tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    worst = 0.0
    for ids, out in zip(prompts, outs, strict=True):
        gen = out.outputs[0]
        with torch.no_grad():
            want = model.generate(
                torch.tensor([ids]),
                max_new_tokens=len(gen.token_ids),
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert gen.token_ids == want
        ref = teacher_forced_logprobs(model, ids, gen.token_ids)
        for step, token in enumerate(gen.token_ids):
            worst = max(worst, abs(gen.logprobs[step][token].logprob - ref[step, token].item()))
    return worst


def lora_requests(names, adapters) -> list:
    """One LoRARequest per adapter name (None: the base model), ids by position."""
    return [
        None if n is None else LoRARequest(n, i + 1, adapters[n][0]) for i, n in enumerate(names)
    ]


def assert_each_matches_merged(base_dir, adapters, names, prompts, outs) -> None:
    """Each output (its request under adapter `names[i]`, None: the base model at
    `base_dir`) equals its merged model's, within 2e-3 in logprobs."""
    for i, name in enumerate(names):
        model_dir = base_dir if name is None else adapters[name][1]
        assert oracle(model_dir, prompts[i : i + 1], outs[i : i + 1]) < 2e-3


def assert_attention_adapter_matches(model_dir, root, prompts, settings):
    """An adapter on q/k/v/o made by PEFT on the model at `model_dir`, served mixed with the
    base model in one batch (an engine of `settings`, one slot): each request equals its
    merged model. Returns the engine."""
    adapter = make_adapter(model_dir, root, "attn", 8, 16, ATTENTION)
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8, **settings)
    names = [None, "attn", None, "attn"][: len(prompts)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    requests = lora_requests(names, {"attn": adapter})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, requests)
    assert_each_matches_merged(model_dir, {"attn": adapter}, names, prompts, outs)
    return llm

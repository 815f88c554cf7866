"""hf_overrides (and the seeds' --rope-theta / --rope-scaling folded into it) change the model
as the same change to transformers' config does: greedy tokens equal the oracle's built
with that config, and differ from the unchanged model's."""

from __future__ import annotations

from oracle import SMALL, eager, oracle_tokens, prompt_ids

from jllm import LLM, SamplingParams

PROMPTS = prompt_ids(2, 40, seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tokens(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_rope_overrides_match_transformers(tiny_models):
    model_dir = tiny_models["llama"]
    plain = tokens(LLM(model_dir, **SMALL))
    for kwargs, rope in (
        (dict(rope_theta=50.0), {"rope_type": "default", "rope_theta": 50.0}),
        (
            dict(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
            {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        ),
    ):
        got = tokens(LLM(model_dir, **SMALL, **kwargs))
        want = oracle_tokens(eager(model_dir, rope_parameters=rope), PROMPTS, GREEDY.max_tokens)
        assert got == want
        assert got != plain

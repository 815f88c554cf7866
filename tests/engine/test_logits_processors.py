"""Custom logits processors end to end: the example's ForceToken (per-request state from
extra_args) and an argmax-invariant one, against hand-computable effects; requests without
arguments are untouched, and nothing compiles after start-up."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams
from jllm.logits_process import LogitsProcessor

# The example, loaded by name as a user would ("module:Class").
sys.path.append(str(Path(__file__).parents[2] / "examples"))


class Flatten(LogitsProcessor):
    """Argmax-invariant: divides a row's logits by its factor (>= 1) after temperature."""

    state_dtype = np.float32

    def is_argmax_invariant(self) -> bool:
        return True

    def row_state(self, params):
        factor = (params.extra_args or {}).get("flatten")
        return None if factor is None else np.float32(factor)

    def apply(self, logits, state, active):
        return jnp.where(active[:, None], logits / state[:, None], logits)


PROMPTS = [{"prompt_token_ids": p} for p in prompt_ids(3, 7, seed=70)]


@pytest.fixture(scope="module")
def llm(llama_dir):
    # Compiled at start-up (not eager): the processors are traced into every sampler bucket.
    return LLM(
        llama_dir,
        **{**SMALL, "enforce_eager": False},
        logits_processors=["logits_processor:ForceToken", Flatten],
    )


def test_force_token_and_untouched_neighbours(llm, llama_llm):
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    forced = SamplingParams(
        temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, extra_args={"target_token": 77}
    )
    outs = llm.generate(PROMPTS, [plain, forced, plain], use_tqdm=False)
    alone = llama_llm.generate(PROMPTS, plain, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == [77] * 6
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    assert llm.llm_engine.runner.compile_guard  # and no compile happened since start-up


def test_argmax_invariant_processor_follows_temperature(llm):
    """Dividing by f after temperature t samples as temperature t * f: same seeded draw."""
    base = dict(max_tokens=8, ignore_eos=True, seed=5)
    flattened = SamplingParams(temperature=0.5, extra_args={"flatten": 2.0}, **base)
    same = SamplingParams(temperature=1.0, **base)
    a, b = llm.generate([PROMPTS[0]] * 2, [flattened, same], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_bad_arguments_and_bad_processors(llm, llama_dir):
    with pytest.raises(ValueError, match="target_token must be a token id"):
        llm.generate(PROMPTS[0], SamplingParams(extra_args={"target_token": "x"}))
    with pytest.raises(ValueError, match="Expected format"):
        LLM(llama_dir, **SMALL, logits_processors=["no_colon"])
    with pytest.raises(ValueError, match="not a jllm.logits_process.LogitsProcessor"):
        LLM(llama_dir, **SMALL, logits_processors=[object])

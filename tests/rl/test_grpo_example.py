"""examples/rl_grpo.py runs: a Flax/optax-style trainer (plain JAX + optax) and jllm in one
process on the same devices. The reward rises, the engine's logprobs of the sampled tokens
equal the trainer's teacher-forced ones (float32), and after every push the engine's greedy
tokens equal the trainer's own forward."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_the_grpo_example_learns_and_stays_in_step_with_the_trainer():
    path = Path(__file__).parents[2] / "examples" / "rl_grpo.py"
    spec = importlib.util.spec_from_file_location("rl_grpo", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rewards, gaps, same = example.run(steps=4)
    assert rewards[-1] > rewards[0] + 0.1, rewards
    assert max(gaps) < 1e-4, gaps
    assert all(same)

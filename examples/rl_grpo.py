"""GRPO with the trainer and jllm in one process, on the same devices (docs/rl.md).

The policy is a small Llama written here in plain JAX, its parameters a dict at the
checkpoint's Hugging Face names (the layout `update_weights` takes). Each step: jllm samples
a group of completions per prompt with their logprobs; a toy reward scores them (the share
of tokens with small ids); the trainer computes group-relative advantages and one
optax step on the policy-gradient loss, with its own logprobs of the sampled tokens, which
equal the engine's; then it pushes the new parameters with the four calls. The arrays never
leave the devices: the engine reshards them into its own layout (stacked layers, split
heads) on the device.

    python examples/rl_grpo.py            # a few steps on a tiny random model, on the CPU

The engine starts from a config-only folder with load_format="dummy" and takes its first
weights from the trainer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jllm import LLM, SamplingParams

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)
TARGETS = 32  # the toy reward: the share of sampled tokens with ids below this


# ---- the trainer's policy: Llama in plain JAX, parameters at Hugging Face names ------------
def init_params(key, c=CONFIG) -> dict:
    d, f, hd = (
        c["hidden_size"],
        c["intermediate_size"],
        c["hidden_size"] // c["num_attention_heads"],
    )
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (h * hd, d),
            p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d),
            p + "self_attn.o_proj.weight": (d, h * hd),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
    keys = jax.random.split(key, len(shapes))
    return {
        name: jnp.ones(shape) if name.endswith("norm.weight") else 0.2 * jax.random.normal(k, shape)
        for k, (name, shape) in zip(keys, shapes.items(), strict=True)
    }


def _rms(x, w, eps=CONFIG["rms_norm_eps"]):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, positions):  # x [T, heads, hd], Hugging Face's rotate-half form
    hd = x.shape[-1]
    inv = 1.0 / CONFIG["rope_theta"] ** (jnp.arange(0, hd, 2) / hd)
    angles = positions[:, None] * inv[None, :]
    cos, sin = (
        jnp.cos(jnp.concatenate([angles] * 2, -1)),
        jnp.sin(jnp.concatenate([angles] * 2, -1)),
    )
    half = jnp.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos[:, None] + half * sin[:, None]


def logits_fn(params: dict, ids):
    """ids [T] -> logits [T, V]: the model's causal forward."""
    c = CONFIG
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c["hidden_size"] // h
    x = params["model.embed_tokens.weight"][ids]
    t = ids.shape[0]
    pos = jnp.arange(t, dtype=jnp.float32)
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(c["num_hidden_layers"]):
        p = lambda n, i=i: params[f"model.layers.{i}.{n}.weight"]  # noqa: E731
        y = _rms(x, p("input_layernorm"))
        q = _rope((y @ p("self_attn.q_proj").T).reshape(t, h, hd), pos)
        k = _rope((y @ p("self_attn.k_proj").T).reshape(t, kv, hd), pos)
        v = (y @ p("self_attn.v_proj").T).reshape(t, kv, hd)
        k, v = jnp.repeat(k, h // kv, 1), jnp.repeat(v, h // kv, 1)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(hd)
        attn = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), -1)
        out = jnp.einsum("hqk,khd->qhd", attn, v).reshape(t, h * hd)
        x = x + out @ p("self_attn.o_proj").T
        y = _rms(x, p("post_attention_layernorm"))
        gate, up = y @ p("mlp.gate_proj").T, y @ p("mlp.up_proj").T
        x = x + (jax.nn.silu(gate) * up) @ p("mlp.down_proj").T
    return _rms(x, params["model.norm.weight"]) @ params["model.embed_tokens.weight"].T


def token_logprobs(params, ids, prompt_len: int):
    """The log-probabilities of ids[prompt_len:] under the policy, teacher-forced."""
    logp = jax.nn.log_softmax(logits_fn(params, ids)[prompt_len - 1 : -1], -1)
    return jnp.take_along_axis(logp, ids[prompt_len:, None], -1)[:, 0]


def greedy(params, prompt: list[int], n: int) -> list[int]:
    """The trainer's own greedy continuation (a full forward per token: a check, not fast)."""
    forward = jax.jit(logits_fn)
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(jnp.argmax(forward(params, jnp.array(ids))[-1])))
    return ids[len(prompt) :]


# ---- the loop ------------------------------------------------------------------------------
def push(llm: LLM, params: dict, version: str) -> None:
    """The trainer's parameters into the engine: jax arrays at HF names, on the devices."""
    llm.start_weight_update()
    llm.update_weights(params.items())
    llm.finish_weight_update(weight_version=version)


def run(steps: int = 4, group: int = 8, num_prompts: int = 4, max_tokens: int = 8, lr=3e-2):
    """Returns each step's mean reward, the largest gap between the engine's and the
    trainer's logprobs of the sampled tokens, and whether the engine's greedy tokens equal
    the trainer's after every push."""
    folder = tempfile.mkdtemp(prefix="rl-grpo-")
    with open(f"{folder}/config.json", "w") as f:
        json.dump(CONFIG, f)
    llm = LLM(
        folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=num_prompts * group,
        kv_cache_memory_bytes=16 << 20,
        enforce_eager=True,
        disable_log_stats=True,
    )
    params = init_params(jax.random.key(0))
    push(llm, params, "step-0")
    optimizer = optax.adam(lr)
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 6).tolist() for _ in range(num_prompts)]

    def loss_fn(params, ids, advantages, prompt_len):
        logp = jax.vmap(lambda x: token_logprobs(params, x, prompt_len))(ids)  # [B, n]
        return -jnp.mean(advantages * logp.sum(-1)), logp

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=3)
    rewards, gaps, same = [], [], []
    for step in range(steps):
        # Rollout: a group per prompt, with the sampled tokens' logprobs.
        params_s = SamplingParams(
            n=group, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=step, ignore_eos=True
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_s, use_tqdm=False)
        ids, engine_logp, scores = [], [], []
        for prompt, out in zip(prompts, outs, strict=True):
            for c in out.outputs:
                ids.append(prompt + list(c.token_ids))
                engine_logp.append(
                    [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]
                )
                scores.append(np.mean(np.array(c.token_ids) < TARGETS))
        scores = np.array(scores).reshape(num_prompts, group)
        advantages = (scores - scores.mean(1, keepdims=True)) / (
            scores.std(1, keepdims=True) + 1e-4
        )
        (loss, logp), grads = grad_fn(
            params, jnp.array(ids), jnp.array(advantages.reshape(-1)), len(prompts[0])
        )
        gaps.append(float(np.max(np.abs(np.array(logp) - np.array(engine_logp)))))
        rewards.append(float(scores.mean()))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        push(llm, params, f"step-{step + 1}")
        check = llm.generate(
            {"prompt_token_ids": prompts[0]},
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )[0].outputs[0]
        same.append(list(check.token_ids) == greedy(params, prompts[0], max_tokens))
        print(
            f"step {step}: reward {rewards[-1]:.3f}  loss {float(loss):+.4f}  "
            f"engine-vs-trainer logprob gap {gaps[-1]:.1e}  greedy equal {same[-1]}"
        )
    return rewards, gaps, same


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    start = time.perf_counter()
    rewards, gaps, same = run(parser.parse_args().steps)
    print(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f} in {time.perf_counter() - start:.1f} s")

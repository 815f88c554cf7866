"""Packed projections in the engine (jllm/models/packing.py): a bfloat16 engine whose layer
products are the CPU kernel's holds its stacked projections packed once, and serves the same
bits as the same engine reading them as [K, N] (the kernel's products of packed weights are
bitwise those of the others, tests/models/test_bf16_matmul.py); its compiled step
reads the packed panels in place; weight updates, `get_weights` and sleep see the
parameters as declared, and an update lands packed, served as by the control engine; a
packed Linear outside the kernel (another x dtype) multiplies the unpacked layer. Crosses, bit
for bit against the unpacked engine: prefix sharing in one step, n=2, chunked prefill, and
LoRA adapters under n-gram speculation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from lora_oracle import make_adapters
from oracle import SMALL, TINY, prompt_ids, weight_copies

from jllm import LLM, SamplingParams
from jllm.engine import llm_engine
from jllm.lora.request import LoRARequest
from jllm.models import bf16_matmul
from jllm.models.layers import Linear, StackedWeight

pytestmark = pytest.mark.skipif(
    not bf16_matmul.supported(), reason="the bf16 matmul kernel needs AVX512-BF16"
)

# one short prompt (the vector loop), one of 40 tokens (the AMX tiles where the CPU has them)
PROMPTS = [prompt_ids(1, 5, seed=1)[0], prompt_ids(1, 40, seed=2)[0], prompt_ids(1, 9, seed=3)[0]]
PARAMS = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)


def _model(seed: int):
    config = transformers.LlamaConfig(**{**TINY, "tie_word_embeddings": True})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("packed") / "a"
    _model(0).save_pretrained(path)
    return str(path), _model(1)


@pytest.fixture(scope="module")
def engines(models):
    """(the engine with packed projections, the control reading them as [K, N])."""
    kwargs = dict(dtype="bfloat16", skip_tokenizer_init=True, enable_sleep_mode=True, **SMALL)
    packed = LLM(models[0], **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "packs_here", lambda *a: False)
        plain = LLM(models[0], **kwargs)
    return packed, plain


def outputs(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [[(t, lp.logprob) for t, lp in d.items()] for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def test_packed_engine_serves_the_same_bits(engines):
    packed, plain = engines
    held = packed.llm_engine.runner.packed_weights
    assert held and not plain.llm_engine.runner.packed_weights
    names = {path[-2] for path in held}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert outputs(packed) == outputs(plain)


def test_the_step_reads_the_packed_panels_in_place(engines):
    runner = engines[0].llm_engine.runner
    text = runner.forward_for(runner.layout.shapes()[-1]).as_text()
    assert "jllm_bf16_matmul_packed_cpu" in text and "jllm_bf16_gated_matmul_packed_cpu" in text
    assert "jllm_bf16_matmul_cpu" not in text
    hidden, inter = TINY["hidden_size"], TINY["intermediate_size"]
    one_layer = (-(-inter // 32), 2, -(-hidden // 32) * 32 // 2, 32)  # gate_proj's panels
    assert not weight_copies(text, "bf16", one_layer)


def test_weights_are_read_and_updated_as_declared(engines, models):
    packed, plain = engines
    got, want = packed.get_weights(), plain.get_weights()
    flat_got, flat_want = dict(nnx.to_flat_state(got)), dict(nnx.to_flat_state(want))
    assert flat_got.keys() == flat_want.keys()
    value = lambda v: np.asarray(v.get_value() if hasattr(v, "get_value") else v)  # noqa: E731
    for path, want_value in flat_want.items():
        np.testing.assert_array_equal(value(flat_got[path]), value(want_value), str(path))
    update = list(models[1].state_dict().items())
    for llm in engines:
        llm.start_weight_update()
        llm.update_weights(update)
        llm.finish_weight_update()
    assert outputs(packed) == outputs(plain)
    layout = packed.llm_engine.runner.packed_weights
    state = dict(nnx.to_flat_state(packed.llm_engine.runner.state))
    for path, (k, n, _) in layout.items():  # still held packed
        assert state[path].get_value().shape[-4:] == (-(-n // 32), 2, -(-k // 32) * 16, 32)


def test_sleep_and_wake_keep_the_packed_weights(engines):
    packed, plain = engines
    before = outputs(packed)
    packed.sleep(level=1)
    packed.wake_up()
    assert outputs(packed) == before == outputs(plain)


def test_a_packed_linear_off_the_kernel_multiplies_the_unpacked_layer():
    linear = Linear("TD,DF->TF", (40, 70), ("embed", "mlp"), jnp.bfloat16, nnx.Rngs(0))
    stack = jnp.asarray(np.random.default_rng(0).normal(size=(3, 40, 70)), jnp.bfloat16)
    linear.weight.set_value(StackedWeight(bf16_matmul.pack(stack), jnp.int32(1)))
    linear.packed = True
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 40)), jnp.float32)
    want = jnp.einsum("TD,DF->TF", x, stack[1])
    np.testing.assert_allclose(np.asarray(linear(x)), np.asarray(want), rtol=1e-6, atol=1e-6)
    jax.clear_caches()


def test_packed_crosses_serve_the_same_bits(engines):
    """Prefix sharing (two requests admitted in one step sharing a 200-token prefix), n=2
    sampled with seeds, and a prompt longer than the step budget (chunked prefill over two
    steps): the packed engine's tokens and logprobs are the control's."""
    shared = prompt_ids(1, 200, seed=7)[0]
    prompts = [shared + [5, 6, 7], shared + [8, 9], prompt_ids(1, 300, seed=8)[0]]
    params = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            [(c.token_ids, [sorted(d.items()) for d in c.logprobs]) for c in o.outputs]
            for o in outs
        ]

    packed, plain = engines
    assert run(packed) == run(plain)


def test_packed_with_lora_and_speculation_serves_the_same_bits(llama_dir, tmp_path):
    """LoRA adapters on the packed projections (MLP and attention, mixed with the base in one
    batch) under n-gram speculation: the packed engine's tokens and logprobs are those of
    the same engine unpacked."""
    adapters = make_adapters(llama_dir, tmp_path, names=("attn4", "mlp16"))
    kwargs = dict(
        dtype="bfloat16",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
        **SMALL,
    )
    packed = LLM(llama_dir, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "packs_here", lambda *a: False)
        plain = LLM(llama_dir, **kwargs)
    assert packed.llm_engine.runner.packed_weights and not plain.llm_engine.runner.packed_weights
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(3, 12, seed=9, vocab=256)]
    lora = [
        None,
        LoRARequest("attn4", 1, adapters["attn4"][0]),
        LoRARequest("mlp16", 2, adapters["mlp16"][0]),
    ]

    def run(llm):
        outs = llm.generate(prompts, PARAMS, lora_request=lora, use_tqdm=False)
        return [
            (o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
            for o in outs
        ]

    assert run(packed) == run(plain)

"""`load_format="dummy"` on a config-only folder (how the GPU benchmark runs 8B models): the
folder needs only config.json, the weights are drawn on the device (N(0, 0.02), norms one),
the same seed gives the same weights, and the engine generates from token-id prompts."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from oracle import SMALL, prompt_ids

from jllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def config_only(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(f"{llama_dir}/config.json", path)
    return str(path)


def test_config_only_folder_needs_dummy(config_only):
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        LLM(config_only, skip_tokenizer_init=True, **SMALL)


def test_dummy_weights_generate_from_token_ids(config_only):
    llm = LLM(config_only, load_format="dummy", skip_tokenizer_init=True, **SMALL)
    runner = llm.llm_engine.runner
    flat = dict(nnx.to_flat_state(runner.state))
    for path, var in flat.items():
        w = np.asarray(jax.device_get(var[...]), np.float32)
        if len(path) > 1 and "norm" in path[-2]:
            assert (w == 1).all(), path
        else:
            assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002, path
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(3, 5, seed=3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    assert all(o.outputs[0].text == "" for o in outs)  # no tokenizer, no text
    again = LLM(config_only, load_format="dummy", skip_tokenizer_init=True, **SMALL)
    same = again.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in same] == [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["tpu_int8", "fp8"])
def test_dummy_weights_quantized_on_the_device(config_only, method):
    """A big model's quantized speed is measured from a config-only folder: the projections
    are drawn and quantized on the device, per output channel, and the engine generates."""
    from jllm.quantization.weights import QuantizedWeight, dequantize

    llm = LLM(
        config_only, load_format="dummy", quantization=method, skip_tokenizer_init=True, **SMALL
    )
    state = llm.llm_engine.runner.state
    up = state["layers"]["mlp"]["up_proj"]["weight"].get_value()
    assert isinstance(up, QuantizedWeight) and up.scale.shape[-1] == 1
    values = np.asarray(dequantize(up, np.float32))
    assert abs(values.std() - 0.02) < 0.002
    assert not isinstance(state["embed_tokens"].get_value(), QuantizedWeight)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids(2, 5)], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]

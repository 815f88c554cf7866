"""jllm's orbax checkpoints (`jllm convert`): a converted model answers as the original
(greedy tokens and logprobs), float and fp8, restored at TP 1 and 2; a checkpoint of another
format version, kv-head replication, shape or quantization is refused clearly."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from oracle import prompt_ids

from jllm import LLM, SamplingParams
from jllm.entrypoints.cli import main as cli

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, enforce_eager=True)
PROMPTS = [{"prompt_token_ids": p} for p in prompt_ids(3, 20, seed=2)]


def answers(llm):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)],
        )
        for o in outs
    ]


def assert_same(got, want):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        np.testing.assert_allclose(lps, ref_lps, atol=1e-6)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_models):
    """llama-h8kv2 converted by the command line, in float32 and in fp8."""
    root = tmp_path_factory.mktemp("orbax")
    model = tiny_models["llama-h8kv2"]
    out = {}
    for q in (None, "fp8"):
        path = str(root / (q or "float"))
        cli(["convert", model, path, "--dtype", "float32", *(["--quantization", q] if q else [])])
        out[q] = path
    return model, out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_converted_model_answers_as_the_original(converted, tp, quantization):
    model, paths = converted
    want = answers(LLM(model, quantization=quantization, tensor_parallel_size=tp, **ENGINE))
    got = LLM(paths[quantization], tensor_parallel_size=tp, **ENGINE)
    assert got.llm_engine.model_config.num_kv_heads == 2
    assert_same(answers(got), want)


def edited_copy(path: str, tmp_path, edit) -> str:
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    edit(copy)
    return copy


def test_other_checkpoints_are_refused(converted, tmp_path):
    _, paths = converted
    with pytest.raises(ValueError, match="kv_replicas=1.*kv_replicas=4|kv_replicas"):
        LLM(paths[None], tensor_parallel_size=8, **ENGINE)
    with pytest.raises(ValueError, match="converted with quantization='fp8'"):
        LLM(paths["fp8"], quantization="tpu_int8", **ENGINE)

    def old_version(path):
        meta_path = os.path.join(path, "jllm_checkpoint.json")
        meta = json.load(open(meta_path))
        meta["version"] = 0
        json.dump(meta, open(meta_path, "w"))

    with pytest.raises(ValueError, match="Convert the model again"):
        LLM(edited_copy(paths[None], tmp_path, old_version), **ENGINE)

    def wider(path):
        config_path = os.path.join(path, "config.json")
        config = json.load(open(config_path))
        config["intermediate_size"] *= 2
        json.dump(config, open(config_path, "w"))

    with pytest.raises(ValueError, match="of shape"):
        LLM(edited_copy(paths[None], tmp_path / "w", wider), **ENGINE)


def test_convert_refuses_a_folder_in_use(converted):
    model, paths = converted
    with pytest.raises(ValueError, match="not empty"):
        cli(["convert", model, paths[None]])

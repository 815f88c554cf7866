"""Pipeline parallelism on fake CPU devices: PP = 2 and PP = 2 x TP = 2 give the plain
engine's greedy tokens and logprobs (float32), with chunked prefill, prefix caching,
preemption and seeded sampling; so do uneven splits (vLLM's default and
VLLM_PP_LAYER_PARTITION's), with a LoRA adapter against PEFT; each stage's devices hold only
its layers' weights and cache rows; the splits jllm cannot run are refused with the reason;
no compile after warm-up. (Two processes as two stages: tests/distributed/test_multihost.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from lora_oracle import assert_each_matches_merged, lora_requests, make_adapters
from oracle import SMALL, prompt_ids, same_outputs

from jllm import LLM, SamplingParams
from jllm.models.decoder import plan_segments
from jllm.models.pipeline import stage_segments
from jllm.runner.compile_guard import count_compiles
from sharding import STAGE_AXIS

# A 40-token prompt over a 16-token budget: chunked prefill, its chunks cut into micro-batches.
ARGS = {**SMALL, "dtype": "float32", "max_num_batched_tokens": 16}
PROMPTS = [{"prompt_token_ids": p} for p in prompt_ids(4, 6) + prompt_ids(1, 40, seed=2)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
SEEDED = [
    SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=8, ignore_eos=True)
    for i in range(len(PROMPTS))
]


def run(llm, params=GREEDY):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_models):
    llm = LLM(tiny_models["llama-l4"], **ARGS)
    return run(llm), [o.token_ids for o in run(llm, SEEDED)]


def stage_of(mesh) -> dict:
    """Device -> its pipeline stage."""
    stages = mesh.devices.shape[list(mesh.axis_names).index(STAGE_AXIS)]
    return {d: s for s in range(stages) for d in np.take(mesh.devices, s, axis=1).flat}


def assert_stage_holds_its_layers(array, mesh, pp: int) -> None:
    """Every shard of a layer-stacked array (leading layer axis) holds exactly the rows of
    its device's stage (rows / pp each; uneven stages pad theirs to the largest)."""
    layers = array.shape[0]
    stage = stage_of(mesh)
    for shard in array.addressable_shards:
        rows = range(layers)[shard.index[0]]
        s = stage[shard.device]
        assert list(rows) == list(range(s * layers // pp, (s + 1) * layers // pp))


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (2, 2)])
def test_greedy_and_logprobs_equal_pp1(tiny_models, reference, pp, tp):
    llm = LLM(tiny_models["llama-l4"], pipeline_parallel_size=pp, tensor_parallel_size=tp, **ARGS)
    same_outputs(run(llm), reference[0])
    engine = llm.llm_engine
    mesh = engine.runner.mesh
    assert mesh.shape[STAGE_AXIS] == pp and mesh.shape["model"] == tp
    (cache,) = engine.runner.kv_cache
    assert cache.addressable_shards[0].data.shape[0] == 4 // pp
    assert_stage_holds_its_layers(cache, mesh, pp)
    layer_weights = [
        w
        for path, w in jax.tree_util.tree_leaves_with_path(engine.runner.state)
        if "layers" in jax.tree_util.keystr(path)
    ]
    assert len(layer_weights) == 9  # q, k, v, o, gate, up, down, two norms
    for w in layer_weights:
        assert_stage_holds_its_layers(w, mesh, pp)
        assert w.addressable_shards[0].data.nbytes <= w.nbytes // pp


def test_seeded_sampling_and_prefix_caching(tiny_models, reference):
    llm = LLM(tiny_models["llama-l4"], pipeline_parallel_size=2, **ARGS)
    assert [o.token_ids for o in run(llm, SEEDED)] == reference[1]
    kv = llm.llm_engine.scheduler.kv_cache
    hits = kv.prefix_hits
    assert [o.token_ids for o in run(llm, SEEDED)] == reference[1]
    assert kv.prefix_hits - hits >= 32  # the long prompt's two full blocks at least


def test_preemption(tiny_models, reference):
    llm = LLM(tiny_models["llama-l4"], pipeline_parallel_size=2, num_gpu_blocks_override=8, **ARGS)
    same_outputs(run(llm), reference[0])
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_prefix_hits_of_the_same_step_wait_for_their_writers(tiny_models):
    """n = 2 over a 33-token prompt (one past two 16-token blocks): both children are
    admitted in one step, and the second finds the first's two full blocks in the prefix
    cache, leaving it one token to compute. Its one-token row runs in the step's first
    micro-batch, before the micro-batch that writes those blocks, so under stages a block is
    a hit only from the step after the one that computes it: both children give the plain
    engine's tokens and logprobs."""
    args = {**ARGS, "max_num_batched_tokens": 64}
    prompts = [{"prompt_token_ids": prompt_ids(1, 33, seed=5)[0]}]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = LLM(tiny_models["llama-l4"], **args).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_models["llama-l4"], pipeline_parallel_size=2, **args)
    got = llm.generate(prompts, params, use_tqdm=False)
    same_outputs(got[0].outputs, want[0].outputs)
    # Blocks computed by an earlier step are hits as ever: the prompt again hits both.
    kv = llm.llm_engine.scheduler.kv_cache
    hits = kv.prefix_hits
    got = llm.generate(prompts, params, use_tqdm=False)
    same_outputs(got[0].outputs, want[0].outputs)
    assert kv.prefix_hits - hits == 2 * 32


def test_two_kv_groups_gemma2(tiny_models):
    """Gemma 2's (local, global) pattern twice over two stages: its two groups share one
    cache array (one pool), of which each stage holds one row; soft caps and the sliding
    window as with one stage."""
    prompts = PROMPTS
    want = LLM(tiny_models["gemma2"], **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(tiny_models["gemma2"], pipeline_parallel_size=2, **ARGS)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    same_outputs([o.outputs[0] for o in got], [o.outputs[0] for o in want])
    (cache,) = llm.llm_engine.runner.kv_cache
    assert_stage_holds_its_layers(cache, llm.llm_engine.runner.mesh, 2)


@pytest.mark.parametrize(
    ("model", "plan"),
    [("qwen3-moe", ((2, 0, 0), (0, 1, 1))), ("qwen2-window", ((1, 1), (0, 1)))],
)
def test_layers_of_several_patterns(tiny_models, model, plan):
    """Layers whose kinds change along the depth, as segments: Qwen3-MoE's sparse, sparse,
    dense, sparse (stage 0 runs the first two sparse layers, stage 1 the dense one and the
    last) and Qwen2's full-attention layer before two sliding ones (two KV-cache groups,
    each split over the stages). Each stack holds a stage's slots, those it does not fill
    empty; the plain engine's tokens and logprobs."""
    args = {**ARGS, "max_num_batched_tokens": 64}
    want = run(LLM(tiny_models[model], **args))
    llm = LLM(tiny_models[model], pipeline_parallel_size=2, **args)
    same_outputs(run(llm), want)
    assert llm.llm_engine.model_config.stage_segments == plan


def test_cut_pattern_gemma3(tiny_models):
    """Gemma 3's pattern (local, local, global) twice, then two local layers, over two
    stages of whole repeats (2 and 1): the second stage's global slot in the cut repeat, and
    its padding row, never run."""
    want = LLM(tiny_models["gemma3-cut"], **ARGS).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(tiny_models["gemma3-cut"], pipeline_parallel_size=2, **ARGS)
    assert llm.llm_engine.model_config.stage_repeats == (2, 1)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    same_outputs([o.outputs[0] for o in got], [o.outputs[0] for o in want])


def test_no_compile_after_warmup(tiny_models, reference):
    args = {**ARGS, "enforce_eager": False, "max_num_seqs": 8}
    llm = LLM(tiny_models["llama-l4"], pipeline_parallel_size=2, **args)
    assert llm.llm_engine.runner.compile_guard
    with count_compiles() as events:
        same_outputs(run(llm), reference[0])
    assert events == []


@pytest.mark.parametrize(("pp", "env", "stages"), [(3, None, (1, 2, 1)), (2, "3,1", (3, 1))])
def test_uneven_stages(tiny_models, reference, monkeypatch, pp, env, stages):
    """vLLM's default split of 4 layers over 3 stages (the remainder to the stages before
    the last), and VLLM_PP_LAYER_PARTITION's: each stage's stacks are padded to the largest
    stage's rows, which it skips."""
    if env is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", env)
    llm = LLM(tiny_models["llama-l4"], pipeline_parallel_size=pp, **ARGS)
    assert llm.llm_engine.model_config.stage_repeats == stages
    same_outputs(run(llm), reference[0])
    (cache,) = llm.llm_engine.runner.kv_cache
    assert cache.shape[0] == pp * max(stages)
    assert_stage_holds_its_layers(cache, llm.llm_engine.runner.mesh, pp)


def test_uneven_stages_with_adapters(tiny_models, tmp_path):
    """LoRA adapters' layers land on their stages' rows (the padding rows unused), and a
    step's micro-batches cut rows of different adapters (20-token prompts on a 16-token
    budget): each request equals its merged model, against PEFT."""
    model = tiny_models["llama-l4"]
    adapters = make_adapters(model, tmp_path)
    llm = LLM(model, pipeline_parallel_size=3, enable_lora=True, max_loras=2, **ARGS)
    prompts = prompt_ids(3, 20, seed=44)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    names = ["all8", None, "attn4"]
    lora = lora_requests(names, adapters)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, lora)
    assert_each_matches_merged(model, adapters, names, prompts, outs)


@pytest.mark.parametrize(
    ("model", "kwargs", "env", "message"),
    [
        ("llama-l4", dict(pipeline_parallel_size=8), None, r"exceeds the model's 4 layers"),
        (
            "llama-l4",
            dict(pipeline_parallel_size=2, tensor_parallel_size=8),
            None,
            r"exceeds the 8 available devices",
        ),
        ("llama-l4", dict(pipeline_parallel_size=2), "3,2", r"add up to the model's 4 layers"),
        ("llama-l4", dict(pipeline_parallel_size=2), "two,2", r"Invalid VLLM_PP_LAYER_PARTITION"),
        ("gemma2", dict(pipeline_parallel_size=2), "3,1", r"whole repeats of the model's 2-layer"),
        ("gemma2", dict(pipeline_parallel_size=4), None, r"exceeds the 2 repeats"),
        ("llama-l4", dict(pipeline_parallel_size=0), None, r"at least 1"),
    ],
)
def test_refused_splits(tiny_models, monkeypatch, model, kwargs, env, message):
    if env is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", env)
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models[model], **{**ARGS, **kwargs})


def test_converted_checkpoint_on_stages(tiny_models, reference, tmp_path):
    """A checkpoint from `jllm convert` restores onto equal stages (its stacks split as they
    are), and is refused for a split that would pad them."""
    from jllm.entrypoints.convert import convert

    out = convert(tiny_models["llama-l4"], str(tmp_path / "orbax"), dtype="float32")
    llm = LLM(out, pipeline_parallel_size=2, **ARGS)
    assert [o.token_ids for o in run(llm)] == [o.token_ids for o in reference[0]]
    with pytest.raises(ValueError, match="converted checkpoint"):
        LLM(out, pipeline_parallel_size=3, **ARGS)


def test_draft_model_refused(tiny_models):
    spec = {"model": tiny_models["llama"], "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="draft model is not supported with pipeline"):
        LLM(tiny_models["llama-l4"], pipeline_parallel_size=2, speculative_config=spec, **ARGS)


def test_a_stage_holds_whole_repeats_of_each_pattern(monkeypatch, caplog):
    """Layers of several patterns split at vLLM's runs of consecutive layers, each stage's
    repeats of each segment (the start-up log counts the empty slots that pads); a run that
    cuts a repeat is refused, and VLLM_PP_LAYER_PARTITION mends it."""
    kinds = ("a", "b", "a", "b", "c")  # (a, b) twice, then c
    with caplog.at_level("INFO", logger="jllm"):
        assert stage_segments(plan_segments(kinds), 3) == ((1, 0), (1, 0), (0, 1))  # 2, 2, 1
    assert "2 segments (4, 1 layers)" in caplog.text and "2, 2 of them empty" in caplog.text
    with pytest.raises(ValueError, match=r"cut a repeat of the model's 2-layer pattern"):
        stage_segments(plan_segments(kinds), 2)  # runs 3, 2
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,1")
    assert stage_segments(plan_segments(kinds), 2) == ((2, 0), (0, 1))

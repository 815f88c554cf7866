"""Pooling models offline (LLM.embed / classify / score / encode) against their oracles:
sentence-transformers for embeddings and bi-encoder scores, transformers for classifiers,
cross-encoders and the Qwen3-Reranker recipe; with the crosses a pooling request meets in
the engine (a batch of mixed lengths, chunked prefill, a prefix-cache hit, async
scheduling, tensor parallelism), and vLLM's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from oracle import SMALL
from pooling_oracle import hf_last_logits

from jllm import LLM
from jllm.pooling_params import PoolingParams

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "Paris is the capital of France, and its largest city by far.",
]


def st_embed(st, texts):
    return np.stack([st.encode(t) for t in texts])


@pytest.fixture(scope="module")
def embedder(st_model):
    return LLM(st_model[0], **SMALL)


def test_embeddings_match_sentence_transformers(embedder, st_model):
    outs = embedder.embed(TEXTS)
    got = np.array([o.outputs.embedding for o in outs])
    np.testing.assert_allclose(got, st_embed(st_model[1], TEXTS), atol=2e-5)
    assert [len(o.prompt_token_ids) for o in outs] == [
        len(embedder.get_tokenizer().encode(t)) for t in TEXTS
    ]
    assert all(o.finished for o in outs)


def test_a_prefix_cache_hit_embeds_the_same(embedder):
    text = (
        "A shared prefix long enough to fill a whole block of sixteen tokens, and then some more."
    )
    first, again = embedder.embed([text]), embedder.embed([text])
    assert again[0].num_cached_tokens > 0
    # Not bitwise: XLA's CPU backend may contract the rotary embedding's multiply-adds for
    # the few uncached rows and not for the whole prompt (the batch-invariant mode does not)
    np.testing.assert_allclose(first[0].outputs.embedding, again[0].outputs.embedding, atol=1e-6)


def test_use_activation_false_is_the_raw_state(embedder):
    raw = embedder.embed(TEXTS[:2], PoolingParams(use_activation=False))
    unit = embedder.embed(TEXTS[:2])
    for r, u in zip(raw, unit, strict=True):
        r = np.array(r.outputs.embedding)
        assert abs(np.linalg.norm(r) - 1) > 1e-3
        np.testing.assert_allclose(r / np.linalg.norm(r), u.outputs.embedding, atol=1e-6)


@pytest.mark.parametrize(
    "extra",
    [
        {"max_num_batched_tokens": 16, "async_scheduling": True},
        {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 6, "max_model_len": 96},
    ],
    ids=["chunked-async", "tight-cache"],
)
def test_chunked_prefill_async_and_a_tight_cache_embed_the_same(st_model, extra):
    """A pooling request never grows past its prompt, so a full cache makes new ones wait
    (they are not preempted); each still pools its own prompt."""
    llm = LLM(st_model[0], **{**SMALL, "max_num_seqs": 4, **extra})
    texts = [t * 4 for t in TEXTS]  # longer than a 16-token step: several chunks each
    got = np.array([o.outputs.embedding for o in llm.embed(texts)])
    np.testing.assert_allclose(got, st_embed(st_model[1], texts), atol=2e-5)
    assert not llm.llm_engine.has_unfinished_requests()


def test_tensor_parallel_embeds_the_same(st_model, embedder):
    llm = LLM(st_model[0], **SMALL, tensor_parallel_size=2)
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    want = np.array([o.outputs.embedding for o in embedder.embed(TEXTS)])
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_data_parallel_embeds_the_same(st_model, embedder):
    """Two data shards each pool their own requests' prompts."""
    llm = LLM(st_model[0], **SMALL, data_parallel_size=2)
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    want = np.array([o.outputs.embedding for o in embedder.embed(TEXTS)])
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert all(s.kv_cache.prefix_queries > 0 for s in llm.llm_engine.scheduler.shards)


def test_matryoshka_dimensions_cut_then_normalize(st_model):
    llm = LLM(st_model[0], **SMALL, hf_overrides={"matryoshka_dimensions": [16, 32]})
    raw = np.array(llm.embed(TEXTS[:1], PoolingParams(use_activation=False))[0].outputs.embedding)
    cut = np.array(llm.embed(TEXTS[:1], PoolingParams(dimensions=16))[0].outputs.embedding)
    np.testing.assert_allclose(cut, raw[:16] / np.linalg.norm(raw[:16]), atol=1e-6)
    with pytest.raises(ValueError, match=r"only supports Matryoshka dimensions \[16, 32\]"):
        llm.embed(TEXTS[:1], PoolingParams(dimensions=8))


def test_bi_encoder_scores_are_cosines(embedder, st_model):
    st = st_model[1]
    outs = embedder.score("What is the capital of France?", TEXTS)
    q = st.encode("What is the capital of France?")
    want = [float(q @ d) for d in st_embed(st, TEXTS)]  # unit vectors
    np.testing.assert_allclose([o.outputs.score for o in outs], want, atol=2e-5)
    pairs = embedder.score(TEXTS[:2], TEXTS[2:])
    assert len(pairs) == 2
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        embedder.score(TEXTS[:2], TEXTS[:3])


def test_classifier_matches_transformers(classifier_dir):
    llm = LLM(classifier_dir, **SMALL)
    outs = llm.classify(TEXTS)
    tokenizer = llm.get_tokenizer()
    for text, out in zip(TEXTS, outs, strict=True):
        logits = hf_last_logits(classifier_dir, tokenizer.encode(text))
        probs = np.exp(logits - logits.max())
        np.testing.assert_allclose(out.outputs.probs, probs / probs.sum(), atol=2e-5)
        assert out.outputs.num_classes == 3
    raw = llm.classify(TEXTS[:1], PoolingParams(use_activation=False))[0].outputs.probs
    np.testing.assert_allclose(
        raw, hf_last_logits(classifier_dir, tokenizer.encode(TEXTS[0])), atol=2e-5
    )
    with pytest.raises(ValueError, match="Scoring API is only enabled for num_labels == 1"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="Embedding API is not supported by this model"):
        llm.embed(TEXTS[:1])


def test_cross_encoder_scores_pairs_as_one_prompt(cross_encoder_dir):
    llm = LLM(cross_encoder_dir, **SMALL)
    query = "Where is Paris?"
    outs = llm.score(query, TEXTS)
    tokenizer = llm.get_tokenizer()
    for doc, out in zip(TEXTS, outs, strict=True):
        (logit,) = hf_last_logits(cross_encoder_dir, tokenizer.encode(query + doc))
        assert out.outputs.score == pytest.approx(1 / (1 + np.exp(-logit)), abs=2e-5)


def test_qwen3_reranker_recipe_is_the_yes_no_softmax(llama_dir):
    """vLLM's recipe: a causal LM served as a one-label classifier whose projection is the
    LM head's "yes" row less its "no" row; its score is P(yes) of a yes/no softmax."""
    overrides = {
        "architectures": ["LlamaForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(llama_dir, **SMALL, hf_overrides=overrides)
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    outs = llm.score("Is it Paris?", TEXTS[:2])
    for doc, out in zip(TEXTS[:2], outs, strict=True):
        ids = tokenizer.encode("Is it Paris?" + doc)
        logits = hf_last_logits(llama_dir, ids, transformers.AutoModelForCausalLM)[-1]
        pair = np.exp(logits[[no, yes]] - logits[[no, yes]].max())
        assert out.outputs.score == pytest.approx(pair[1] / pair.sum(), abs=2e-5)


def test_encode_returns_the_head_output(embedder):
    (out,) = embedder.encode(TEXTS[:1], pooling_task="embed")
    assert out.outputs.data.dtype == np.float32 and out.outputs.data.shape == (64,)
    with pytest.raises(ValueError, match="pooling_task is required"):
        embedder.encode(TEXTS[:1])


def test_truncate_prompt_tokens_keeps_the_last_tokens(embedder):
    ids = embedder.get_tokenizer().encode(TEXTS[1])
    (cut,) = embedder.embed(TEXTS[1:2], tokenization_kwargs={"truncate_prompt_tokens": 3})
    (tail,) = embedder.embed([{"prompt_token_ids": ids[-3:]}])
    assert cut.prompt_token_ids == ids[-3:]
    np.testing.assert_array_equal(cut.outputs.embedding, tail.outputs.embedding)
    with pytest.raises(ValueError, match="greater than max_model_len"):
        embedder.embed(TEXTS[:1], tokenization_kwargs={"truncate_prompt_tokens": 10**6})


def test_refusals(embedder, llama_llm, st_model):
    with pytest.raises(ValueError, match="only supported for generative models"):
        embedder.generate("Hello")
    with pytest.raises(ValueError, match=r"LLM.encode\(\) is only supported for pooling models"):
        llama_llm.embed("Hello")
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        embedder.embed("Hello", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="Classification API is not supported by this model"):
        embedder.classify("Hello")
    with pytest.raises(ValueError, match="Embedding models do not support `--runner generate`"):
        LLM(st_model[0], **SMALL, runner="generate")
    with pytest.raises(ValueError, match="seq_pooling_type must be one of"):
        LLM(st_model[0], **SMALL, pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="`normalize` was removed"):
        LLM(st_model[0], **SMALL, pooler_config={"normalize": True})


def test_a_decoder_converted_to_embed(llama_dir):
    """--convert embed on a causal LM: last-token pooling, normalized (vLLM's defaults)."""
    llm = LLM(llama_dir, **SMALL, convert="embed")
    model = transformers.AutoModel.from_pretrained(llama_dir).eval()
    import torch

    ids = llm.get_tokenizer().encode(TEXTS[1])
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    (out,) = llm.embed(TEXTS[1:2])
    np.testing.assert_allclose(out.outputs.embedding, h / np.linalg.norm(h), atol=2e-5)


def test_a_classifier_takes_no_dimensions(classifier_dir):
    llm = LLM(classifier_dir, **SMALL)
    with pytest.raises(ValueError, match=r"only supports \['use_activation'\] parameters"):
        llm.classify("Hello", PoolingParams(dimensions=8))


def test_a_prompt_of_max_model_len_tokens_embeds(st_model):
    llm = LLM(st_model[0], **{**SMALL, "max_model_len": 64})
    (out,) = llm.embed([{"prompt_token_ids": list(range(100, 164))}])
    assert len(out.outputs.embedding) == 64
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.embed([{"prompt_token_ids": list(range(100, 165))}])


def test_lora_embeddings_match_the_merged_model(llama_dir, tmp_path_factory):
    """An adapter per request in one batch: each embedding equals the PEFT-merged model's
    last hidden state, normalized; the base rows are the base model's."""
    import torch
    from lora_oracle import make_adapters

    from jllm.lora.request import LoRARequest

    adapters = make_adapters(llama_dir, tmp_path_factory.mktemp("pool-lora"), ("all8",))
    path, merged = adapters["all8"]
    llm = LLM(llama_dir, **SMALL, convert="embed", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("all8", 1, path)
    outs = llm.embed(TEXTS[:2] * 2, lora_request=[lora, lora, None, None])
    tokenizer = llm.get_tokenizer()
    for model_dir, rows in ((merged, outs[:2]), (llama_dir, outs[2:])):
        model = transformers.AutoModel.from_pretrained(model_dir).eval()
        for text, out in zip(TEXTS[:2], rows, strict=True):
            with torch.no_grad():
                ids = torch.tensor([tokenizer.encode(text)])
                h = model(ids).last_hidden_state[0, -1].numpy()
            np.testing.assert_allclose(out.outputs.embedding, h / np.linalg.norm(h), atol=5e-5)


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_mean_and_cls_pooling_match_sentence_transformers(llama_dir, tmp_path_factory, mode):
    """MEAN and CLS read the whole prompt in the step that ends it: chunked prefill and the
    prefix cache are off (vLLM's rule), and a prompt longer than the step budget still fits
    one step."""
    from pooling_oracle import save_st_model

    path, st = save_st_model(llama_dir, tmp_path_factory, mode)
    llm = LLM(path, **{**SMALL, "max_num_batched_tokens": 16})
    texts = TEXTS + [TEXTS[3] * 3]  # the last is longer than 16 tokens
    outs = llm.embed(texts)
    np.testing.assert_allclose([o.outputs.embedding for o in outs], st_embed(st, texts), atol=2e-5)
    args = llm.llm_engine.args
    assert not args.enable_chunked_prefill and not args.enable_prefix_caching
    again = llm.embed(texts[:1])
    assert again[0].num_cached_tokens == 0  # alone, the same to rounding (as above)
    np.testing.assert_allclose(again[0].outputs.embedding, outs[0].outputs.embedding, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_no_compile_after_warmup(llama_dir, tmp_path_factory, mode):
    """A pooling engine compiles its buckets (forward, and the pooling step in place of the
    sampler) at start-up: embedding prompts of every size afterwards compiles nothing."""
    from oracle import prompt_ids
    from pooling_oracle import save_st_model

    from jllm.runner.compile_guard import count_compiles

    path, _ = save_st_model(llama_dir, tmp_path_factory, mode)
    llm = LLM(
        path,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        disable_log_stats=True,
    )
    assert llm.llm_engine.runner.compile_guard
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(6, 3, seed=1)]
    prompts.append({"prompt_token_ids": prompt_ids(1, 150, seed=2)[0]})
    with count_compiles() as events:
        outs = llm.embed(prompts, use_tqdm=False)
    assert len(outs) == 7 and events == []

"""Scoring (vLLM's `LLM.score`, `/score`, `/rerank`): which models score, how the two sides
pair, and a cross-encoder's prompt for one pair. Host-side only."""

from __future__ import annotations

import numpy as np

from jllm.pooling.head import cosine


def scoring_spec(spec, api: str):
    """The pooling spec of a model that scores (ValueError with vLLM's messages else)."""
    if spec is None:
        raise ValueError(
            f"{api} is only supported for pooling models. Try passing `--runner pooling` to "
            "use the model as a pooling model."
        )
    if spec.task == "classify" and spec.num_labels != 1:
        raise ValueError("Scoring API is only enabled for num_labels == 1.")
    if not spec.enable_scoring:
        raise ValueError("This model does not support the Scoring API.")
    return spec


def score_pairs(data_1, data_2) -> tuple[list, list]:
    """vLLM's pairing: 1:1, 1:N (the one query for every document) or N:N; the documents'
    order is the outputs'."""
    first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
    second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not first or not second:
        raise ValueError("At least one text element must be given")
    if len(first) > 1 and len(first) != len(second):
        raise ValueError("Input lengths must be either 1:1, 1:N or N:N")
    if len(first) == 1:
        first = first * len(second)
    for text in (*first, *second):
        if not isinstance(text, str):
            raise ValueError("Scoring inputs must be strings.")
    return first, second


def cross_encoder_prompt(tokenizer, query: str, doc: str, chat_template: str | None, spec=None):
    """One pair as one prompt, as vLLM builds it for a classifier: the chat template's
    rendering of a "query" and a "document" message when given, the tokenizer's text pair
    for a model whose config sets `use_sep_token`, else the two texts joined."""
    if chat_template is not None:
        messages = [{"role": "query", "content": query}, {"role": "document", "content": doc}]
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
        return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    if spec is not None and spec.use_sep_token:
        return {"prompt_token_ids": tokenizer(text=query, text_pair=doc)["input_ids"]}
    return query + doc


def score_prompts(spec, queries: list, docs: list, tokenizer, chat_template=None) -> list:
    """What to pool for the pairs of `score_pairs`: each pair joined into one prompt for a
    cross-encoder (a classifier); for a bi-encoder each distinct query once, then every
    document."""
    if spec.task == "classify":
        return [
            cross_encoder_prompt(tokenizer, q, d, chat_template, spec)
            for q, d in zip(queries, docs, strict=True)
        ]
    return list(dict.fromkeys(queries)) + list(docs)


def pair_scores(spec, queries: list, outs: list) -> list[tuple[float, tuple]]:
    """Each pair's score from the pooled outputs of `score_prompts`' prompts, in order, with
    the outputs it came from: a cross-encoder's one, a bi-encoder's query and document (the
    cosine of their embeddings)."""
    if spec.task == "classify":
        return [(float(np.asarray(o.outputs.data).squeeze()), (o,)) for o in outs]
    unique = list(dict.fromkeys(queries))
    first = dict(zip(unique, outs, strict=False))
    return [
        (cosine(first[q].outputs.data, d.outputs.data), (first[q], d))
        for q, d in zip(queries, outs[len(unique) :], strict=True)
    ]

"""`LLM`: vLLM's offline inference class, with the same arguments and outputs.

from jllm import LLM, SamplingParams
llm = LLM()  # the embedded SmolLM2-135M-Instruct
outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8))
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from jllm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from jllm.config import EngineArgs
from jllm.engine.llm_engine import LLMEngine
from jllm.entrypoints.media import MediaConnector, chat_messages_with_images
from jllm.logger import setup_logging
from jllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jllm.pooling.prompts import truncated_prompt
from jllm.pooling.scoring import pair_scores, score_pairs, score_prompts, scoring_spec
from jllm.pooling_params import PoolingParams
from jllm.sampling_params import RequestOutputKind, SamplingParams
from jllm.tracing import start_tracing

logger = logging.getLogger("jllm")


def _priorities(priority, n: int) -> list[int]:
    """vLLM's `priority` argument (None, one int, or one per prompt) as one per prompt."""
    if priority is None or isinstance(priority, int):
        return [priority or 0] * n
    if len(priority) != n:
        raise ValueError(
            f"The lengths of prompts ({n}) and priority ({len(priority)}) must be the same."
        )
    return list(priority)


def _per_prompt(value, n: int, name: str) -> list:
    """vLLM's per-prompt arguments (`lora_request`): None or one value for every prompt, or
    a list of one per prompt."""
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(
            f"The lengths of prompts ({n}) and {name} ({len(value)}) must be the same."
        )
    return list(value)


class LLM:
    def __init__(self, model: str | None = None, *, _engine_args=None, **kwargs) -> None:
        setup_logging()
        args = _engine_args or EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        if self.llm_engine.is_follower:
            # vLLM's headless nodes: this process only runs process 0's steps.
            self.llm_engine.follow()
        # Spans per request with otlp_traces_endpoint (process 0 makes the outputs); the
        # SDK sends the last ones at exit.
        self.tracer = None if self.llm_engine.is_follower else start_tracing(self.llm_engine)
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """vLLM's constructor from an EngineArgs (the bench commands build one from flags)."""
        return cls(_engine_args=engine_args)

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters `generate`/`chat` use when given none: the model's generation
        config defaults (see `generation_config`), else SamplingParams()."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        priority=None,
    ) -> list[RequestOutput]:
        return self._generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def _generate(
        self,
        prompts,
        sampling_params,
        use_tqdm: bool,
        lora_request=None,
        priority=None,
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        priority = _priorities(priority, len(prompts))
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"The lengths of prompts ({len(prompts)}) and sampling_params "
                    f"({len(params_list)}) must be the same."
                )
        if self.is_sleeping():
            raise RuntimeError(
                "The engine is asleep (sleep or pause): call wake_up() before generate; "
                "nothing could wake it while generate waits."
            )
        # Validate everything before the first request enters the engine.
        prepared = [
            self.llm_engine.prepare(p, sp, lora, add_special_tokens)
            for p, sp, lora in zip(prompts, params_list, loras, strict=True)
        ]
        return self._run(prepared, use_tqdm, priority)

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        lora_request=None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
        priority=None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (`jllm/beam_search.py`): per step, one single-token request per
        live beam of every prompt, all in one batch; beams share KV blocks through prefix
        caching. Returns the best `beam_width` sequences per prompt, best first. A
        `lora_request` (one, or one per prompt) runs each prompt's beams with its adapter."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        engine = self.llm_engine
        searches, processed_prompts = [], []
        for p, lora in zip(prompts, loras, strict=True):
            processed, _ = engine.prepare(p, SamplingParams(max_tokens=1), lora)
            processed_prompts.append(processed)
            ids = processed.prompt_token_ids
            if len(ids) + params.max_tokens > engine.max_model_len:
                raise ValueError(
                    f"The prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                    f"exceeds the maximum model length of {engine.max_model_len}."
                )
            orig = p if isinstance(p, (str, dict)) else {"prompt_token_ids": ids}
            searches.append(BeamSearch(orig, ids, params, engine.eos_token_ids))
        priority = _priorities(priority, len(searches))
        limit = concurrency_limit or len(searches)
        for lo in range(0, len(searches), limit):
            chunk = slice(lo, lo + limit)
            group = list(
                zip(searches[chunk], priority[chunk], processed_prompts[chunk], strict=True)
            )
            while any(not s.done for s, _, _ in group):
                live = [g for g in group if not g[0].done]
                sizes = [len(s.beams) for s, _, _ in live]
                step_params = live[0][0].step_params()
                step = [
                    engine.continue_prompt(processed, tokens, step_params)
                    for s, _, processed in live
                    for tokens in s.beam_tokens()
                ]
                step_prio = [p for (_, p, _), n in zip(live, sizes, strict=True) for _ in range(n)]
                outs = self._run(step, False, step_prio)
                at = 0
                for (s, _, _), n in zip(live, sizes, strict=True):
                    s.advance(outs[at : at + n])
                    at += n
        tokenizer = self.get_tokenizer()
        results = []
        for s in searches:
            best = s.best()
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
            results.append(BeamSearchOutput(best))
        return results

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's: forget every cached prefix block (after changing weights, say, or for a
        cold-cache measurement); False, and nothing forgotten, while requests run, unless
        `reset_running_requests` preempts them first (they are recomputed). jllm has no KV
        connector, so `reset_connector` has nothing more to reset."""
        return self.llm_engine.engine_core.call_utility(
            "reset_prefix_cache", reset_running_requests, reset_connector
        )

    # ---- RL: weight updates, sleep (vLLM's names; docs/rl.md) ------------------------------
    def _utility(self, name: str, *args):
        return self.llm_engine.engine_core.call_utility(name, *args)

    def init_weight_transfer_engine(self, request=None) -> None:
        """Set up the weight transfer (`weight_transfer_config`'s backend): a dict
        {"init_info": {...}}, an object with `init_info`, or the init_info itself."""
        self.llm_engine.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        """Begin a weight update: `update_weights` (any number of chunks), then
        `finish_weight_update` installs them all at once."""
        self._utility("start_weight_update")

    def update_weights(self, weights) -> None:
        """One chunk: (name, tensor) pairs or a mapping at the checkpoint's Hugging Face
        names (numpy, torch or jax arrays, on any devices), `get_weights()`'s state with its
        leaves replaced, or the transfer backend's {"update_info": ...}. A bad tensor raises
        ValueError naming it and ends the update with the engine's weights unchanged."""
        self.llm_engine.update_weights(weights)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Install the update's weights; label them `weight_version` if given."""
        self._utility("finish_weight_update", weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self._utility("update_weight_version", new_version)

    def get_weight_version(self) -> str:
        """The weights' label: "default" until an update or `update_weight_version`."""
        return self._utility("get_weight_version")

    def get_weights(self):
        """The model's parameters as the engine holds them: an `nnx.State` of `jax.Array`s
        on their shardings. Give it back to `update_weights` with new leaves of the same
        shapes and dtypes: no conversion, and none copied that already sit where they go."""
        return self._utility("get_weights")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Level 0 pauses scheduling; 1 moves the weights to host memory and frees the KV
        cache; 2 frees both (an update brings weights back). Needs enable_sleep_mode for
        levels 1 and 2. `generate` refuses until `wake_up`."""
        self._utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back `tags` ("weights", "kv_cache", "scheduling"; None: all); returns
        whether the engine is fully awake."""
        return self._utility("wake_up", tags)

    def release_kv_cache_memory(self) -> None:
        """Free the KV cache after `sleep(level=0)`; `wake_up(["kv_cache"])` restores it."""
        self._utility("release_kv_cache_memory")

    def is_sleeping(self) -> bool:
        return self._utility("is_sleeping")

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer; skip_tokenizer_init is set.")
        conversations = messages
        if not messages or isinstance(messages[0], dict):
            conversations = [messages]
        args = self.llm_engine.args
        media = MediaConnector(
            args.allowed_local_media_path,
            args.allowed_media_domains,
            max_images=self.llm_engine.max_images_per_prompt,
        )
        prompts = []
        for conv in conversations:
            conv, images = chat_messages_with_images(conv, media)
            text = tokenizer.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            if images:  # the model's processor expands each image's placeholder
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
            else:
                ids = tokenizer.encode(text, add_special_tokens=False)
                prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self._generate(
            prompts, sampling_params, use_tqdm, lora_request, add_special_tokens=False
        )

    # ---- pooling models (jllm/pooling) -----------------------------------------------------
    def encode(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request=None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's encode: each prompt's pooled vector after the model's head
        (`PoolingRequestOutput.outputs.data`, a numpy array) for `pooling_task` ("embed" or
        "classify"). `tokenization_kwargs`: {"truncate_prompt_tokens": N} keeps a prompt's
        last N tokens (-1: max_model_len)."""
        if pooling_task is None:
            raise ValueError(
                "pooling_task is required for LLM.encode(): pass 'embed' or 'classify'."
            )
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        engine = self.llm_engine
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        elif len(pooling_params) != len(prompts):
            raise ValueError(
                f"The lengths of prompts ({len(prompts)}) and pooling_params "
                f"({len(pooling_params)}) must be the same."
            )
        params = [engine.pooling_params(p, pooling_task) for p in pooling_params]
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        truncate = (tokenization_kwargs or {}).get("truncate_prompt_tokens")
        prepared = []
        for prompt, p, lora in zip(prompts, params, loras, strict=True):
            if truncate is not None:
                limit, tokenize = engine.max_model_len, self.get_tokenizer().encode
                prompt = truncated_prompt(prompt, truncate, limit, tokenize)
            prepared.append(engine.prepare(prompt, p, lora))
        return self._run(prepared, use_tqdm, [0] * len(prompts))

    def embed(self, prompts, pooling_params=None, **kwargs) -> list[EmbeddingRequestOutput]:
        """vLLM's embed: one embedding per prompt (`outputs.embedding`); `encode`'s keyword
        arguments but `pooling_task`."""
        outs = self.encode(prompts, pooling_params, pooling_task="embed", **kwargs)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts, pooling_params=None, **kwargs) -> list[ClassificationRequestOutput]:
        """vLLM's classify: each prompt's class probabilities (`outputs.probs`)."""
        outs = self.encode(prompts, pooling_params, pooling_task="classify", **kwargs)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1,
        data_2,
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's score: a score per (data_1, data_2) pair, 1:1, 1:N or N:N, in data_2's
        order. A classifier with one label scores each pair joined into one prompt (a
        cross-encoder); an embedding model the cosine of the two texts' embeddings."""
        spec = scoring_spec(self.llm_engine.pooling, "LLM.score()")
        common = dict(
            use_tqdm=use_tqdm, lora_request=lora_request, tokenization_kwargs=tokenization_kwargs
        )
        queries, docs = score_pairs(data_1, data_2)
        prompts = score_prompts(spec, queries, docs, self.get_tokenizer(), chat_template)
        outs = self.encode(prompts, pooling_params, pooling_task=spec.task, **common)
        return [
            ScoringRequestOutput(
                request_id="_".join(o.request_id for o in used),
                outputs=ScoringOutput(score),
                prompt_token_ids=[t for o in used for t in o.prompt_token_ids],
                num_cached_tokens=used[-1].num_cached_tokens,
                finished=True,
            )
            for score, used in pair_scores(spec, queries, outs)
        ]

    def _run(self, prepared, use_tqdm: bool, priority: list[int]) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for (processed, params), prio in zip(prepared, priority, strict=True):
                if isinstance(params, SamplingParams):
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self._counter))
                engine.add_request(rid, processed, params, int(prio))
                ids.append(rid)
        except BaseException:  # a request refused: none of this call's runs
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = (
            tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
        )
        start = time.perf_counter()
        in_toks = out_toks = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    results[out.request_id] = out
                    if bar is not None:
                        in_toks += len(out.prompt_token_ids)
                        if isinstance(out, RequestOutput):
                            out_toks += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.postfix = (
                            f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                            f"output: {out_toks / elapsed:.2f} toks/s"
                        )
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

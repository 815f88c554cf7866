"""The persistent input batch (vLLM V1's `InputBatch`): one numpy row per running request.

A request's row is written once, when the scheduler first sends it (`NewRequestData`): its
tokens, block tables (one per KV-cache group) and sampling parameters. After that the row
changes only by deltas: new block ids and the computed length from the scheduler
(`CachedRequestData`), and the tokens the runner samples, which it appends itself. Each
step's inputs are then gathers over these arrays by row index (`runner/inputs.py`), with no
per-token Python loop for decodes.

Row `pad` (the last) is a padding row: greedy, no penalties, an empty block table. A row
with penalties owns penalty-state row `row + 1` on the device (row 0 stays empty, see
`runner/penalty_state.py`), and likewise a row with a fixed logits bias
(`runner/logit_bias.py`).

Host-side numpy only: no JAX, nothing from `jllm.engine`.
"""

from __future__ import annotations

import numpy as np

from jllm import mrope
from jllm.sampling_params import MAX_SUPPRESS
from jllm.scheduler_output import CachedRequestData, NewRequestData

# A temperature past float32's range is stored as its top (its row samples the same as at
# infinity: every logit scaled to about zero) rather than cast to inf with numpy's warning.
_F32_MAX = float(np.finfo(np.float32).max)

NO_TOKEN = np.iinfo(np.int32).max  # an id past any vocabulary: scatters with it are dropped


class InputBatch:
    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_pages: int,
        logits_processors=(),
        num_kv_groups: int = 1,
    ) -> None:
        M = max_num_seqs
        self.pad = M
        self.max_model_len = max_model_len
        self.index: dict[str, int] = {}
        self._free = list(range(M - 1, -1, -1))
        rows = M + 1
        self.token_ids = np.zeros((rows, max_model_len), np.int32)
        self.num_tokens = np.zeros(rows, np.int32)  # known tokens: prompt + output
        # Tokens sampled by steps in flight, not yet fetched (async scheduling): they sit on
        # the device, and the next step reads them there.
        self.num_pending = np.zeros(rows, np.int32)
        self.generation = np.zeros(rows, np.int64)  # bumped when a row changes hands
        self.num_prompt = np.zeros(rows, np.int32)
        self.num_computed = np.zeros(rows, np.int32)  # before the current step
        # One block table per KV-cache group (engine/kv_cache_manager.py).
        self.block_table = np.zeros((num_kv_groups, rows, max_pages), np.int32)
        self.num_blocks = np.zeros((num_kv_groups, rows), np.int32)
        self.temperature = np.zeros(rows, np.float32)
        self.top_p = np.ones(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.min_p = np.zeros(rows, np.float32)
        self.seed_lo = np.zeros(rows, np.uint32)
        self.seed_hi = np.zeros(rows, np.uint32)
        self.presence = np.zeros(rows, np.float32)
        self.frequency = np.zeros(rows, np.float32)
        self.repetition = np.ones(rows, np.float32)
        self.penalty_row = np.zeros(rows, np.int32)  # 0: no penalties
        self.min_tokens = np.zeros(rows, np.int32)
        self.suppress = np.full((rows, MAX_SUPPRESS), NO_TOKEN, np.int32)  # under min_tokens
        self.want_logprobs = np.zeros(rows, bool)
        self.want_top = np.zeros(rows, bool)  # logprobs > 0: the top entries too
        self.prompt_logprobs = np.zeros(rows, bool)  # the request asked for them
        self.bias_row = np.zeros(rows, np.int32)  # row in the logit-bias table (0: none)
        self.lora_slot = np.zeros(rows, np.int32)  # its LoRA adapter's device slot (0: none)
        # M-RoPE (Qwen-VL): each row's positions minus index past its images, and the image
        # spans of rows that have any (engine/mrope.py)
        # and where its last image ends
        self.mrope_delta = np.zeros(rows, np.int32)
        self.mrope_end = np.zeros(rows, np.int32)
        self.mrope_spans: dict[int, np.ndarray] = {}
        # Bad words of several tokens by row: their last token is masked per step when the
        # output ends with the rest.
        self.bad_words: dict[int, list[list[int]]] = {}
        # Custom logits processors (jllm/logits_process.py): per processor, whether a row
        # uses it and the row's state.
        self.logits_processors = tuple(logits_processors)
        self.proc_active = [np.zeros(rows, bool) for _ in self.logits_processors]
        self.proc_state = [
            np.zeros((rows, *p.state_shape), p.state_dtype) for p in self.logits_processors
        ]

    def add(self, new: NewRequestData) -> int:
        """Write a request's row; returns it."""
        if new.req_id in self.index:  # resumed after a preemption: a fresh row
            self.remove(new.req_id)
        r = self._free.pop()
        self.index[new.req_id] = r
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        self.token_ids[r, : len(tokens)] = tokens
        self.num_tokens[r] = len(tokens)
        self.num_pending[r] = 0
        self.generation[r] += 1
        self.num_prompt[r] = len(new.prompt_token_ids)
        self.num_computed[r] = new.num_computed_tokens
        self.block_table[:, r] = 0
        self.num_blocks[:, r] = 0
        self._append_blocks(r, new.block_ids)
        p = new.sampling_params
        self.temperature[r], self.top_p[r] = min(p.temperature, _F32_MAX), p.top_p
        self.top_k[r], self.min_p[r] = p.top_k, p.min_p  # top_k: below the vocabulary
        self.seed_lo[r], self.seed_hi[r] = new.seed & 0xFFFFFFFF, (new.seed >> 32) & 0xFFFFFFFF
        penalties = p.has_penalties
        self.presence[r] = p.presence_penalty if penalties else 0.0
        self.frequency[r] = p.frequency_penalty if penalties else 0.0
        self.repetition[r] = p.repetition_penalty if penalties else 1.0
        self.penalty_row[r] = r + 1 if penalties else 0
        # min_tokens past the context cannot be reached: an int32 row holds it.
        self.min_tokens[r] = min(p.min_tokens, self.max_model_len)
        ids = sorted(p.all_stop_token_ids | {new.eos_token_id} - {None})
        self.suppress[r] = NO_TOKEN
        if p.min_tokens:
            self.suppress[r, : len(ids)] = ids
        self.want_logprobs[r] = p.logprobs is not None
        self.want_top[r] = bool(p.logprobs)  # -1 (the whole vocabulary) too
        # A request resumed with outputs already has its prompt logprobs.
        self.prompt_logprobs[r] = p.prompt_logprobs is not None and not new.output_token_ids
        self.bias_row[r] = r + 1 if p.has_bias else 0
        self.lora_slot[r] = new.lora_slot
        self.mrope_spans.pop(r, None)
        self.mrope_delta[r] = self.mrope_end[r] = 0
        if new.mrope_spans:
            spans = np.asarray(new.mrope_spans, np.int64).reshape(-1, 4)
            self.mrope_spans[r] = spans
            self.mrope_delta[r] = mrope.delta(spans)
            self.mrope_end[r] = spans[-1, 0] + spans[-1, 1]
        self.bad_words.pop(r, None)
        for proc, active, state in zip(
            self.logits_processors, self.proc_active, self.proc_state, strict=True
        ):
            row_state = proc.row_state(p)
            active[r] = row_state is not None
            state[r] = 0 if row_state is None else row_state
        if p.multi_token_bad_words:
            self.bad_words[r] = p.multi_token_bad_words
        return r

    def update(self, cached: CachedRequestData) -> None:
        for rid, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            r = self.index[rid]
            self._append_blocks(r, blocks)
            self.num_computed[r] = computed

    def _append_blocks(self, r: int, blocks: tuple[list[int], ...]) -> None:
        """Append to row `r`'s block tables: one list of ids per KV-cache group."""
        for g, ids in enumerate(blocks):
            n = self.num_blocks[g, r]
            self.block_table[g, r, n : n + len(ids)] = ids
            self.num_blocks[g, r] = n + len(ids)

    def append_tokens(self, r: int, tokens) -> None:
        n = self.num_tokens[r]
        k = min(len(tokens), self.max_model_len - n)  # a finished row may overshoot
        self.token_ids[r, n : n + k] = tokens[:k]
        self.num_tokens[r] = n + k

    def remove(self, req_id: str) -> int | None:
        r = self.index.pop(req_id, None)
        if r is not None:
            self.generation[r] += 1
            self._free.append(r)
        return r


def token_slots(table: np.ndarray, tok_row, positions, block_size: int, padding) -> np.ndarray:
    """Each token's flat cache slot in one KV-cache group [T] int32, from the group's block
    tables `table` [rows, P], its input-batch row `tok_row` [T] and position; `padding`
    (a scalar, or [T]) where tok_row is -1."""
    S, live = block_size, tok_row >= 0
    r, p = np.where(live, tok_row, 0), np.where(live, positions, 0)
    return np.where(live, table[r, p // S] * S + p % S, padding).astype(np.int32)

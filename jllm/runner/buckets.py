"""The bucket policy: which step shapes (forward keys) and sample-row counts are compiled.

`BatchLayout` is built once from the resolved scheduler config, the attention backend's
batch layout (its `prefill_tile`, or packed rows) and the model's KV-cache groups, and is
frozen: every step, warm-up and follower builds its shapes from the same facts. Only the
block count, known once the cache is sized after profiling, comes later, as a new layout
(`with_blocks`).
"""

from __future__ import annotations

import dataclasses

from jllm.attention import block_table_pages
from jllm.utils import cdiv


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}.")


def pow2_buckets(limit: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Static facts the input builder needs from the runner, and the bucket policy: which
    step shapes (keys) are compiled.

    With tiles (the XLA backend), a step's key is (Rd, Tt): Rd decode rows, then Tt tiles
    of `tile_size` token slots. Packed (the ragged kernels: C++ on the CPU, Pallas on TPU and
    GPU, which take any mix of rows at any offset), it is (T,): T token slots and
    R = min(T, max_rows) request rows, one axis that grows with log(budget). Either way the
    sampler has its own axis, the sample rows Rs, and the forward hands it the hidden states
    of `logit_rows` tokens whatever the bucket, so the two never multiply."""

    block_size: int
    num_blocks: int
    tile_size: int
    max_pages: int  # block table width, a multiple of the largest KV chunk in pages
    kv_token_bytes: int  # one token's K and V in one layer
    decode_buckets: list[int]  # Rd (tiles), and the draft model's decode steps
    tile_buckets: list[int]  # Tt (tiles)
    token_buckets: list[int]  # T (packed)
    sample_buckets: list[int]  # Rs
    max_rows: int = 1  # request rows a step holds at most (max_num_seqs)
    budget: int = 1  # tokens a step holds at most (max_num_batched_tokens)
    num_spec_tokens: int = 0  # K: drafts a row may verify
    kv_fp8: str | None = None  # the float8 format whose bytes (uint8) the cache holds
    # Whether rows of several tokens start on, and fill, tiles of `tile_size` tokens (the
    # attention backend's `prefill_tile`), or are packed back to back.
    tiles: bool = True
    # Each KV-cache group's step fields, in the runner's group order, as (name, value) pairs
    # (its spec's `step_fields`: token bytes, a sliding window, a local chunk), which each
    # group's copy of the flat batch takes: a backend reads only the pages they leave.
    group_fields: tuple = ()
    # A vision-language model's tokens per encoder-cache page (0: text only: a page holds a
    # fixed-size image, or part of an image cut at its own size), and whether an image's
    # tokens attend to each other in both directions (each token's `q_horizon`).
    image_tokens: int = 0
    image_spans: bool = False
    # M-RoPE (Qwen-VL): every step carries [3, T] rotary positions (`StepInputs.mrope_positions`)
    mrope: bool = False
    # enable_prompt_embeds: the model's hidden size D; every step then carries an embedding
    # row [T, D] per token slot and a mask of the slots that take it (0: off)
    embeds_dim: int = 0
    # An MTP draft: every step carries each token's successor (`StepInputs.next_tokens`)
    next_tokens: bool = False

    @staticmethod
    def create(
        block_size,
        num_blocks,
        tile_size,
        max_model_len,
        max_num_seqs,
        budget,
        kv_token_bytes,
        min_rows=1,
        num_spec_tokens=0,
        kv_fp8=None,
        tiles=True,
        group_fields=(),
        image_tokens=0,
        image_spans=False,
        embeds_dim=0,
        mrope=False,
    ):
        """`min_rows`: the smallest decode, token and sample bucket (see `min_dot_rows`).
        Buckets stop at what the limits can reach: a step holds at most `budget` tokens
        and `max_num_seqs` requests, each sampling at most 1 + K rows."""
        chunk_pages = block_table_pages(block_size)
        max_pages = cdiv(cdiv(max_model_len, block_size), chunk_pages) * chunk_pages
        rows = min(max_num_seqs * (1 + num_spec_tokens), budget)
        return BatchLayout(
            block_size=block_size,
            num_blocks=num_blocks,
            tile_size=tile_size,
            max_pages=max_pages,
            kv_token_bytes=kv_token_bytes,
            decode_buckets=[0] + pow2_buckets(max_num_seqs, min_rows),
            tile_buckets=[0] + pow2_buckets(cdiv(budget, tile_size)) if tiles else [0],
            token_buckets=[] if tiles else pow2_buckets(budget, min_rows),
            sample_buckets=pow2_buckets(rows, min_rows),
            max_rows=max_num_seqs,
            budget=budget,
            num_spec_tokens=num_spec_tokens,
            kv_fp8=kv_fp8,
            tiles=tiles,
            group_fields=tuple(tuple(sorted(dict(f).items())) for f in group_fields),
            image_tokens=image_tokens,
            image_spans=image_spans,
            embeds_dim=embeds_dim,
            mrope=mrope,
        )

    def with_blocks(self, num_blocks: int) -> BatchLayout:
        """This layout for a cache of `num_blocks` blocks (the padding tokens' slot lies past
        them); the compiled shapes are the same."""
        return dataclasses.replace(self, num_blocks=num_blocks)

    @property
    def logit_rows(self) -> int:
        """The tokens whose hidden states every forward hands the sampler: the most sample
        rows a step can have."""
        return self.sample_buckets[-1]

    @property
    def has_state(self) -> bool:
        """Whether a KV-cache group keeps per-request state (linear attention), whose
        layers run each request row's tokens in order from its one state."""
        return any(dict(f).get("state") for f in self.group_fields)

    def dims(self, key: tuple) -> tuple[int, int, int, int]:
        """(T tokens, R request rows, Rd decode rows, Tt tiles) of a forward key."""
        if self.tiles:
            rd, tt = key
            return rd + tt * self.tile_size, rd + tt, rd, tt
        (t,) = key
        return t, min(t, self.max_rows), 0, 0

    def decode_key(self, rd: int) -> tuple:
        """The key of a step of `rd` one-token rows (the draft model's steps)."""
        return (rd, 0) if self.tiles else (rd,)

    def largest(self) -> tuple:
        """The forward key with the most tokens (start-up memory profiling)."""
        if self.tiles:
            return self.decode_buckets[-1], self.tile_buckets[-1]
        return (self.token_buckets[-1],)

    def shapes(self) -> list[tuple]:
        """Every forward key a step can have at these limits. With tiles, the (Rd, Tt)
        pairs whose fewest tokens (one more decode and one more tile than the buckets
        below) fit the budget: the scheduler charges a tile its whole size."""
        if not self.tiles:
            return [(t,) for t in self.token_buckets]

        def least(buckets, b):  # the fewest of a bucket's contents: one past the one below
            return 0 if b == 0 else buckets[buckets.index(b) - 1] + 1

        d, t = self.decode_buckets, self.tile_buckets
        return [
            (rd, tt)
            for rd in d
            for tt in t
            if (rd or tt) and least(d, rd) + least(t, tt) * self.tile_size <= self.budget
        ]

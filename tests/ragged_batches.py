"""Ragged paged attention batches for the kernel tests, built to catch indexing mistakes:
randomly permuted block tables, gaps of NaN query rows between requests and at the end,
padding requests (r >= num_seqs) whose metadata points at real rows, and NaN in every cache
slot no valid request owns; and the flat batch of one step as the attention backends read
it (`tiled_flat_batch`)."""

import jax.numpy as jnp
import numpy as np

# (kv_len, query_len): decodes, a fresh prefill, chunked-prefill continuations.
MIX = [(5, 1), (13, 13), (30, 7), (17, 1), (9, 9), (21, 3)]


def make_batch(
    seqs, *, n, k, h, s, dtype, seed=0, num_pad_requests=2, extra_pages=2, kv_dtype=None
):
    """Builds kernel arguments plus the contiguous numpy K/V each request sees. kv_dtype:
    the cache's dtype when it is not q's (float8)."""
    kv_dtype = kv_dtype or dtype
    rng = np.random.default_rng(seed)
    num_pages = [-(-kv_len // s) for kv_len, _ in seqs]
    p = max(num_pages) + extra_pages
    b = 1 + sum(num_pages) + 3  # block 0 is the null block; a few blocks stay unused
    cache = np.full((b, s, 2 * k, h), np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, b)))

    r = len(seqs) + num_pad_requests
    block_tables = np.zeros((r, p), np.int32)  # unused entries point at the NaN null block
    kv_lens = np.zeros(r, np.int32)
    query_start = np.zeros(r, np.int32)
    query_lens = np.zeros(r, np.int32)
    contiguous = []
    row = int(rng.integers(0, 3))
    for i, (kv_len, q_len) in enumerate(seqs):
        kv = rng.standard_normal((kv_len, 2 * k, h)).astype(np.float32)
        kv = kv.astype(kv_dtype).astype(np.float32)  # exactly representable in kv_dtype
        for j in range(num_pages[i]):
            page = free.pop()
            block_tables[i, j] = page
            chunk = kv[j * s : (j + 1) * s]
            cache[page, : len(chunk)] = chunk
        kv_lens[i], query_lens[i], query_start[i] = kv_len, q_len, row
        contiguous.append(kv)
        row += q_len + int(rng.integers(0, 4))  # gap of 0-3 padding rows
    t = row + 5  # trailing padding rows

    for i in range(len(seqs), r):  # padding requests overlapping real rows
        kv_lens[i], query_lens[i], query_start[i] = p * s, 4, 1
        block_tables[i] = rng.integers(0, b, p)

    q = np.full((t, n, h), np.nan, np.float32)
    for i, (_, q_len) in enumerate(seqs):
        q0 = query_start[i]
        q[q0 : q0 + q_len] = rng.standard_normal((q_len, n, h))
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(cache).astype(kv_dtype),
        jnp.asarray(kv_lens),
        jnp.asarray(block_tables),
        jnp.asarray(query_start),
        jnp.asarray(query_lens),
        jnp.asarray([len(seqs)], jnp.int32),
    )
    return args, contiguous


def owned_rows(args):
    """Boolean [T] mask of the rows that some valid request owns."""
    q, _, _, _, query_start, query_lens, num_seqs = args
    mask = np.zeros(q.shape[0], bool)
    for r in range(int(num_seqs[0])):
        mask[int(query_start[r]) : int(query_start[r] + query_lens[r])] = True
    return mask


def assert_matches(out, ref, args, dtype):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert out.shape == args[0].shape
    assert not np.isnan(out).any()
    assert (out[~owned_rows(args)] == 0).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


# Gemma 3's image tokens attend to each other both ways (q_horizon): per request
# (kv_len, query_len, image spans as (first, last) key positions within its query rows). A
# fresh prefill with two images, a chunk continuing an image begun in the previous chunk, an
# image ending at the context's end, one reaching past it (clipped to the context), beside
# decodes and a text-only chunk. With 8-row query blocks and 8-position pages, the spans'
# rows see pages past their blocks' last causal position.
HORIZON_SEQS = [
    (5, 1, []),
    (40, 40, [(3, 20), (26, 37)]),
    (50, 19, [(28, 45)]),
    (17, 1, []),
    (30, 10, [(21, 29)]),
    (21, 3, []),
    (25, 12, [(14, 30)]),
]


def horizon_batch(dtype, *, n=8, k=2, h=16, s=8, seed=0):
    """`make_batch` over HORIZON_SEQS, and its q_horizon [T]: a span's rows see up to its
    last position, the other rows of a request get a horizon at or before their own position
    (so none), and the rows no request owns anything."""
    seqs = [(kv_len, q_len) for kv_len, q_len, _ in HORIZON_SEQS]
    args, contiguous = make_batch(seqs, n=n, k=k, h=h, s=s, dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed)
    horizon = rng.integers(-1000, 10_000, args[0].shape[0])
    query_start = np.asarray(args[4])[: len(seqs)]
    for (kv_len, q_len, spans), q0 in zip(HORIZON_SEQS, query_start, strict=True):
        pos = kv_len - q_len + np.arange(q_len)
        rows = rng.integers(-5, pos + 1)
        for first, last in spans:
            rows = np.where((pos >= first) & (pos <= last), last, rows)
        horizon[q0 : q0 + q_len] = rows
    return args, contiguous, jnp.asarray(horizon, jnp.int32)


def tiled_flat_batch(
    rng, S, C, P, kv_token_bytes, decodes, prefills, window=None, chunk_size=None, tiles=None
):
    """A step's flat batch (jllm/attention/metadata.py:FlatBatch) with tiles of C queries,
    for a KV-cache group with sliding window `window` and chunked local attention of
    `chunk_size`: decode rows of context lengths `decodes` (longest first) and a padding
    decode row, then each prefill row ((cached, new) tokens) on tiles of its own, padding
    tiles up to `tiles` (at least one) and a padding row. Each request's blocks come from a
    shuffled pool; block 0 is the null block.
    -> (FlatBatch, B blocks, [R] the first key each row's first query sees)."""
    from jllm.attention.metadata import FlatBatch

    rows = [(kv - 1, 1) for kv in decodes] + [None] + list(prefills)  # None: padding
    Rd, R = len(decodes) + 1, len(rows) + 1
    B = 1 + sum(-(-(d + n) // S) for d, n in filter(None, rows))
    pool = iter(rng.permutation(np.arange(1, B)))
    used = sum(-(-n // C) for _, n in prefills)
    tiles = max(tiles or 0, used + 1)
    T = Rd + tiles * C
    flat = FlatBatch(
        slot_mapping=np.full(T, B * S, np.int32),  # padding writes to a dropped slot
        query_start=np.zeros(R, np.int32),
        query_lens=np.zeros(R, np.int32),
        kv_lens=np.zeros(R, np.int32),
        block_tables=np.zeros((R, P), np.int32),
        tile_row=np.full(tiles, R - 1, np.int32),
        tile_q_pos=np.full((tiles, C), -1, np.int32),
        num_decode_rows=Rd,
        block_size=S,
        kv_token_bytes=kv_token_bytes,
        window=window,
        chunk_size=chunk_size,
    )
    q0, tile = Rd, 0
    for r, row in enumerate(rows):
        if row is None:
            continue
        done, new = row
        pages = -(-(done + new) // S)
        flat.block_tables[r, :pages] = [next(pool) for _ in range(pages)]
        start = r if r < Rd else q0
        pos = np.arange(done, done + new)
        flat.query_start[r], flat.query_lens[r], flat.kv_lens[r] = start, new, done + new
        flat.slot_mapping[start : start + new] = flat.block_tables[r, pos // S] * S + pos % S
        if r >= Rd:
            n = -(-new // C)
            flat.tile_row[tile : tile + n] = r
            flat.tile_q_pos[tile : tile + n].reshape(-1)[:new] = pos
            q0, tile = q0 + n * C, tile + n
    first_q = flat.kv_lens - flat.query_lens
    first_key = np.zeros(R, np.int32)
    if window is not None:
        first_key = np.maximum(first_q - window + 1, first_key)
    if chunk_size is not None:
        first_key = np.maximum(first_q // chunk_size * chunk_size, first_key)
    return flat, B, first_key

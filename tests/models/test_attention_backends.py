"""The whole engine gives the same tokens on every attention backend (the C++ CPU kernel, the
default here; the XLA attention; the Pallas TPU and GPU kernels in interpret mode, and the GPU
kernel compiled where a GPU is present), the XLA tile attention matches the kernel kit's jnp
reference, and `auto` picks each platform's kernel or falls back to XLA with the reason."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import SMALL, mixed_step, prompt_ids
from ragged_batches import tiled_flat_batch

from jllm import LLM, SamplingParams
from jllm.attention import BACKENDS, AttentionBackend, get_backend, write_kv
from jllm.attention.options import AttentionOptions
from jllm.attention.xla import kv_chunk_pages, tile_attention
from jllm.config import ATTENTION_BACKENDS
from jllm.engine.platform import resolve_backend
from jllm.runner.compile_guard import count_compiles
from pallas_kernels.ragged_paged_attention import cpu as cpu_kernel
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference


def test_llama_llm_runs_the_cpu_kernel(llama_llm):
    assert llama_llm.llm_engine.runner.backend == "cpu_kernel"


def greedy_tokens(llm, max_tokens):
    """Decodes beside chunked prefills (a 32-token budget splits the 40-token prompt)."""
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(3, 6, seed=8)]
    prompts.append({"prompt_token_ids": prompt_ids(1, 40, seed=9)[0]})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "backend,max_tokens",
    [
        ("xla", 12),
        ("pallas_gpu_interpret", 5),
        pytest.param("pallas_interpret", 5, marks=pytest.mark.slow),
    ],
)
def test_engine_on_each_backend_matches_cpu_kernel(llama_dir, llama_llm, backend, max_tokens):
    llm = LLM(llama_dir, **{**SMALL, "attention_backend": backend, "max_num_batched_tokens": 32})
    assert llm.llm_engine.runner.backend == backend
    assert greedy_tokens(llm, max_tokens) == greedy_tokens(llama_llm, max_tokens)


def test_auto_backend_falls_back_when_the_kernel_cannot_be_built(monkeypatch, tmp_path):
    # A cache directory that cannot be created (an OSError, not a compiler error).
    monkeypatch.setattr(cpu_kernel.ATTENTION, "_state", {})
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    assert resolve_backend("auto", "cpu", jnp.bfloat16) == "xla"
    with pytest.raises(cpu_kernel.CpuKernelUnavailable, match="cannot build or load"):
        resolve_backend("cpu_kernel", "cpu", jnp.bfloat16)


def test_auto_backend_without_a_compiler(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernel.ATTENTION, "_state", {})
    monkeypatch.setenv("CXX", "no-such-compiler")
    with caplog.at_level("WARNING"):
        assert resolve_backend("auto", "cpu", jnp.float32) == "xla"
    assert "CPU attention kernel is unavailable" in caplog.text
    with pytest.raises(cpu_kernel.CpuKernelUnavailable, match="no-such-compiler"):
        resolve_backend("cpu_kernel", "cpu", jnp.float32)
    assert resolve_backend("auto", "cpu", jnp.float16) == "xla"  # a dtype it does not take
    assert resolve_backend("auto", "tpu", jnp.bfloat16) == "pallas"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        resolve_backend("cpu_kernel", "cpu", jnp.float16)
    with pytest.raises(ValueError, match="runs on CPU"):
        resolve_backend("cpu_kernel", "gpu", jnp.float32)


def test_auto_backend_on_gpu_and_shapes_the_gpu_kernel_refuses(caplog):
    assert resolve_backend("auto", "gpu", jnp.bfloat16, 128, 16) == "pallas_gpu"
    with caplog.at_level("WARNING"):
        assert resolve_backend("auto", "gpu", jnp.bfloat16, 80, 16) == "xla"
    assert "power-of-two head dim" in caplog.text
    assert resolve_backend("pallas_gpu", "gpu", jnp.bfloat16, 64, 32) == "pallas_gpu"
    assert resolve_backend("pallas_gpu_interpret", "cpu", jnp.float32, 16, 8) == (
        "pallas_gpu_interpret"
    )
    with pytest.raises(ValueError, match="runs on GPU, not cpu"):
        resolve_backend("pallas_gpu", "cpu", jnp.float32, 64, 16)
    with pytest.raises(ValueError, match="head dim of at least 16"):
        resolve_backend("pallas_gpu_interpret", "cpu", jnp.float32, 8, 16)


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU (benchmarks/gpu/run.sh)"
)
def test_engine_on_gpu_kernel_matches_xla_and_compiles_nothing_after_start(llama_dir):
    """On a GPU, float32: `auto` picks the Pallas GPU kernel, every bucket is compiled at
    start-up (nothing after), and greedy tokens equal the XLA attention's (both with full
    float32 products: a GPU's default float32 dot is TF32)."""
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(6, 9, seed=8)]
    prompts.append({"prompt_token_ids": prompt_ids(1, 150, seed=9)[0]})  # chunked
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    settings = dict(
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        disable_log_stats=True,
    )
    with jax.default_matmul_precision("highest"):
        llm = LLM(llama_dir, **settings)
        assert llm.llm_engine.runner.backend == "pallas_gpu"
        with count_compiles() as events:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, False)]
        assert events == []
        llm.llm_engine.shutdown()
        xla = LLM(llama_dir, attention_backend="xla", **settings)
        expected = [o.outputs[0].token_ids for o in xla.generate(prompts, params, False)]
    assert got == expected


@pytest.mark.parametrize("window,soft_cap", [(None, None), (20, None), (None, 2.5), (7, 2.5)])
@pytest.mark.parametrize("tile", [1, 16])
def test_tile_attention_matches_reference(tile, window, soft_cap):
    rng = np.random.default_rng(tile)
    B, S, K, G, H, P = 40, 8, 2, 3, 16, 64
    N = K * G
    cache = rng.normal(size=(1, B, S, 2 * K, H)).astype(np.float32)
    # Each tile: one request's queries at the end of its context (a chunk or a decode).
    kv_lens = np.array([5, 37, 64, 130], np.int32)
    tables = np.stack([rng.permutation(np.arange(1, B))[:P] for _ in kv_lens]).astype(np.int32)
    q = rng.normal(size=(len(kv_lens), tile, N, H)).astype(np.float32)
    n_valid = np.minimum(kv_lens, tile)
    q_pos = np.full((len(kv_lens), tile), -1, np.int32)
    for i, (n, kl) in enumerate(zip(n_valid, kv_lens, strict=True)):
        q_pos[i, :n] = np.arange(kl - n, kl)
    chunk = kv_chunk_pages(S, len(kv_lens), 2 * K * H * 4, tile) * S
    chunks = np.int32(-(-kv_lens.max() // chunk))
    out = tile_attention(
        jnp.asarray(q),
        jnp.asarray(cache),
        0,
        jnp.asarray(tables),
        jnp.asarray(kv_lens),
        jnp.asarray(q_pos),
        chunks,
        H**-0.5,
        window=window,
        soft_cap=soft_cap,
    )
    ref = ragged_paged_attention_reference(
        jnp.asarray(q.reshape(-1, N, H)),
        jnp.asarray(cache[0]),
        jnp.asarray(kv_lens),
        jnp.asarray(tables),
        jnp.asarray(np.arange(len(kv_lens)) * tile, np.int32),
        jnp.asarray(n_valid.astype(np.int32)),
        jnp.asarray([len(kv_lens)], np.int32),
        sm_scale=H**-0.5,
        sliding_window=window,
        soft_cap=soft_cap,
    )
    ref = np.asarray(ref).reshape(len(kv_lens), tile, N, H)
    for i, n in enumerate(n_valid):
        np.testing.assert_allclose(np.asarray(out)[i, :n], ref[i, :n], atol=2e-5)
        assert not np.asarray(out)[i, n:].any()


def layer_sized(hlo: str, cache_shape) -> list[str]:
    """Instructions of a compiled HLO module whose result is one layer of the cache
    ([B, S, 2K, H], with or without a leading 1): a copy of a layer."""
    dims = ",".join(map(str, cache_shape[1:]))
    pattern = re.compile(rf"= \w+\[(1,)?{dims}\]")
    return [line.strip() for line in hlo.splitlines() if pattern.search(line)]


@pytest.mark.parametrize("backend", ["pallas_interpret", "pallas_gpu_interpret", "cpu_kernel"])
def test_step_reads_the_stacked_cache_in_place(llama_dir, backend):
    """No backend slices a layer out of the stacked cache inside the layer scan (a copy of
    each layer per layer per step); the detector itself fires on a step that does."""
    llm = LLM(llama_dir, **{**SMALL, "attention_backend": backend})
    runner = llm.llm_engine.runner
    text = runner.forward_for(runner.layout.shapes()[-1]).as_text()
    (cache,) = runner.kv_cache  # one KV-cache group
    shape = cache.shape
    assert not layer_sized(text, shape)
    sliced = jax.jit(lambda c, i: c[i] * 2).lower(cache, 1).compile().as_text()
    assert layer_sized(sliced, shape)


@pytest.mark.parametrize(
    "capability,want", [("8.0", "xla"), ("8.9", "pallas_gpu"), ("9.0", "pallas_gpu")]
)
def test_fp8_cache_on_a_gpu_without_fp8_loads_takes_xla(monkeypatch, capability, want):
    """Triton loads float8 from compute capability 8.9 (Ada, Hopper): an A100 with
    kv_cache_dtype="fp8" gets the XLA attention on `auto` and an error when it asks for the
    GPU kernel."""
    from jllm.engine import platform

    class FakeGpu:
        compute_capability = capability

    monkeypatch.setattr(platform.jax, "devices", lambda *a: [FakeGpu()])
    assert resolve_backend("auto", "gpu", jnp.bfloat16, fp8_cache=True) == want
    assert resolve_backend("auto", "gpu", jnp.bfloat16) == "pallas_gpu"
    if want == "xla":
        with pytest.raises(ValueError, match="float8 from compute capability 8.9"):
            resolve_backend("pallas_gpu", "gpu", jnp.bfloat16, fp8_cache=True)


def test_backends_declare_what_they_run():
    """Every attention_backend name has an object; each refuses by name what it lacks
    (tests/attention/test_options.py: each option, each backend)."""
    assert set(BACKENDS) | {"auto"} == ATTENTION_BACKENDS
    for name in ("xla", "cpu_kernel", "pallas", "pallas_gpu"):
        assert {"window", "soft_cap"} <= get_backend(name).supported
    get_backend("cpu_kernel").check(AttentionOptions(scale=0.1, window=4096, soft_cap=50.0))
    plain = AttentionBackend("plain")  # a backend that declares no option
    with pytest.raises(ValueError, match="'plain' has no sliding window"):
        plain.check(AttentionOptions(scale=0.1, window=4096))
    with pytest.raises(ValueError, match="'plain' has no attention soft cap"):
        plain.check(AttentionOptions(scale=0.1, soft_cap=50.0))
    plain.check(AttentionOptions(scale=0.1))
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_backend("flash")


@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 2.0), (13, 1.5)])
def test_cpu_kernel_backend_attends_as_xla_with_window_and_soft_cap(window, soft_cap):
    """One step's batch (decodes, a prefill chunk after cached tokens, a fresh prefill), each
    backend with the metadata the step builder makes for it, the same q, k, v and stacked
    cache: the C++ kernel's attention (window and soft cap passed through) is the XLA one's."""
    from jllm.runner.buckets import BatchLayout
    from jllm.runner.inputs import build_step

    S, K, G, H = 4, 2, 3, 16
    layout = BatchLayout.create(
        block_size=S,
        num_blocks=64,
        tile_size=4,
        max_model_len=64,
        max_num_seqs=8,
        budget=64,
        kv_token_bytes=2 * K * H * 4,
    )
    batch, out = mixed_step(layout.max_pages, S)
    steps = {
        name: build_step(batch, out, layout, get_backend(name))[0] for name in ("cpu_kernel", "xla")
    }
    slots = steps["xla"].attn[0].slot_mapping
    np.testing.assert_array_equal(steps["cpu_kernel"].attn[0].slot_mapping, slots)
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.normal(size=(2, 64, S, 2 * K, H)), jnp.float32)  # [L, B, S, 2K, H]
    q = jnp.asarray(rng.normal(size=(len(slots), K * G, H)), jnp.float32)
    k, v = jnp.asarray(rng.normal(size=(2, len(slots), K, H)), jnp.float32)
    outs, caches = {}, {}
    for name, inputs in steps.items():
        backend = get_backend(name)
        attend = jax.jit(
            lambda q, k, v, cache, md, b=backend: b.attend(
                q,
                k,
                v,
                cache,
                1,
                md,
                AttentionOptions(scale=H**-0.5, window=window, soft_cap=soft_cap),
            )
        )
        outs[name], caches[name] = attend(q, k, v, cache, inputs.attn[0])
    real = slots < 64 * S  # the step's tokens, not padding
    assert real.sum() == 1 + 1 + 17 + 9
    np.testing.assert_array_equal(caches["cpu_kernel"], caches["xla"])
    np.testing.assert_allclose(
        np.asarray(outs["cpu_kernel"])[real], np.asarray(outs["xla"])[real], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    "backend",
    [
        "xla",
        "cpu_kernel",
        "pallas_interpret",
        "pallas_gpu_interpret",
        pytest.param("pallas_gpu", marks=pytest.mark.gpu),  # the GPU run's (benchmarks/gpu)
    ],
)
def test_pages_before_the_window_are_never_read(backend):
    """Decodes and prefill chunks far past a sliding window: every slot of a row's pages
    outside its window holds NaN (a freed block may hold anything), the pages wholly before
    it may be the null block 0, itself NaN, as is the layer the step does not attend; each
    backend's output is the reference's on the clean cache, and finite. The XLA path starts
    its loops past the chunk it can skip."""
    S, C, K, G, H, P, W = 16, 4, 2, 2, 16, 48, 40
    impl = get_backend(backend)
    reason = impl.unsupported(jax.devices()[0].platform, jnp.float32, H, S, False)
    if reason:
        pytest.skip(reason)
    try:
        impl.prepare()
    except cpu_kernel.CpuKernelUnavailable as e:
        pytest.skip(str(e))
    rng = np.random.default_rng(3)
    flat, B, win_start = tiled_flat_batch(
        rng, S, C, P, 2 * K * H * 4, [600, 530, 400], [(500, 20), (300, 9)], window=W
    )
    T = len(flat.slot_mapping)
    clean = rng.normal(size=(2, B, S, 2 * K, H)).astype(np.float32)  # [L, B, S, 2K, H]
    q = jnp.asarray(rng.normal(size=(T, K * G, H)), jnp.float32)
    k, v = jnp.asarray(rng.normal(size=(2, T, K, H)), jnp.float32)

    cache, tables = clean.copy(), flat.block_tables.copy()
    cache[0] = np.nan
    cache[1, 0] = np.nan
    for r, (lo, kv) in enumerate(zip(win_start, flat.kv_lens, strict=True)):
        # Every slot of the row's pages outside its window: before it, or past its context.
        pos = np.arange(-(-kv // S) * S)
        pos = pos[(pos < lo) | (pos >= kv)]
        cache[1, tables[r, pos // S], pos % S] = np.nan
        if r % 2:  # the entries of freed blocks may as well be the null block
            tables[r, : lo // S] = 0
    assert np.isnan(cache[1]).any(axis=(1, 2, 3)).sum() > B // 2
    md = impl.build_metadata(dataclasses.replace(flat, block_tables=tables))
    if backend == "xla":  # every band starts past the first chunk (256 keys)
        assert list(md.decode_first) == [1] and list(md.tile_first) == [1]
    attend = jax.jit(
        lambda q, k, v, cache, md: impl.attend(
            q, k, v, cache, 1, md, AttentionOptions(scale=H**-0.5, window=W, soft_cap=3.0)
        )
    )
    out = np.asarray(attend(q, k, v, jnp.asarray(cache), md)[0])

    written = write_kv(jnp.asarray(clean), 1, k, v, jnp.asarray(flat.slot_mapping))[1]
    ref = ragged_paged_attention_reference(
        q,
        written,
        *map(jnp.asarray, (flat.kv_lens, flat.block_tables, flat.query_start, flat.query_lens)),
        jnp.asarray([len(flat.kv_lens)], np.int32),
        sm_scale=H**-0.5,
        sliding_window=W,
        soft_cap=3.0,
    )
    real = flat.slot_mapping < B * S
    assert real.sum() == 3 + 20 + 9
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[real], np.asarray(ref)[real], atol=2e-5, rtol=1e-5)

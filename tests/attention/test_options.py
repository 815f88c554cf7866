"""Attention options as data (jllm/attention/options.py): the record checks its values and
hashes; each backend refuses by name each option it lacks, and the engine does so at
start-up (or, on `auto`, takes the XLA attention); a model's layers carry their options, which
`ctx.attend` takes as the record or as the old keywords alike."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from oracle import SMALL
from ragged_batches import tiled_flat_batch

from jllm import LLM
from jllm.attention import BACKENDS, AttentionOptions, get_backend
from jllm.attention.options import OPTION_NAMES, options_in
from jllm.engine import model_setup
from jllm.engine.platform import resolve_backend
from jllm.models.context import StepContext
from jllm.models.gemma import GemmaConfig, GemmaForCausalLM
from jllm.models.rope import RopeConfig

# The options the kernels implemented last, and one they lack, each as a layer would set it.
NEW = {
    "sinks": AttentionOptions(scale=0.125, sinks=True),
    "chunk_size": AttentionOptions(scale=0.125, chunk_size=8192),
    "v_head_dim": AttentionOptions(scale=0.125, v_head_dim=128),
}
KERNELS = [name for name in BACKENDS if name != "xla"]
# v_head_dim: the kernels take it in a latent layer only (`_Ragged.check`).
LACKING = [
    (b, o) for b in KERNELS for o in NEW if o not in get_backend(b).supported or o == "v_head_dim"
]


def test_the_record_checks_its_values_and_hashes():
    a = AttentionOptions(scale=np.float32(0.5), window=np.int64(4096), soft_cap=50)
    assert a == AttentionOptions(scale=0.5, window=4096, soft_cap=50.0)
    assert hash(a) == hash(AttentionOptions(scale=0.5, window=4096, soft_cap=50.0))
    assert type(a.scale) is float and type(a.window) is int and type(a.soft_cap) is float
    assert a.used() == ("window", "soft_cap")
    assert AttentionOptions(scale=1.0).used() == ()
    every = AttentionOptions(
        scale=1.0, window=1, soft_cap=1.0, chunk_size=1, sinks=True, latent=True, v_head_dim=1
    )
    assert set(every.used()) == set(OPTION_NAMES)
    with pytest.raises(TypeError):
        AttentionOptions(0.5)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.window = 8
    for bad, message in (
        (dict(scale=0.0), "scale must be a positive number, not 0.0"),
        (dict(scale=None), "need the layer's scale"),
        (dict(window=0), "window must be a positive int or None"),
        (dict(chunk_size=2.5), "chunk_size must be a positive int or None"),
        (dict(v_head_dim=True), "v_head_dim must be a positive int or None"),
        (dict(soft_cap=-1.0), "soft_cap must be a positive number or None"),
        (dict(sinks=1), "sinks says whether the layer has them"),
    ):
        with pytest.raises(ValueError, match=message):
            AttentionOptions(**{"scale": 1.0, **bad})


def test_only_xla_has_every_option():
    assert get_backend("xla").supported == frozenset(OPTION_NAMES)
    for options in NEW.values():
        get_backend("xla").check(options)


@pytest.mark.parametrize("backend,option", LACKING)
def test_kernels_refuse_what_they_lack_by_name(backend, option):
    impl = get_backend(backend)
    message = f"attention backend '{backend}' has no {OPTION_NAMES[option]} \\({option}="
    with pytest.raises(ValueError, match=message):
        impl.check(NEW[option])
    # attend refuses as well, before it touches any array (a caller that skipped the check)
    with pytest.raises(ValueError, match=message):
        impl.attend(None, None, None, None, 0, None, NEW[option])
    impl.check(AttentionOptions(scale=0.125, window=4096, soft_cap=50.0))


def test_start_up_refuses_or_falls_back_to_xla(caplog):
    layers = [AttentionOptions(scale=0.1, window=128), NEW["v_head_dim"]]
    for named in ("cpu_kernel", "pallas_interpret"):
        with pytest.raises(ValueError, match=f"attention_backend='{named}': .* value head size"):
            resolve_backend(named, "cpu", jnp.float32, options=layers)
    assert resolve_backend("xla", "cpu", jnp.float32, options=layers) == "xla"
    for platform in ("cpu", "gpu", "tpu"):
        with caplog.at_level("WARNING"):
            assert resolve_backend("auto", platform, jnp.bfloat16, options=layers) == "xla"
        assert "outside a latent layer, which the model uses" in caplog.text
        caplog.clear()
    for kernels_own in ("sinks", "chunk_size"):
        own = [AttentionOptions(scale=0.1, window=128), NEW[kernels_own]]
        assert resolve_backend("auto", "tpu", jnp.bfloat16, options=own) == "pallas"
    assert resolve_backend("auto", "tpu", jnp.bfloat16, options=layers[:1]) == "pallas"


def test_the_engine_refuses_at_start_up(llama_dir, monkeypatch):
    """A model whose layers' values are narrower than their keys (outside MLA), on the C++
    kernel: a ValueError naming both before anything compiles."""
    found = model_setup.options_in

    def narrower(model):
        return frozenset(dataclasses.replace(o, v_head_dim=8) for o in found(model))

    monkeypatch.setattr(model_setup, "options_in", narrower)
    with pytest.raises(ValueError, match="'cpu_kernel' has no value head size"):
        LLM(llama_dir, **{**SMALL, "attention_backend": "cpu_kernel"})


def test_a_model_carries_its_layers_options():
    H = 16
    cfg = GemmaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=H,
        rms_norm_eps=1e-5,
        rope=RopeConfig.from_hf(transformers.LlamaConfig(head_dim=H), H),
        tie_word_embeddings=False,
        max_position_embeddings=64,
        sliding_window=8,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        attn_soft_cap=30.0,
        query_pre_attn_scalar=H,
    )
    model = GemmaForCausalLM(cfg, jnp.float32, nnx.Rngs(0))
    assert options_in(model) == {
        AttentionOptions(scale=H**-0.5, window=8, soft_cap=30.0),
        AttentionOptions(scale=H**-0.5, soft_cap=30.0),
    }
    assert options_in(nnx.merge(*nnx.split(model))) == options_in(model)


def test_ctx_attend_takes_the_record_or_the_keywords():
    S, K, N, H = 8, 1, 2, 16
    rng = np.random.default_rng(0)
    flat, B, _ = tiled_flat_batch(rng, S, 4, 32, 2 * K * H * 4, [9, 5], [(3, 6)], window=4)
    xla = get_backend("xla")
    ctx = StepContext(
        positions=None, attn=(xla.build_metadata(flat),), backend=xla, layer=jnp.int32(0)
    )
    T = len(flat.slot_mapping)
    q = jnp.asarray(rng.normal(size=(T, N, H)), jnp.float32)
    k, v = jnp.asarray(rng.normal(size=(2, T, K, H)), jnp.float32)
    caches = (jnp.asarray(rng.normal(size=(1, B, S, 2 * K, H)), jnp.float32),)
    old, _ = ctx.attend(q, k, v, caches, scale=0.3, window=4, soft_cap=2.0)
    options = AttentionOptions(scale=0.3, window=4, soft_cap=2.0)
    new, _ = ctx.attend(q, k, v, caches, options=options)
    np.testing.assert_array_equal(old, new)
    sinks = jnp.asarray([3.0, -1.0])
    sunk, _ = ctx.attend(
        q, k, v, caches, options=dataclasses.replace(options, sinks=True), sinks=sinks
    )
    assert not np.allclose(sunk, new)
    with pytest.raises(ValueError, match="options= or scale/window/soft_cap, not both"):
        ctx.attend(q, k, v, caches, options=options, window=4)
    with pytest.raises(ValueError, match="needs the layer's options"):
        ctx.attend(q, k, v, caches)

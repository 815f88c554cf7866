"""The backends that run the ragged paged attention kit over the flat batch: its C++ CPU
flavour (`cpu_kernel`, the CPU's default) and its Pallas kernels (`pallas` for TPU,
`pallas_gpu` for CUDA, and both in interpret mode for testing on the CPU).

They read `RaggedMetadata` (query start and length, context length and block table per
row) and the whole stacked cache with the layer's index: the kernels read the layer's pages
in place (`kv_cache[layer]` here would copy the layer per layer per step). Under tensor
parallelism (the runner traces inside `jax.set_mesh`) each device runs the kernel on its own
heads.

Both kernels implement the sliding window and the soft cap, and MLA's latent attention (a
cache of one latent per token, no head axis, replicated under TP; its values are its first
v_head_dim lanes, the only value head size unlike the key's they take), and attention sinks
(gpt-oss's; not in a latent layer), and Llama 4's chunked local attention. A value head size
unlike the key's otherwise is lacking for now (`supported`), so a model that needs one is
refused by name at start-up (`auto` takes the XLA attention).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jllm.attention.base import (
    AttentionBackend,
    latent_inputs,
    model_mesh,
    write_step_kv,
    write_step_latent,
)
from jllm.attention.metadata import FlatBatch, RaggedMetadata, build_ragged
from jllm.attention.options import OPTION_NAMES, AttentionOptions
from jllm.config import batch_invariant
from pallas_kernels import gated_delta_rule as delta_rule
from pallas_kernels.ragged_paged_attention import (
    SUPPORTED_DTYPES,
    is_fp8_cache,
    load_cpu_kernel,
    ragged_paged_attention,
    ragged_paged_attention_cpu,
    ragged_paged_attention_cpu_sharded,
    ragged_paged_attention_gpu,
    ragged_paged_attention_sharded,
    unsupported_shape,
)
from sharding import MODEL_AXIS


@dataclasses.dataclass(frozen=True)
class _Ragged(AttentionBackend):
    supported = frozenset({"window", "soft_cap", "latent", "v_head_dim", "sinks", "chunk_size"})

    def build_metadata(self, flat: FlatBatch) -> RaggedMetadata:
        return build_ragged(flat)

    def check(self, options: AttentionOptions) -> None:
        super().check(options)
        if options.sinks and options.latent:
            raise ValueError(
                f"attention backend {self.name!r} has no {OPTION_NAMES['sinks']} "
                "(sinks=True) in a latent layer"
            )
        if options.v_head_dim is not None and not options.latent:
            raise ValueError(
                f"attention backend {self.name!r} has no {OPTION_NAMES['v_head_dim']} "
                f"(v_head_dim={options.v_head_dim}) outside a latent layer"
            )

    @staticmethod
    def write(q, k, v, kv_cache, layer, md, options: AttentionOptions):
        """The step's new keys and values (a latent layer's latents) written into the cache,
        the kernels' keyword options for the layer's layout. -> (cache, its float8 format,
        the latent's keywords)."""
        if options.latent:
            latent = latent_inputs(q, k, v, kv_cache, options)
            kv_cache, fp8 = write_step_latent(kv_cache, layer, latent, md)
            return kv_cache, fp8, dict(latent=True, v_head_dim=options.v_head_dim)
        kv_cache, fp8 = write_step_kv(kv_cache, layer, k, v, md)
        return kv_cache, fp8, {}


def gpu_without_fp8(platform: str) -> str | None:
    """Why this GPU cannot load float8 in Triton (compute capability below 8.9), or None."""
    if platform != "gpu":
        return None
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is None or tuple(map(int, str(capability).split(".")[:2])) >= (8, 9):
        return None
    return f"Triton reads float8 from compute capability 8.9, this GPU has {capability}"


@dataclasses.dataclass(frozen=True)
class CpuKernelBackend(_Ragged):
    """The C++ kernel: float32 and bfloat16 (and float8 caches), on the CPU, where a C++
    compiler builds it."""

    name: str = "cpu_kernel"

    def unsupported(self, platform, dtype, head_dim, block_size, fp8_cache):
        if platform != "cpu":
            return f"runs on CPU, not {platform}"
        if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
            return f"takes float32 or bfloat16, not {jnp.dtype(dtype).name}"
        return None

    def prepare(self) -> None:
        load_cpu_kernel()  # CpuKernelUnavailable says why it cannot be built

    def attend(self, q, k, v, kv_cache, layer, md, options: AttentionOptions, sinks=None):
        self.check(options)
        kv_cache, fp8, kw = self.write(q, k, v, kv_cache, layer, md, options)
        args = (md.kv_lens, md.block_tables, md.query_start, md.query_lens, md.num_seqs)
        if not is_fp8_cache(kv_cache.dtype, fp8):  # q in the cache's float dtype
            q = q.astype(kv_cache.dtype)
        kw |= dict(
            sm_scale=options.scale,
            sliding_window=options.window,
            soft_cap=options.soft_cap,
            fp8_dtype=fp8,
            batch_invariant=batch_invariant.enabled(),
        )
        if md.q_horizon is not None:  # image tokens that attend both ways (Gemma 3)
            kw["q_horizon"] = md.q_horizon
        if sinks is not None:  # gpt-oss's, one per query head
            kw["sinks"] = sinks
        if options.chunk_size is not None:  # Llama 4's chunked local attention
            kw["chunk_size"] = options.chunk_size
        mesh = model_mesh()
        if mesh is not None:
            out = ragged_paged_attention_cpu_sharded(
                mesh, MODEL_AXIS, q, kv_cache, layer, *args, **kw
            )
        else:
            out = ragged_paged_attention_cpu(q, kv_cache, *args, layer=layer, **kw)
        return out, kv_cache


@dataclasses.dataclass(frozen=True)
class PallasBackend(_Ragged):
    """`pallas` (TPU), `pallas_gpu` (Triton), and either in interpret mode."""

    name: str = "pallas"

    def check(self, options: AttentionOptions) -> None:
        super().check(options)
        # A latent's value lanes are one of the GPU kernel's two loads (its rotary lanes,
        # the model's head_dim, the other: `unsupported`).
        if options.latent and self.name.startswith("pallas_gpu"):
            reason = unsupported_shape(options.v_head_dim, 16)
            if reason:
                raise ValueError(
                    f"attention backend {self.name!r}, a latent's value lanes "
                    f"(kv_lora_rank {options.v_head_dim}): {reason}"
                )

    def unsupported(self, platform, dtype, head_dim, block_size, fp8_cache):
        if not self.name.startswith("pallas_gpu"):
            return None
        if self.name == "pallas_gpu" and platform != "gpu":
            return f"runs on GPU, not {platform}"
        # Triton's tile rules: power-of-two head dim (at least 16) and block size.
        reason = unsupported_shape(head_dim, block_size)
        if fp8_cache and not reason:
            reason = gpu_without_fp8(platform)
        return reason

    def delta_rule_kernel(self, key_dim: int, value_dim: int):
        """The kit's TPU or GPU kernel (interpreted under `*_interpret`); XLA's path where
        Triton cannot take the head dims."""
        interpret = self.name.endswith("_interpret")
        if not self.name.startswith("pallas_gpu"):
            return functools.partial(delta_rule.gated_delta_rule, interpret=interpret)
        if delta_rule.unsupported_shape(key_dim, value_dim):
            return delta_rule.gated_delta_rule_xla
        return functools.partial(delta_rule.gated_delta_rule_gpu, interpret=interpret)

    def attend(self, q, k, v, kv_cache, layer, md, options: AttentionOptions, sinks=None):
        self.check(options)
        kv_cache, fp8, kw = self.write(q, k, v, kv_cache, layer, md, options)
        args = (q, kv_cache, md.kv_lens, md.block_tables, md.query_start, md.query_lens)
        args = (*args, md.num_seqs)
        gpu = self.name.startswith("pallas_gpu")
        kernel = ragged_paged_attention_gpu if gpu else ragged_paged_attention
        kw |= dict(
            layer=layer,
            sm_scale=options.scale,
            sliding_window=options.window,
            soft_cap=options.soft_cap,
            interpret=self.name.endswith("_interpret"),
            fp8_dtype=fp8,
        )
        if md.q_horizon is not None:  # image tokens that attend both ways (Gemma 3)
            kw["q_horizon"] = md.q_horizon
        if gpu and batch_invariant.enabled():  # one tiling, no KV split
            kw["batch_invariant"] = True
        if sinks is not None:  # gpt-oss's, one per query head
            kw["sinks"] = sinks
        if options.chunk_size is not None:  # Llama 4's chunked local attention
            kw["chunk_size"] = options.chunk_size
        mesh = model_mesh()
        if mesh is not None:
            out = ragged_paged_attention_sharded(mesh, MODEL_AXIS, *args, kernel=kernel, **kw)
        else:
            out = kernel(*args, **kw)
        return out, kv_cache

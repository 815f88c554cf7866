"""Platform policy: which dtype, attention backend and minimum row count an engine uses on
this platform, and the start-up report of how tensor parallelism split the model.

Each rule states the measurement it follows. Host-side policy over JAX device facts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from jllm.attention import AttentionBackend, get_backend
from jllm.attention.options import AttentionOptions
from jllm.config import batch_invariant
from jllm.models import bf16_matmul, f32_matmul
from pallas_kernels.cpu.build import CpuKernelUnavailable, cpu_flags

logger = logging.getLogger("jllm")

_DTYPES = {
    "half": jnp.float16,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float": jnp.float32,
    "float32": jnp.float32,
}


# The x86 instruction sets under which bf16 runs faster than float32 on CPU, as
# /proc/cpuinfo names them, best first, and what bf16 measured against float32 there
# (SmolLM2, benchmarks/throughput.py, one run each). AMX and AVX512-BF16: bf16 matrix
# instructions (XLA's products, the bf16 kernel). AVX2 with FMA: none, but the float32
# kernel widens bf16 operands as it reads them (f32_matmul.py), half the bytes to read.
CPU_BF16_ISAS = {
    "amx_bf16": "AMX-BF16: bf16 matmuls ran 4x fp32 at 2048 rows and 2.6x at 64 (2-core Xeon)",
    "avx512_bf16": "AVX512-BF16: bf16 ran W1 1.58x and S1 1.49x fp32 (2-core Zen 4)",
    "avx2": (
        "AVX2 with FMA and no bf16 instructions, where the float32 kernel widens bf16: bf16 "
        "ran W3 1.07x, S1 1.17x and W1 0.96x fp32 (2-core Zen 3)"
    ),
}


# vLLM's --device values -> JAX's platform names.
DEVICES = {"auto": None, "cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}


def select_platform(device: str) -> str:
    """The JAX platform the engine runs on for vLLM's `device` (`auto`: JAX's default);
    ValueError when this host's JAX has no such backend, or has started on another one."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {sorted(DEVICES)}, got {device!r}.")
    wanted = DEVICES[device]
    if wanted is None:
        return jax.devices()[0].platform
    try:
        jax.devices(wanted)
    except RuntimeError as e:
        extra = {"gpu": "jax[cuda]", "tpu": "jax[tpu]"}.get(wanted)
        hint = f" (install jllm's `{extra.split('[')[1][:-1]}` extra: {extra})" if extra else ""
        raise ValueError(
            f"device={device!r} was asked for, but JAX has no {wanted} backend on this "
            f"host{hint}: {e}"
        ) from e
    default = jax.devices()[0].platform
    if default != wanted:
        raise ValueError(
            f"device={device!r}: JAX's default backend here is {default}; start the process "
            f"with JAX_PLATFORMS={wanted} to run on {wanted}."
        )
    return wanted


def cpu_bf16_isa() -> str | None:
    """This x86 CPU's best instruction set for bf16 (a key of CPU_BF16_ISAS), or None: AVX2
    counts only where the float32 kernel runs (FMA, and a compiler that built it)."""
    flags = cpu_flags()
    isa = next((isa for isa in CPU_BF16_ISAS if isa in flags), None)
    if isa == "avx2":
        from jllm.models import f32_matmul  # the kernel's build, once per process

        return isa if f32_matmul.supported() and f32_matmul.enabled() else None
    return isa


def resolve_dtype(dtype: str, checkpoint_dtype: str, platform: str, isa: str | None | bool = True):
    """vLLM's `dtype` values. "auto" on accelerators: the checkpoint's dtype (bfloat16 for
    float32 checkpoints). On CPU: bfloat16 for a 16-bit checkpoint (float16, bfloat16, or a
    quantized GGUF) where bf16 measured faster than float32 (CPU_BF16_ISAS: AMX, AVX512-BF16,
    or AVX2 with FMA and the float32 kernel widening bf16), else float32 (a CPU without
    AVX2 and FMA, or without a C++ compiler: XLA's CPU bf16 products convert to float32 after
    copying each layer's weights, and on the Zen 3 bf16 ran W1 at 0.74x and W3 at 0.88x of
    float32 that way, docs/cpu.md). `isa`: the CPU's (`cpu_bf16_isa`), read from the CPU when
    left True. The choice and its reason are logged."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if platform == "cpu":
        if isa is True:
            isa = cpu_bf16_isa()
        sixteen_bit = checkpoint_dtype in ("bfloat16", "float16", "half")
        if sixteen_bit and isa:
            logger.info("dtype auto: bfloat16 on this CPU, which has %s.", CPU_BF16_ISAS[isa])
            return jnp.bfloat16
        logger.info(
            "dtype auto: float32 (%s).",
            "a float32 checkpoint"
            if not sixteen_bit
            else "this CPU has neither AMX, AVX512-BF16, nor AVX2 with FMA and the C++ kernel",
        )
        return jnp.float32
    if checkpoint_dtype in ("float32", "float"):
        return jnp.bfloat16
    return _DTYPES.get(checkpoint_dtype, jnp.bfloat16)


def min_dot_rows(dtype, platform: str) -> int:
    """XLA's CPU backend multiplies a single 16-bit row by a weight matrix about 15x slower
    than two rows (a 1x576 by 576x49152 bf16 product: 29 ms against 1.9 ms), so on CPU a
    16-bit model never runs a step with fewer than two rows: one decode gets a padding row."""
    return 2 if platform == "cpu" and jnp.dtype(dtype).itemsize == 2 else 1


# What `auto` tries on each platform, in order, before the XLA attention.
AUTO_BACKENDS = {"tpu": ("pallas",), "gpu": ("pallas_gpu",), "cpu": ("cpu_kernel",)}


def resolve_backend(
    requested: str,
    platform: str,
    dtype,
    head_dim: int = 64,
    block_size: int = 16,
    fp8_cache: bool = False,
    options: Iterable[AttentionOptions] = (),
) -> str:
    """The attention backend's name. A backend asked for by name must run here (its
    `unsupported` reason is a ValueError; a kernel that cannot be built raises its own
    error) and implement every option of the model's layers (`options`: their
    AttentionOptions; a ValueError names the first it lacks). auto: the Pallas TPU kernel on
    TPU; the Pallas GPU kernel on GPU where Triton's tile rules take the head dim and block
    size and, for a float8 KV cache, the GPU has float8 loads; the C++ kernel on CPU (float32
    and bfloat16, where a C++ compiler can build it); each where it implements the layers'
    options; otherwise the XLA attention (which implements all of them), with the reason
    logged."""
    shapes = (platform, dtype, head_dim, block_size, fp8_cache)
    options = tuple(options)
    if requested != "auto":
        backend = get_backend(requested)
        reason = backend.unsupported(*shapes) or lacking(backend, options)
        if reason:
            raise ValueError(f"attention_backend={requested!r}: {reason}")
        backend.prepare()
        return requested
    for name in AUTO_BACKENDS.get(platform, ()):
        backend = get_backend(name)
        reason = backend.unsupported(*shapes) or lacking(backend, options)
        if reason is None:
            try:
                backend.prepare()
                return name
            except CpuKernelUnavailable as e:
                reason = f"the CPU attention kernel is unavailable: {e}"
        logger.warning("Using the XLA attention: %s", reason)
    return "xla"


def lacking(backend: AttentionBackend, options: Iterable[AttentionOptions]) -> str | None:
    """Why `backend` cannot run layers of these options (its refusal of the first it
    lacks), or None."""
    try:
        for layer_options in sorted(options, key=repr):  # the same first on every run
            backend.check(layer_options)
    except ValueError as e:
        return f"{e}, which the model uses"
    return None


def per_device_bytes(arrays) -> int:
    """Bytes of `arrays` held by the first device."""
    first = None
    total = 0
    for a in jax.tree_util.tree_leaves(arrays):
        for shard in a.addressable_shards:
            first = first or shard.device
            if shard.device == first:
                total += shard.data.nbytes
    return total


def log_split(mesh, state, kv_cache: tuple, replicas: int, stage_layers=None) -> None:
    """`kv_cache`: the model's KV-cache groups' caches; `stage_layers`: each pipeline
    stage's layer count."""
    weights = jax.tree_util.tree_leaves(state)
    total = sum(w.nbytes for w in weights)
    tp, pp = mesh.shape["model"], mesh.shape.get("stage", 1)
    splits = []
    if pp > 1:
        layers = ", ".join(map(str, stage_layers))
        splits.append(f"{pp} pipeline stages of {tp} device(s) hold {layers} layers")
    if tp > 1:
        replicated = f", each kv head replicated {replicas}x" if replicas > 1 else ""
        splits.append(
            f"tensor parallel over {tp} devices: heads, kv heads, MLP and vocabulary split on "
            f"the 'model' axis{replicated}"
        )
    what = "; ".join(splits)
    logger.info(
        "%s (%s); each device holds %.3f GiB of the %.3f GiB of weights and %.3f GiB of the "
        "%.3f GiB KV cache.",
        what[:1].upper() + what[1:],
        ", ".join(str(d) for d in mesh.devices.flat),
        per_device_bytes(weights) / 2**30,
        total / 2**30,
        per_device_bytes(kv_cache) / 2**30,
        sum(c.nbytes for c in jax.tree.leaves(kv_cache)) / 2**30,
    )


def resolve_async_scheduling(
    requested: bool | None, platform: str, speculative: bool = False
) -> bool:
    """Async scheduling overlaps the host's work for step N+1 with the device's step N. On
    an accelerator the host is otherwise idle while the device runs; on the CPU the device
    is the same cores, so the default follows what was measured there (docs/performance.md).
    Drafts are proposed from a step's results, so speculative decoding runs synchronously."""
    if speculative:
        if requested:
            raise ValueError(
                "async_scheduling=True cannot be combined with speculative decoding yet: "
                "drafts are proposed from the previous step's tokens."
            )
        return False
    if requested is not None:
        return requested
    return platform != "cpu"


def resolve_batch_invariant(requested: bool | None, platform: str, tp: int, pp: int) -> bool:
    """The batch-invariant mode of this engine (`batch_invariant`; None: vLLM's
    `VLLM_BATCH_INVARIANT`), which its steps are traced in (jllm/config/batch_invariant.py).
    Where it is not built yet it is refused by name: it holds on the CPU's kernels, on one
    device."""
    on = batch_invariant.enabled() if requested is None else bool(requested)
    if on and platform != "cpu":
        raise ValueError(
            "Batch-invariant mode (VLLM_BATCH_INVARIANT / batch_invariant) runs on the CPU "
            f"backend only in jllm yet, not on {platform!r}."
        )
    if on and tp * pp > 1:
        raise ValueError(
            "Batch-invariant mode (VLLM_BATCH_INVARIANT / batch_invariant) needs one device "
            "in jllm yet (tensor_parallel_size and pipeline_parallel_size 1): sharded layer "
            "products are XLA's."
        )
    if on:
        logger.info(
            "Batch-invariant mode: a request's tokens and logprobs do not depend on "
            "its neighbours (docs/sampling.md)."
        )
    return on


def check_batch_invariant(on: bool, backend: str, dtype, args) -> None:
    """In the batch-invariant mode (`on`), what runs a step must sum each row in one order
    whatever its neighbours: the C++ CPU attention kernel (the xla backend's chunking
    follows the bucket) and the C++ layer-product kernels (XLA's products block by shape);
    quantized weights and LoRA deltas, whose products are others, are refused for now."""
    if not on:
        return
    if backend != "cpu_kernel":
        raise ValueError(
            f"Batch-invariant mode needs the 'cpu_kernel' attention backend; {backend!r} sums "
            "a query's keys in an order that depends on the step's shape."
        )
    with batch_invariant.scope(True):
        kernel = bf16_matmul.applies(dtype) or f32_matmul.applies(dtype)
    if not kernel:
        raise ValueError(
            f"Batch-invariant mode needs jllm's C++ layer products for {jnp.dtype(dtype).name} "
            "on this CPU (float32: x86 with FMA; bfloat16: AVX512-BF16, or AVX2 with FMA "
            "widening to float32); XLA's products here sum in an order that depends on the "
            "number of rows."
        )
    if args.quantization is not None or args.enable_lora:
        raise ValueError(
            "Batch-invariant mode does not cover quantized weights or LoRA adapters in jllm "
            "yet (their products are not the row-invariant kernels)."
        )

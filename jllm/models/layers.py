"""The building blocks every decoder family shares: `Linear` and `RMSNorm`.

Every projection of every model is a `Linear`: one einsum with an optional bias, its weight
annotated with logical axis names for sharding. It is the one place where quantized weights
(int8/fp8/4-bit with scales) and LoRA deltas will plug in, so that no model writes its own
matmuls on raw parameters.

Glossary: T tokens, D model dim, N query heads, K kv heads, H head dim, F ffn, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jllm.config import batch_invariant
from jllm.lora.layers import lora_delta
from jllm.models import bf16_matmul, f32_matmul, invariant, layer_ops
from jllm.quantization.weights import QuantizedWeight, matmul


def param(rngs: nnx.Rngs, shape, axes, dtype, scale=0.02, **metadata) -> nnx.Param:
    value = jax.random.normal(rngs.params(), shape, dtype) * scale
    return nnx.Param(value, logical_axes=axes, **metadata)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedWeight:
    """One layer of a stacked [L, ...] Linear weight, left in the stack: what the layer scan
    hands a Linear whose product a CPU kernel runs (bf16_matmul.py, f32_matmul.py), so that
    the kernel reads the layer in place instead of XLA copying it out of the stack."""

    stack: jax.Array  # [L, *weight shape]
    layer: jax.Array  # int32 scalar


class Linear(nnx.Module):
    """y = einsum(spec, x, weight) (+ bias), e.g. spec "TD,DNH->TNH" with weight [D, N, H] and
    bias [N, H]. The weight's layout is ours; the loader converts checkpoints to it.

    The weight's leading `contract` axes are the ones the einsum sums over. A quantized
    weight (the loader's, `quantization=`) is a `QuantizedWeight` [Out, In] over the
    flattened output and input axes instead: x's contracted axes are flattened into In.

    `ctx`, the step context (models/context.py), carries what is per token: the tokens that
    are not padding (a kernel skips the rest), and the adapter slots a LoRA delta will read.

    `packed` (set by `pack_stacked_weights`): the stacked weight is held as the bf16 kernel's
    packed panels of its [L, In, Out] view (bf16_matmul.py `pack`), which the kernel reads
    without packing it on every call. `packable`: False where a module reads the weight
    itself, not through this Linear."""

    packed = False
    packable = True

    def __init__(
        self,
        spec: str,
        shape: tuple[int, ...],
        axes: tuple[str, ...],
        dtype,
        rngs: nnx.Rngs,
        bias_dims: int = 0,
    ):
        self.spec = spec
        inputs, output = spec.replace(" ", "").split("->")
        self.contract = len(set(inputs.split(",")[1]) - set(output))
        self.in_shape = tuple(shape[: self.contract])
        self.out_shape = tuple(shape[self.contract :])
        self.weight = param(rngs, shape, axes, dtype, contract=self.contract)
        self.use_bias = bias_dims > 0
        if self.use_bias:  # over the last `bias_dims` output axes
            self.bias = nnx.Param(
                jnp.zeros(shape[-bias_dims:], dtype), logical_axes=axes[-bias_dims:]
            )

    def __call__(self, x, ctx=None, *, out_dtype=None):
        w = self.weight.get_value()
        if self.packed:
            y = self._packed_product(x, w, ctx, out_dtype)
        elif isinstance(w, StackedWeight):
            y = self._stacked_product(x, w, ctx, out_dtype)
        elif isinstance(w, QuantizedWeight):
            lead = x.shape[: x.ndim - self.contract]
            y = matmul(x.reshape(-1, w.shape[-1]), w, out_dtype)
            y = y.reshape(*lead, *self.out_shape)
        else:
            y = jnp.einsum(self.spec, x, w, preferred_element_type=out_dtype)
        if self.use_bias:
            y = y + self.bias[...]
        if self.has_lora(ctx, x):
            y = y + lora_delta(x, self.lora_a[...], self.lora_b[...], ctx.lora_slots).astype(
                y.dtype
            )
        return y

    def has_lora(self, ctx, x=None) -> bool:
        """Whether this projection adds LoRA deltas in this step: it has slot arrays
        (jllm/lora/layers.py) and the context carries a slot per row of x."""
        if getattr(self, "lora_a", None) is None or ctx is None or ctx.lora_slots is None:
            return False
        return x is None or x.shape[0] == ctx.lora_slots.shape[0]

    def in_place(self, x, out_dtype=None) -> bool:
        """Whether a kernel multiplies x by this Linear's weight in the stack: the weight is
        a StackedWeight of x's dtype, bf16 (the bf16 kernel, or the float32 one widening it)
        or float32 (the float32 kernel, for a float32 result), and x's trailing axes are the
        weight's leading (contracted) ones in order, as in every projection here. Whether a
        step's weights stay stacked at all (by their dtype) the model decides once, with the
        kernels' `applies`."""
        w = self.weight.get_value()
        if not isinstance(w, StackedWeight) or x.dtype != w.stack.dtype:
            return False
        inputs, output = self.spec.replace(" ", "").split("->")
        x_axes, w_axes = inputs.split(",")
        c = self.contract
        if not (x_axes[-c:] == w_axes[:c] and output == x_axes[:-c] + w_axes[c:]):
            return False
        if x.dtype == jnp.bfloat16:
            return True
        f32_out = out_dtype is None or jnp.dtype(out_dtype) == jnp.float32
        return x.dtype == jnp.float32 and f32_out

    def stack_2d(self) -> jax.Array:
        """The stacked weight as [L, In, Out] (row-major: a bitcast, no copy); a packed one
        as it is held."""
        stack = self.weight.get_value().stack
        if self.packed:
            return stack
        k = math.prod(stack.shape[1 : 1 + self.contract])
        return stack.reshape(stack.shape[0], k, math.prod(self.out_shape))

    def _stacked_product(self, x, w: StackedWeight, ctx, out_dtype):
        """The kernel's product where it applies (`in_place`); the layer's slice through XLA
        else."""
        if not self.in_place(x, out_dtype):
            return jnp.einsum(self.spec, x, w.stack[w.layer], preferred_element_type=out_dtype)
        out_dtype = out_dtype or x.dtype
        if on_bf16_kernel(x):
            product = bf16_matmul.bf16_matmul
            return self.kernel_call(
                x, ctx, lambda x, stack, layer, live: product(x, stack, layer, out_dtype, live)
            )
        product = f32_matmul.f32_matmul
        return self.kernel_call(
            x,
            ctx,
            lambda x, stack, layer, live: product(x, stack, layer, live, out_dtype=out_dtype),
        )

    def _packed_product(self, x, w, ctx, out_dtype):
        """A packed weight's product: the kernel's where it applies, else XLA's of the layer
        unpacked (a lowering for another platform, a float32 x)."""
        n = math.prod(self.out_shape)
        if isinstance(w, StackedWeight) and self.in_place(x, out_dtype) and on_bf16_kernel(x):
            out_dtype = out_dtype or x.dtype
            product = bf16_matmul.bf16_matmul_packed
            return self.kernel_call(
                x, ctx, lambda x, stack, layer, live: product(x, stack, n, layer, out_dtype, live)
            )
        layer = w.stack[w.layer] if isinstance(w, StackedWeight) else w
        weight = bf16_matmul.unpack(layer, math.prod(self.in_shape), n)
        weight = weight.reshape(*self.in_shape, *self.out_shape)
        return jnp.einsum(self.spec, x, weight, preferred_element_type=out_dtype)

    def kernel_call(self, x, ctx, product):
        """product(x [M, In], stack [L, In, Out], layer, live) -> [M, Out], with x's
        contracted axes flattened into In and the result in this Linear's output shape;
        `live` the context's non-padding tokens when x has a row per token, else None."""
        w, stack = self.weight.get_value(), self.stack_2d()
        lead = x.shape[: x.ndim - self.contract]
        x = x.reshape(-1, math.prod(self.in_shape))
        live = None if ctx is None else ctx.live
        if live is not None and live.shape != x.shape[:1]:
            live = None
        return product(x, stack, w.layer, live).reshape(*lead, *self.out_shape)


def on_bf16_kernel(x) -> bool:
    """Which kernel multiplies an x whose weights are read in place: the bf16 one (AVX512-BF16)
    for bf16 x where it runs, else the float32 one (float32 x, or bf16 x widened)."""
    return x.dtype == jnp.bfloat16 and bf16_matmul.enabled(batch_invariant.enabled())


# A gated MLP's activation, by transformers' `hidden_act` / `hidden_activation` name.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),  # Gemma's GeGLU
    "gelu_tanh": partial(jax.nn.gelu, approximate=True),
}


def activation(name: str, table: dict = ACTIVATIONS, what: str = "MLP"):
    """The function `table` has for transformers' activation `name`; ValueError naming the
    supported ones (`what`: whose activations they are, for the message)."""
    if name not in table:
        raise ValueError(
            f"{what} activation {name!r} is not supported by jllm yet (supported: "
            f"{', '.join(sorted(table))})."
        )
    return table[name]


def gated_product(gate: Linear, up: Linear, x, ctx=None, act: str = "silu"):
    """act(gate(x)) * up(x), a gated MLP's first half: for SiLU in one pass of a kernel (the
    bf16 one, or the float32 one, widening bf16) where both weights are read in place without
    biases, the two products and the activation otherwise. Takes the step context as `Linear`
    does (a LoRA delta joins each product before the activation)."""
    both = gate.in_place(x) and up.in_place(x) and not (gate.use_bias or up.use_bias)
    both = both and act == "silu" and not (gate.has_lora(ctx, x) or up.has_lora(ctx, x))
    packed = gate.packed and up.packed
    if packed != (gate.packed or up.packed) or (packed and not on_bf16_kernel(x)):
        both = False
    if not both:
        return activation(act)(gate(x, ctx)) * up(x, ctx)
    up_stack = up.stack_2d()
    if packed:
        n = math.prod(gate.out_shape)
        product = bf16_matmul.bf16_gated_matmul_packed
        return gate.kernel_call(
            x, ctx, lambda x, stack, layer, live: product(x, stack, up_stack, n, layer, live=live)
        )
    if on_bf16_kernel(x):
        product = bf16_matmul.bf16_gated_matmul
    else:
        product = f32_matmul.f32_gated_matmul
    return gate.kernel_call(
        x, ctx, lambda x, stack, layer, live: product(x, stack, up_stack, layer, live=live)
    )


class RMSNorm(nnx.Module):
    """Over the last axis, in float32 (x [..., dim]). Llama's scales the normalised x, cast
    back to x's dtype, by `w`; Gemma's (`unit_offset`) scales it by `1 + w` in float32 and
    casts after, as each family's checkpoints were trained. Where the CPU's bf16 kernels run,
    one pass of layer_ops.py's kernel (`add`: with the residual add before it)."""

    def __init__(self, dim: int, eps: float, dtype, unit_offset: bool = False):
        init = jnp.zeros if unit_offset else jnp.ones
        self.weight = nnx.Param(init((dim,), dtype), logical_axes=("norm",))
        self.eps = eps
        self.unit_offset = unit_offset

    def _on_kernel(self, x) -> bool:
        return x.dtype == self.weight[...].dtype and layer_ops.applies(x.dtype)

    def __call__(self, x):
        if self._on_kernel(x):
            return layer_ops.rms_norm(x, self.weight[...], self.eps, self.unit_offset)
        x32 = x.astype(jnp.float32)
        if batch_invariant.enabled():  # one summation order whatever the rows
            # and a correctly rounded 1 / sqrt: XLA's vectorized rsqrt (an estimate refined
            # by Newton's step) and its scalar one differ in the last bit
            (squares,) = invariant.uncontracted(x32 * x32)
            var = invariant.row_mean(squares)
            normed = x32 * (1.0 / jnp.sqrt(var + self.eps))
        else:
            var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
            normed = x32 * jax.lax.rsqrt(var + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return normed.astype(x.dtype) * self.weight[...]

    def add(self, x, h):
        """(x + h, the norm of it): the residual add and the norm after it, in one pass on
        the CPU kernel where it runs (layer_ops.py)."""
        if self._on_kernel(x) and h.dtype == x.dtype and h.shape == x.shape:
            return layer_ops.add_rms_norm(x, h, self.weight[...], self.eps, self.unit_offset)
        x = x + h
        return x, self(x)

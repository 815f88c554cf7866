"""The image encoder as its own executable: a step's new images (the scheduler's
`encoder_inputs`) run through the vision tower and projector in static buckets of images,
their embeddings written into the device's encoder cache (`pool` [slots, P, D], vLLM's
encoder cache), which the forward reads at each image token (`StepInputs.embed_index`).

Every bucket compiles at start-up with the forward's buckets; the pool is donated, so the
write is in place, and JAX orders it after every step already dispatched that reads the pool.

Glossary: N images, C channels, P tokens per image, D model dim.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.runner.compile_guard import CompileAfterWarmupError
from jllm.runner.inputs import pow2_buckets


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pool",))
def encode_step(state, pool, pixels, slots, *, graphdef):
    """pixels [N, C, H, W] -> their embeddings written at `slots` [N] of the pool (a slot
    past the pool, padding, writes nothing)."""
    model = nnx.merge(graphdef, state)
    embeds = model.encode_images(pixels)  # [N, P, D]
    return pool.at[slots].set(embeds.astype(pool.dtype), mode="drop")


class ImageEncoder:
    def __init__(self, graphdef, vision, num_slots: int, max_images: int, dtype, sharding):
        """`vision`: the model's VisionConfig; `max_images`: the most new images a step can
        bring (its largest bucket)."""
        self.graphdef = graphdef
        self.num_slots = num_slots
        self.pixel_shape = (vision.num_channels, vision.image_size, vision.image_size)
        shape = (num_slots, vision.tokens_per_image, vision.text_hidden_size)
        self.pool = jax.device_put(np.zeros(shape, jnp.dtype(dtype)), sharding)
        self.sharding = sharding
        self.buckets = pow2_buckets(max_images)
        self._exe: dict[int, object] = {}
        self.compile_guard = False

    def _executable(self, state, n: int):
        exe = self._exe.get(n)
        if exe is None:
            if self.compile_guard:
                raise CompileAfterWarmupError(f"image encoder bucket ({n} images) not compiled")
            pixels = jax.ShapeDtypeStruct(
                (n, *self.pixel_shape), jnp.float32, sharding=self.sharding
            )
            slots = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.sharding)
            exe = self._exe[n] = encode_step.lower(
                state, self.pool, pixels, slots, graphdef=self.graphdef
            ).compile()
        return exe

    def compile_all(self, state) -> None:
        for n in self.buckets:
            self._executable(state, n)

    def run(self, state, inputs: list[tuple[int, np.ndarray]]) -> None:
        """Encode `inputs` ((slot, pixels [C, H, W]) each) into the pool, in buckets."""
        largest = self.buckets[-1]
        for lo in range(0, len(inputs), largest):
            part = inputs[lo : lo + largest]
            n = next(b for b in self.buckets if b >= len(part))
            pixels = np.zeros((n, *self.pixel_shape), np.float32)
            slots = np.full(n, self.num_slots, np.int32)
            for i, (slot, px) in enumerate(part):
                pixels[i], slots[i] = px, slot
            pixels, slots = jax.device_put((pixels, slots), self.sharding)
            self.pool = self._executable(state, n)(state, self.pool, pixels, slots)

"""The image encoder as its own executable: a step's new images (the scheduler's
`encoder_inputs`) run through the vision tower and projector in static buckets of images,
their embeddings written into the device's encoder cache (`pool` [slots, P, D], vLLM's
encoder cache), which the forward reads at each image token (`StepInputs.embed_index`).

`ImageEncoder` is the runner manager (`runner/manager.py`) that owns the pool: a step's
writes are its new images ((slot, pixels) each), which travel to the other processes of a
multi-process engine as arrays. Every bucket compiles at start-up with the forward's
buckets; the pool is donated, so the write is in place, and JAX orders it after every step
already dispatched that reads the pool.

Glossary: N images, C channels, P tokens per image, D model dim.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.distributed.codec import expect_array, expect_indexed, expect_list
from jllm.runner.buckets import pow2_buckets
from jllm.runner.manager import RunnerManager


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pool",))
def encode_step(state, pool, pixels, slots, *, graphdef):
    """pixels [N, C, H, W] -> their embeddings written at `slots` [N] of the pool (a slot
    past the pool, padding, writes nothing)."""
    model = nnx.merge(graphdef, state)
    embeds = model.encode_images(pixels)  # [N, P, D]
    return pool.at[slots].set(embeds.astype(pool.dtype), mode="drop")


class ImageEncoder(RunnerManager):
    name = "images"

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

    def _executable(self, runner, n: int):
        def lower():
            pixels = jax.ShapeDtypeStruct(
                (n, *self.pixel_shape), jnp.float32, sharding=self.sharding
            )
            slots = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.sharding)
            return encode_step.lower(runner.state, self.pool, pixels, slots, graphdef=self.graphdef)

        return runner.table.get("image encoder", n, lower)

    def compile_all(self, runner) -> None:
        for n in self.buckets:
            self._executable(runner, n)

    def apply(self, runner, writes: list[tuple[int, np.ndarray]]) -> None:
        """Encode the new images ((slot, pixels [C, H, W]) each) into the pool, in buckets."""
        largest = self.buckets[-1]
        for lo in range(0, len(writes), largest):
            part = writes[lo : lo + largest]
            n = next(b for b in self.buckets if b >= len(part))
            pixels = np.zeros((n, *self.pixel_shape), np.float32)
            slots = np.full(n, self.num_slots, np.int32)
            for i, (slot, px) in enumerate(part):
                pixels[i], slots[i] = px, slot
            pixels, slots = jax.device_put((pixels, slots), self.sharding)
            self.pool = self._executable(runner, n)(runner.state, self.pool, pixels, slots)

    def encode(self, writes) -> list:
        return [[int(slot), pixels] for slot, pixels in writes]

    def decode(self, wire) -> list:
        writes = []
        for w in expect_list(wire, "the images"):
            slot, pixels = expect_indexed(w, "an image", 0, self.num_slots)
            writes.append((slot, expect_array(pixels, "float32", 3, "an image", self.pixel_shape)))
        return writes

    def device_arrays(self, runner) -> list:
        return [self.pool]

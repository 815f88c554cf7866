"""The image encoder as its own executable: a step's new images (the scheduler's
`encoder_inputs`) run through the vision tower and projector in static buckets of images,
their embeddings written into the device's encoder cache (`pool` [pages, P, D], vLLM's
encoder cache), which the forward reads at each image token (`StepInputs.embed_index`).
Images cut at their own size (Qwen-VL) run in buckets of patches instead, several images
packed in one (`PatchEncoder`), each merged token written to its place in its pages.

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

from jllm.distributed.codec import (
    MalformedMessage,
    expect_array,
    expect_indexed,
    expect_ints,
    expect_list,
)
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

    def apply(self, runner, writes: list[tuple]) -> None:
        """Encode the new images ((pages, pixels [C, H, W], None) each: one page per image)
        into the pool, in buckets."""
        largest = self.buckets[-1]
        for lo in range(0, len(writes), largest):
            part = writes[lo : lo + largest]
            n = next(b for b in self.buckets if b >= len(part))
            pixels = np.zeros((n, *self.pixel_shape), np.float32)
            slots = np.full(n, self.num_slots, np.int32)
            for i, (pages, px, _) in enumerate(part):
                pixels[i], slots[i] = px, pages[0]
            pixels, slots = jax.device_put((pixels, slots), self.sharding)
            self.pool = self._executable(runner, n)(runner.state, self.pool, pixels, slots)

    def encode(self, writes) -> list:
        return [[int(pages[0]), pixels] for pages, pixels, _ in writes]

    def decode(self, wire) -> list:
        writes = []
        for w in expect_list(wire, "the images"):
            slot, pixels = expect_indexed(w, "an image", 0, self.num_slots)
            px = expect_array(pixels, "float32", 3, "an image", self.pixel_shape)
            writes.append(((slot,), px, None))
        return writes

    def device_arrays(self, runner) -> list:
        return [self.pool]


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("pool",))
def encode_patches_step(state, pool, inputs, *, graphdef):
    """Packed patches (`QwenVisionConfig.pack`) -> their merged tokens written at `dest` of
    the flattened pool [pages * P, D] (past it, padding, writes nothing)."""
    model = nnx.merge(graphdef, state)
    tokens = model.encode_patches(inputs)
    flat = pool.reshape(-1, pool.shape[-1])
    flat = flat.at[inputs["dest"]].set(tokens.astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


class PatchEncoder(ImageEncoder):
    """Images cut at their own size: buckets of patches (powers of two up to the largest
    image's), images packed into each call in arrival order; the pool in pages of
    `vision.tokens_per_image` tokens."""

    def __init__(self, graphdef, vision, num_pages: int, max_patches: int, dtype, sharding):
        self.graphdef = graphdef
        self.vision = vision
        self.num_slots = num_pages
        self.page = vision.tokens_per_image
        shape = (num_pages, self.page, vision.embed_width)
        self.pool = jax.device_put(np.zeros(shape, jnp.dtype(dtype)), sharding)
        self.sharding = sharding
        self.max_patches = max_patches
        top = 1 << max(max_patches - 1, 1).bit_length()  # a power of two: whole query blocks
        self.buckets = pow2_buckets(top, min(top, 16 * vision.unit))

    def _executable(self, runner, n: int):
        def lower():
            shapes = self.vision.pack([], n, self.page, 0)
            inputs = {
                k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.sharding)
                for k, v in shapes.items()
            }
            return encode_patches_step.lower(
                runner.state, self.pool, inputs, graphdef=self.graphdef
            )

        return runner.table.get("image encoder", n, lower)

    def apply(self, runner, writes: list[tuple]) -> None:
        """Encode the new images ((pages, patches [n, K], grid) each) into their pages."""
        largest = self.buckets[-1]
        calls, part, size = [], [], 0
        for w in writes:
            n = len(w[1])
            if part and size + n > largest:
                calls.append((part, size))
                part, size = [], 0
            part.append(w)
            size += n
        if part:
            calls.append((part, size))
        for part, size in calls:
            n = next(b for b in self.buckets if b >= size)
            inputs = self.vision.pack(part, n, self.page, self.pool.shape[0] * self.page)
            inputs = jax.device_put(inputs, self.sharding)
            self.pool = self._executable(runner, n)(runner.state, self.pool, inputs)

    def encode(self, writes) -> list:
        return [[list(map(int, pages)), px, list(map(int, grid))] for pages, px, grid in writes]

    def decode(self, wire) -> list:
        writes = []
        K = self.vision.patch_pixels
        for w in expect_list(wire, "the images"):
            if not isinstance(w, list) or len(w) != 3:
                raise MalformedMessage("step message: an image is not [pages, patches, grid]")
            pages = expect_ints(w[0], "an image's pages")
            grid = expect_ints(w[2], "an image's grid", 3)
            px = expect_array(w[1], "float32", 2, "an image", (None, K))
            t, h, gw = grid
            m = self.vision.merge
            tokens = len(px) // self.vision.unit
            if (
                any(not 0 <= p < self.num_slots for p in pages)
                or min(grid) < 1
                or h % m
                or gw % m
                or t * h * gw != len(px)
                or len(px) > self.max_patches
                or -(-tokens // self.page) != len(pages)
            ):
                raise MalformedMessage("step message: an image's pages, grid and patches differ")
            writes.append((tuple(pages), px, tuple(grid)))
        return writes

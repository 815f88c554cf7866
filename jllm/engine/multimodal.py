"""Image inputs on the host: a prompt's images through the model's own Hugging Face processor
(which expands each image's placeholder into its tokens and prepares the pixels, as vLLM
does), checked, hashed and placed.

An image becomes an `ImageItem`: its content hash (vLLM's `mm_hash`: sha256 of the pixels
the processor produced, so equal images under equal processor settings share it), where its
placeholder tokens start in the prompt and how many there are, and its pixels. The hash keys
the encoder cache (`engine/encoder_cache.py`) and joins the prefix-cache key of every block
the image's tokens touch (`kv_cache_manager.block_key`). Host-side only: no JAX import.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageItem:
    hash: bytes  # sha256 of the prepared pixels (vLLM's mm_hash)
    offset: int  # its first placeholder token in the prompt
    length: int  # its placeholder tokens
    pixels: np.ndarray  # [C, H, W], as the processor prepared them

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions start .. end - 1 include any of its tokens."""
        return self.offset < end and start < self.offset + self.length

    @property
    def end(self) -> int:
        return self.offset + self.length


def encoder_slots(tokens_per_image: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """(slots of the encoder cache, the most new images one step brings): a step's tokens
    touch at most cdiv(budget - 1, P) + 1 images; the cache holds twice that, so that
    images of requests still mid-image and recently used ones stay beside a full step's."""
    per_step = -(-(max_num_batched_tokens - 1) // tokens_per_image) + 1
    return 2 * per_step, per_step


def image_hash(pixels: np.ndarray) -> bytes:
    h = hashlib.sha256(str((pixels.shape, pixels.dtype.str)).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


def placeholder_offsets(ids: list[int], token_id: int, count: int, per_image: int) -> list[int]:
    """Where each of `count` images' `per_image` placeholder tokens start in `ids`: the runs
    of `token_id`, cut in pieces of `per_image`; ValueError when they do not match."""
    at = np.flatnonzero(np.asarray(ids) == token_id)
    if len(at) != count * per_image:
        raise ValueError(
            f"The prompt has {len(at)} image placeholder tokens; {count} image(s) need "
            f"{count * per_image} ({per_image} each). Put one image placeholder in the prompt "
            "per image, as the model's chat template does."
        )
    starts = at[::per_image].tolist() if count else []
    for s in starts:  # each image's tokens are consecutive
        if at[np.searchsorted(at, s) + per_image - 1] != s + per_image - 1:
            raise ValueError("An image's placeholder tokens are not consecutive in the prompt.")
    return starts


class MultiModalProcessor:
    """A model's image inputs: its Hugging Face processor (loaded from the model's folder on
    first use), `limit_mm_per_prompt` and the engine-wide `mm_processor_kwargs` (merged
    under a request's own)."""

    def __init__(
        self,
        model_path: str,
        vision,
        limit_per_prompt: dict | None,
        processor_kwargs: dict | None,
        max_num_batched_tokens: int,
        trust_remote_code: bool = False,
    ) -> None:
        self.model_path = model_path
        self.vision = vision  # models/vision.py:VisionConfig
        self.trust_remote_code = trust_remote_code
        limits = dict(limit_per_prompt or {})
        unknown = sorted(set(limits) - {"image"})
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: jllm takes images only, not {unknown}.")
        self.max_images = int(limits.get("image", 1 if limits else 999))
        if self.max_images < 0:
            raise ValueError("limit_mm_per_prompt['image'] must be >= 0.")
        self.processor_kwargs = dict(processor_kwargs or {})
        if vision.bidirectional and vision.tokens_per_image > max_num_batched_tokens:
            raise ValueError(
                f"An image's {vision.tokens_per_image} tokens attend to each other, so one "
                "step computes them together: max_num_batched_tokens "
                f"({max_num_batched_tokens}) must be at least that."
            )
        self._hf = None
        # The server prepares requests on several threads (the processor pool): one loads
        # the processor, and one at a time runs it, since a request's mm_processor_kwargs
        # (padding, truncation) reconfigure its tokenizer for the call.
        self._lock = threading.RLock()

    @property
    def hf(self):
        with self._lock:
            return self._load()

    def _load(self):
        if self._hf is None:
            from transformers import AutoProcessor

            try:
                self._hf = AutoProcessor.from_pretrained(
                    self.model_path, trust_remote_code=self.trust_remote_code
                )
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"The model at {self.model_path} has no Hugging Face processor to prepare "
                    f"images ({e})."
                ) from e
        return self._hf

    def images(self, data) -> list:
        """The PIL images of a prompt's `multi_modal_data`, checked."""
        if not isinstance(data, dict):
            raise ValueError("multi_modal_data must be a dict such as {'image': image}.")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: jllm takes images only, not {unknown}.")
        images = data.get("image")
        if images is None:
            return []
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        from PIL import Image

        for image in images:
            if not isinstance(image, Image.Image):
                raise ValueError(f"An image must be a PIL.Image.Image, got {type(image).__name__}.")
        if len(images) > self.max_images:
            raise ValueError(
                f"At most {self.max_images} image(s) may be provided in one prompt; got "
                f"{len(images)} (limit_mm_per_prompt)."
            )
        return images

    def process(
        self,
        text: str | None,
        ids: list[int] | None,
        images: list,
        kwargs: dict | None = None,
        add_special_tokens: bool = True,
    ) -> tuple[list[int], list[ImageItem]]:
        """The prompt's token ids with every image's placeholders expanded, and its items.
        Token prompts must hold the expanded placeholders already; text prompts one
        placeholder per image, which the processor expands."""
        merged = {**self.processor_kwargs, **(kwargs or {})}
        try:
            with self._lock:
                ids, pixels = self._run(text, ids, images, merged, add_special_tokens)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"The model's processor refused the prompt's images: {e}") from e
        pixels = np.zeros((0,)) if pixels is None else np.asarray(pixels, np.float32)
        v = self.vision
        shape = (v.num_channels, v.image_size, v.image_size)
        if images and tuple(pixels.shape[1:]) != shape:
            raise ValueError(
                f"The processor prepared images of shape {tuple(pixels.shape[1:])}; the "
                f"model's encoder takes {shape}."
            )
        count = len(pixels) if images else 0
        starts = placeholder_offsets(ids, v.image_token_id, count, v.tokens_per_image)
        items = [
            ImageItem(image_hash(px), s, v.tokens_per_image, px)
            for s, px in zip(starts, pixels[:count], strict=True)
        ]
        return ids, items

    def _run(self, text, ids, images, merged: dict, add_special_tokens: bool):
        """(token ids, pixel values or None) from the Hugging Face processor."""
        hf = self._load()
        if ids is None:
            out = hf(
                text=text,
                images=images or None,
                return_tensors="np",
                add_special_tokens=add_special_tokens,
                **merged,
            )
            return out["input_ids"][0].tolist(), out.get("pixel_values")
        if not images:
            return ids, None
        return ids, hf.image_processor(images=images, return_tensors="np", **merged)["pixel_values"]

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
    pixels: np.ndarray  # [C, H, W], as the processor prepared them; [patches, C*t*p*p] with a grid
    # Images cut at their own size (Qwen-VL): the (t, h, w) patch grid, and the side of the
    # square of patches the encoder merges into one token; None for fixed-size images.
    grid: tuple[int, int, int] | None = None
    merge: int = 1

    @property
    def llm_grid(self) -> tuple[int, int]:
        """The (height, width) of its tokens' grid (engine/mrope.py)."""
        _, h, w = self.grid
        return h // self.merge, w // self.merge

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions start .. end - 1 include any of its tokens."""
        return self.offset < end and start < self.offset + self.length

    @property
    def end(self) -> int:
        return self.offset + self.length


def encoder_slots(tokens_per_image: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """(pages of the encoder cache, the most new images one step brings) for images of one
    size, a page each: a step's tokens touch at most cdiv(budget - 1, P) + 1 images; the
    cache holds twice that, so that images of requests still mid-image and recently used
    ones stay beside a full step's."""
    per_step = -(-(max_num_batched_tokens - 1) // tokens_per_image) + 1
    return 2 * per_step, per_step


def encoder_pages(page: int, max_image_tokens: int, budget: int, max_images: int) -> int:
    """Pages of the encoder cache for images cut at their own size (at most
    `max_image_tokens` tokens each): twice a step's tokens (`budget`) and a largest image, so
    that the largest image always fits beside the images a full step touches, and a page
    more per image a prompt may hold (each image's last page is part full), so that a whole
    prompt's images fit at once (chunked prefill off)."""
    return 2 * -(-(budget + max_image_tokens) // page) + min(max_images, budget)


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
        tokenizer=None,
    ) -> None:
        self.model_path = model_path
        self.tokenizer = tokenizer  # images at their own size: the engine's tokenizer
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
        if self._hf is None and getattr(self.vision, "variable", False):
            self._hf = _grid_processor(self.model_path, self.processor_kwargs)
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
        if getattr(self.vision, "variable", False):
            return self._process_grid(text, ids, images, merged, add_special_tokens)
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

    # Images at their own size (Qwen-VL): the PIL image processor (no PyTorch) makes each
    # image's patches and grid; jllm expands the placeholders itself.

    @property
    def max_patches(self) -> int:
        """Patches of the largest image the engine's `max_pixels` lets through."""
        hf = self.hf
        return int(hf.size["longest_edge"]) // hf.patch_size**2

    def _process_grid(self, text, ids, images, merged: dict, add_special_tokens: bool):
        pixels = _pixel_kwargs(merged)
        hf = self.hf
        size = dict(hf.size)
        if "min_pixels" in pixels:
            size["shortest_edge"] = pixels["min_pixels"]
        if "max_pixels" in pixels:
            size["longest_edge"] = pixels["max_pixels"]
        if size["longest_edge"] // hf.patch_size**2 > self.max_patches:
            raise ValueError(
                f"max_pixels {size['longest_edge']} is above the engine's "
                f"{self.hf.size['longest_edge']} (its mm_processor_kwargs), for which the "
                "encoder was compiled."
            )
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError("min_pixels must not exceed max_pixels.")
        patches, grids = [], []
        if images:
            try:
                with self._lock:
                    out = hf(images=images, size=size, return_tensors="np")
            except (ValueError, TypeError, OSError) as e:
                raise ValueError(f"The model's image processor refused the images: {e}") from e
            grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
            counts = [t * h * w for t, h, w in grids]
            cuts = np.cumsum(counts)[:-1]
            patches = np.split(np.asarray(out["pixel_values"], np.float32), cuts)
        v = self.vision
        lengths = [t * h * w // v.unit for t, h, w in grids]
        if ids is None:
            tok = self.tokenizer
            ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
            ids = expand_placeholders(list(ids), v.image_token_id, lengths)
        starts = grid_offsets(ids, v.image_token_id, lengths)
        items = [
            ImageItem(grid_hash(px, g), s, n, px, g, v.merge)
            for s, n, px, g in zip(starts, lengths, patches, grids, strict=True)
        ]
        return ids, items


def _pixel_kwargs(kwargs: dict) -> dict[str, int]:
    """`mm_processor_kwargs` for images cut at their own size: min_pixels and max_pixels,
    each a positive integer; any other key is refused by name."""
    unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels"})
    if unknown:
        raise ValueError(
            f"mm_processor_kwargs: {unknown} not supported for this model (it takes "
            "min_pixels and max_pixels)."
        )
    return {k: _pixels(v, k) for k, v in kwargs.items()}


def _pixels(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"mm_processor_kwargs: {name} must be a positive integer.")
    return value


def _grid_processor(model_path: str, engine_kwargs: dict):
    """The model's image processor without PyTorch (transformers' PIL backend of Qwen2-VL's,
    which Qwen2.5-VL's and Qwen3-VL's folders name), the engine's min/max_pixels applied."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    try:
        return Qwen2VLImageProcessorPil.from_pretrained(model_path, **_pixel_kwargs(engine_kwargs))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"The model at {model_path} has no image processor config to prepare images ({e})."
        ) from e


def grid_hash(patches: np.ndarray, grid) -> bytes:
    h = hashlib.sha256(str(tuple(grid)).encode())
    h.update(image_hash(patches))
    return h.digest()


def expand_placeholders(ids: list[int], token_id: int, lengths: list[int]) -> list[int]:
    """A text prompt's ids with its i-th image placeholder token repeated `lengths[i]` times;
    ValueError unless there is one placeholder per image."""
    at = [i for i, t in enumerate(ids) if t == token_id]
    if len(at) != len(lengths):
        raise ValueError(
            f"The prompt has {len(at)} image placeholder tokens for {len(lengths)} image(s): "
            "put one placeholder per image in the prompt, as the model's chat template does."
        )
    out, last = [], 0
    for i, n in zip(at, lengths, strict=True):
        out += ids[last:i] + [token_id] * n
        last = i + 1
    return out + ids[last:]


def grid_offsets(ids: list[int], token_id: int, lengths: list[int]) -> list[int]:
    """Where each image's run of `lengths[i]` placeholder tokens starts; ValueError unless
    the runs are exactly those."""
    at = np.flatnonzero(np.asarray(ids) == token_id)
    runs = np.split(at, np.flatnonzero(np.diff(at) != 1) + 1) if len(at) else []
    got = [len(r) for r in runs]
    if got != list(lengths):
        raise ValueError(
            f"The prompt's image placeholder runs have {got} tokens; its images need "
            f"{list(lengths)}. Put one placeholder per image in a text prompt, or each image's "
            "expanded placeholders in a token prompt."
        )
    return [int(r[0]) for r in runs]

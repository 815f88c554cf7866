"""Image inputs on the CPU: images per second through the vision encoder, and time to first
token for one image plus 64 text tokens, jllm beside transformers in one run.

The model is LLaVA-1.5-7B's shape scaled to this machine: its CLIP-L/336 tower (width 1024,
16 heads, 336x336 images in 14x14 patches: 576 image tokens) with 4 layers instead of 24,
and a Llama of width 1024 and 4 layers (16 heads) instead of 4096 and 32; random weights
from a config alone (`load_format="dummy"` for jllm, `from_config` for transformers), float32
for both. The embedded SmolLM2 tokenizer with an `<image>` token stands in for LLaVA's.

With `--model qwen2_5_vl` the model is Qwen2.5-VL-7B's shape scaled the same way: its
vision tower's width (1280, 16 heads, MLP 3420, 112-pixel windows) with 4 layers (the last
full-attention) instead of 32, the merger into a Qwen2 of width 1024 with 4 layers (8 heads
of 128, 2 KV heads, M-RoPE sections 16/24/24) instead of 3584 and 28; images at two
resolutions (448x448: 1024 patches, 256 tokens; 896x672: 3072 patches, 768 tokens),
`max_pixels` 1024x1024.

    python benchmarks/vision.py [--model llava|qwen2_5_vl] [--images 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import torch
import transformers
from PIL import Image

from jllm import LLM, SamplingParams
from jllm.model_loader import resolve_model


def make_model(path: str) -> None:
    tok = resolve_model(None).load_tokenizer()
    tok.add_tokens(["<image>"], special_tokens=True)
    vision = transformers.CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
    )
    text = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=4096,
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=576,
    )
    cfg.save_pretrained(path)
    images = transformers.CLIPImageProcessor(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
    )
    transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=14,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
    ).save_pretrained(path)


def make_qwen(path: str) -> None:
    tok = resolve_model(None).load_tokenizer()
    tok.add_tokens(QWEN_TOKENS, special_tokens=True)
    start, pad, _ = tok.convert_tokens_to_ids(QWEN_TOKENS)
    text = dict(
        vocab_size=len(tok),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )
    vision = dict(
        depth=4,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=1024,
        fullatt_block_indexes=[3],
    )
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=pad, vision_start_token_id=start
    )
    cfg.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(max_pixels=1024 * 1024).save_pretrained(path)
    tok.save_pretrained(path)


QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
QWEN_SIZES = {"448x448": (448, 448), "896x672": (672, 896)}  # (height, width)


def images(n: int, seed: int, size=(480, 640)) -> list:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)) for _ in range(n)]


def timed(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def qwen_main(args) -> None:
    path = tempfile.mkdtemp(prefix="jllm-qwen2_5_vl-scaled-")
    make_qwen(path)
    improc = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    llm = LLM(
        path,
        load_format="dummy",
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        max_num_seqs=8,
        limit_mm_per_prompt={"image": 1},
    )
    runner = llm.llm_engine.runner
    encoder = runner.encoder
    torch.set_num_threads(os.cpu_count())
    hf = transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.AutoConfig.from_pretrained(path)
    )
    hf = hf.eval()
    one = SamplingParams(max_tokens=1, temperature=0.0)
    seed = iter(range(1, 1000))
    text = "USER: <|vision_start|><|image_pad|><|vision_end|>" + " word" * 60 + " ASSISTANT:"
    rows = {}
    for name, size in QWEN_SIZES.items():
        out = improc(images=images(args.images, 0, size), return_tensors="np")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
        patches = np.split(out["pixel_values"], np.cumsum([np.prod(g) for g in grids])[:-1])
        page = encoder.page
        need = -(-int(np.prod(grids[0])) // 4 // page)
        writes = [
            (tuple(range(i * need, (i + 1) * need)), px, g)
            for i, (px, g) in enumerate(zip(patches, grids, strict=True))
        ]

        def jllm_encode(writes=writes):
            encoder.apply(runner, writes)
            jax.block_until_ready(encoder.pool)

        px_all = torch.tensor(out["pixel_values"])
        thw = torch.tensor(out["image_grid_thw"])

        def hf_encode(px_all=px_all, thw=thw):
            with torch.no_grad():
                hf.model.visual(px_all, grid_thw=thw)

        def jllm_ttft(size=size):  # a new image each time: no cache hit
            llm.generate(
                {"prompt": text, "multi_modal_data": {"image": images(1, next(seed), size)}},
                one,
                use_tqdm=False,
            )

        def hf_ttft(size=size):
            px = improc(images=images(1, next(seed), size), return_tensors="pt")
            n = int(px["image_grid_thw"].prod()) // 4
            ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt")
            ids = ids["input_ids"]
            types = (ids == hf.config.image_token_id).int()
            with torch.no_grad():
                hf.generate(
                    input_ids=ids,
                    mm_token_type_ids=types,
                    pixel_values=px["pixel_values"],
                    image_grid_thw=px["image_grid_thw"],
                    max_new_tokens=1,
                    do_sample=False,
                )

        rows[f"encoder images/s, {name}"] = (
            args.images / timed(jllm_encode, args.repeats),
            args.images / timed(hf_encode, args.repeats),
        )
        rows[f"TTFT, 1 image {name} + 64 tok (s)"] = (
            timed(jllm_ttft, args.repeats),
            timed(hf_ttft, args.repeats),
        )
    report(rows)


def report(rows: dict) -> None:
    print(f"{'':38} {'jllm':>10} {'transformers':>14} {'ratio':>8}")
    for name, (ours, theirs) in rows.items():
        ratio = ours / theirs if "images/s" in name else theirs / ours
        print(f"{name:38} {ours:10.3f} {theirs:14.3f} {ratio:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["llava", "qwen2_5_vl"], default="llava")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.model == "qwen2_5_vl":
        return qwen_main(args)
    path = tempfile.mkdtemp(prefix="jllm-llava-scaled-")
    make_model(path)
    proc = transformers.AutoProcessor.from_pretrained(path)
    pixels = proc.image_processor(images=images(args.images, 0), return_tensors="np")[
        "pixel_values"
    ]
    text = "USER: <image>\n" + " ".join(["word"] * 60) + " ASSISTANT:"

    llm = LLM(
        path,
        load_format="dummy",
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        max_num_seqs=8,
    )
    runner = llm.llm_engine.runner
    encoder = runner.encoder
    batch = [((i % encoder.num_slots,), px, None) for i, px in enumerate(pixels)]

    def jllm_encode():
        encoder.apply(runner, batch)
        jax.block_until_ready(encoder.pool)

    one = SamplingParams(max_tokens=1, temperature=0.0)
    seed = iter(range(1, 1000))

    def jllm_ttft():  # a new image each time: no cache hit
        llm.generate(
            {"prompt": text, "multi_modal_data": {"image": images(1, next(seed))}},
            one,
            use_tqdm=False,
        )

    torch.set_num_threads(os.cpu_count())
    hf = transformers.LlavaForConditionalGeneration(transformers.AutoConfig.from_pretrained(path))
    hf = hf.eval()
    px = torch.tensor(pixels)

    def hf_encode():
        with torch.no_grad():
            hf.model.get_image_features(
                px, vision_feature_layer=-2, vision_feature_select_strategy="default"
            )

    def hf_ttft():
        inputs = proc(text=text, images=images(1, next(seed)), return_tensors="pt")
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False)

    rows = {
        "encoder images/s": (
            args.images / timed(jllm_encode, args.repeats),
            args.images / timed(hf_encode, args.repeats),
        ),
        "TTFT, 1 image + 64 tokens (s)": (
            timed(jllm_ttft, args.repeats),
            timed(hf_ttft, args.repeats),
        ),
    }
    report(rows)


if __name__ == "__main__":
    main()

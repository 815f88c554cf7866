"""Tiny random vision-language models with their Hugging Face processors, saved as folders
(LLaVA-1.5 with a small CLIP tower, Gemma 3 with a small SigLIP tower), and transformers as
the oracle for them."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from PIL import Image

# A chat template that writes an image part as the model's placeholder (as the real
# models' templates do).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "PLACEHOLDER{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
LLAVA_IMAGE = "<image>"
GEMMA3_IMAGE = "<start_of_image>"


def _text(vocab: int, cls, **kw):
    return cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.25,
        **kw,
    )


def save_llava(path: str, tokenizer_dir: str) -> str:
    """LLaVA-1.5: CLIP (28x28 images in 7x7 patches: 16 image tokens), features of its
    second-to-last layer, the linear-GELU-linear projector, a Llama."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens([LLAVA_IMAGE], special_tokens=True)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=28,
        patch_size=7,
        projection_dim=16,
    )
    text = _text(
        len(tok), transformers.LlamaConfig, num_hidden_layers=2, bos_token_id=1, eos_token_id=2
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids(LLAVA_IMAGE),
        image_seq_length=16,
    )
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(path)
    images = transformers.CLIPImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=7,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=TEMPLATE.replace("PLACEHOLDER", LLAVA_IMAGE + "\n"),
    ).save_pretrained(path)
    return path


def save_gemma3(path: str, tokenizer_dir: str, tie_word_embeddings: bool = True) -> str:
    """Gemma 3: SigLIP (32x32 images in 4x4 patches, average-pooled to 16 tokens), the
    projector's weights made non-zero, a Gemma 3 text model whose local window (24) is
    longer than an image. Untied, the top-level config says so while the text config keeps
    its default (tied): transformers reads the top-level flag."""
    tok = transformers.AutoTokenizer.from_pretrained(
        tokenizer_dir,
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
    )
    text = _text(
        len(tok),
        transformers.Gemma3TextConfig,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=24,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
    )
    cfg = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=16,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tie_word_embeddings
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.25)
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tok,
        image_seq_length=16,
        chat_template=TEMPLATE.replace("PLACEHOLDER", GEMMA3_IMAGE),
    ).save_pretrained(path)
    return path


def random_images(count: int, seed: int = 0) -> list:
    """RGB images of different sizes (the processor resizes them)."""
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 255, (30 + 9 * i, 40 + 5 * i, 3), dtype=np.uint8))
        for i in range(count)
    ]


class VisionOracle:
    """transformers' model and processor of a saved folder, in float32, eager attention."""

    def __init__(self, path: str) -> None:
        self.processor = transformers.AutoProcessor.from_pretrained(path)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(
            path, attn_implementation="eager"
        ).eval()

    def inputs(self, prompt: str, images: list):
        return self.processor(text=prompt, images=images or None, return_tensors="pt")

    def greedy(self, prompt: str, images: list, max_tokens: int) -> list[int]:
        inputs = self.inputs(prompt, images)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    def logprobs(self, prompt: str, images: list, tokens: list[int]) -> np.ndarray:
        """Teacher-forced log-softmax [len(tokens), V] at each generated position."""
        inputs = self.inputs(prompt, images)
        n = inputs["input_ids"].shape[1]
        ids = torch.cat([inputs["input_ids"], torch.tensor([tokens[:-1]])], dim=1)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        if "token_type_ids" in extra:  # Gemma 3: the generated tokens are text
            pad = torch.zeros((1, len(tokens) - 1), dtype=extra["token_type_ids"].dtype)
            extra["token_type_ids"] = torch.cat([extra["token_type_ids"], pad], dim=1)
        with torch.no_grad():
            logits = self.model(input_ids=ids, **extra).logits[0, n - 1 :].float()
        return torch.log_softmax(logits, -1).numpy()


def assert_matches_oracle(oracle: VisionOracle, prompt: str, images: list, out) -> None:
    """Greedy tokens equal the oracle's and their logprobs are within 1e-4, up to the first
    step where the oracle's top two are within 1e-3 (a near-tie of a tiny random model)."""
    got = out.outputs[0].token_ids
    ref = oracle.logprobs(prompt, images, got)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    ties = np.flatnonzero(top2[:, 1] - top2[:, 0] < 1e-3)
    upto = int(ties[0]) if len(ties) else len(got)
    assert upto > 0
    expected = oracle.greedy(prompt, images, len(got))
    assert got[:upto] == expected[:upto]
    lp = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(got[:upto])]
    np.testing.assert_allclose(lp, [ref[i, t] for i, t in enumerate(got[:upto])], atol=1e-4)


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
# The processor's pixel range: 4x4 to 16x16 patches of 14 pixels (4 to 64 merged tokens).
QWEN_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 224 * 224}


def _qwen_parts(tokenizer_dir: str, **text_kw):
    """The tokenizer with Qwen's vision tokens (and their ids: start, pad), and the tiny text
    and vision config dicts both Qwen-VL savers start from."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(QWEN_TOKENS, special_tokens=True)
    start, pad, _ = tok.convert_tokens_to_ids(QWEN_TOKENS)
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        initializer_range=0.25,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **text_kw,
    )
    vision = dict(
        depth=4,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        out_hidden_size=64,
        initializer_range=0.25,
    )
    return tok, start, pad, text, vision


def save_qwen2_5_vl(path: str, tokenizer_dir: str) -> str:
    """Qwen2.5-VL: a 4-layer ViT (14-pixel patches, windows of 2x2 merged tokens, layers 1
    and 3 full), the patch merger, a Qwen2 text model with M-RoPE (sections 2, 3, 3 of its 8
    frequencies); images between 56x56 and 224x224 pixels."""
    tok, start, pad, text, vision = _qwen_parts(tokenizer_dir, num_hidden_layers=2)
    vision |= dict(window_size=56, fullatt_block_indexes=[1, 3])
    images = transformers.Qwen2VLImageProcessorPil(**QWEN_PIXELS)
    return _save_qwen(path, "Qwen2_5_VL", tok, start, pad, text, vision, images)


def _save_qwen(path: str, kind: str, tok, start, pad, text, vision, images) -> str:
    """A tiny Qwen-VL of transformers' `{kind}Config` saved with its image processor and
    the tokenizer (the placeholders' chat template); the norms' weights and biases made
    random (around 1 and 0), so a swap would show."""
    cfg = getattr(transformers, f"{kind}Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=pad,
        vision_start_token_id=start,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    model.save_pretrained(path)
    images.save_pretrained(path)
    tok.chat_template = TEMPLATE.replace("PLACEHOLDER", QWEN_IMAGE)
    tok.save_pretrained(path)
    return path


class QwenVLOracle:
    """transformers' Qwen2.5-VL of a saved folder in float32, eager attention; prompts
    prepared as transformers' processor does (each image's placeholder repeated in the text,
    its pixels by the PIL image processor), without the video processor it would need."""

    def __init__(self, path: str) -> None:
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.images = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32
        ).eval()
        self.pad = self.model.config.image_token_id

    def inputs(self, prompt: str, images: list, tokens: list[int] = ()) -> dict:
        extra = {}
        if images:
            px = self.images(images=images, return_tensors="pt")
            extra = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}
            parts = prompt.split("<|image_pad|>")
            counts = [int(g.prod()) // 4 for g in px["image_grid_thw"]]
            prompt = parts[0] + "".join(
                "<|image_pad|>" * n + rest for n, rest in zip(counts, parts[1:], strict=True)
            )
        ids = self.tok(prompt)["input_ids"] + list(tokens)
        input_ids = torch.tensor([ids])
        types = (input_ids == self.pad).int()
        return {"input_ids": input_ids, "mm_token_type_ids": types, **extra}

    def greedy(self, prompt: str, images: list, max_tokens: int) -> list[int]:
        inputs = self.inputs(prompt, images)
        n = inputs["input_ids"].shape[1]
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return out[0, n:].tolist()

    def logprobs(self, prompt: str, images: list, tokens: list[int]) -> np.ndarray:
        n = self.inputs(prompt, images)["input_ids"].shape[1]
        inputs = self.inputs(prompt, images, tokens[:-1])
        with torch.no_grad():
            logits = self.model(**inputs).logits[0, n - 1 :].float()
        return torch.log_softmax(logits, -1).numpy()


QWEN3_PIXELS = {"min_pixels": 64 * 64, "max_pixels": 256 * 256}


def save_qwen3_vl(path: str, tokenizer_dir: str, moe: bool = False) -> str:
    """Qwen3-VL: a 4-layer ViT (16-pixel patches, a learned 4x4 grid of positions,
    DeepStack features from layers 0 and 2), a Qwen3 text model with interleaved M-RoPE
    (sections 2, 3, 3 of its 8 frequencies), or with `moe` Qwen3-VL-MoE's (4 experts, top 2,
    every layer sparse); images between 64x64 and 256x256 pixels."""
    tok, start, pad, text, vision = _qwen_parts(tokenizer_dir, num_hidden_layers=3, head_dim=16)
    text["rope_parameters"]["mrope_interleaved"] = True
    vision |= dict(patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
    if moe:
        # 2F = 96 beside D = 64: the stacked experts' two layouts differ in shape
        text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    images = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], **QWEN3_PIXELS
    )
    kind = "Qwen3VLMoe" if moe else "Qwen3VL"
    return _save_qwen(path, kind, tok, start, pad, text, vision, images)

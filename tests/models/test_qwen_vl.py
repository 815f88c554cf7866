"""Qwen2.5-VL and Qwen3-VL against transformers: images cut at their own size (a different
token count per image), windowed and full vision attention, M-RoPE positions (interleaved for
Qwen3-VL), Qwen3-VL's learned position grid and DeepStack features; tiny random models built
by the test, in float32, with chunked prefill through images, several images in one prompt
and in one encoder call, the prefix cache keyed by image, preemption, the chat API, TP = 2,
and bad input. The M-RoPE positions, the encoder's window layout and the position grid's
taps are also checked piece by piece against transformers' own functions."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from vision_oracle import (
    QWEN_IMAGE,
    QwenVLOracle,
    assert_matches_oracle,
    save_qwen2_5_vl,
    save_qwen3_vl,
)

from jllm import LLM, SamplingParams
from jllm.mrope import rope_positions, spans_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
# A budget of 32 tokens cuts the prompts below inside their images (14 to 60 tokens).
ENGINE = dict(
    dtype="float32",
    max_model_len=512,
    max_num_batched_tokens=32,
    max_num_seqs=4,
    num_gpu_blocks_override=128,
    limit_mm_per_prompt={"image": 3},
)
# (height, width) -> patch grids 4x14, 10x8, 16x16 and (past max_pixels, scaled) 12x20.
SIZES = [(60, 200), (150, 120), (224, 224), (300, 500)]


def images(*which: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (*SIZES[i], 3), dtype=np.uint8)) for i in which]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tokenizer_dir):
    return save_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")), tokenizer_dir)


@pytest.fixture(scope="module")
def oracle(qwen_dir):
    return QwenVLOracle(qwen_dir)


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return LLM(qwen_dir, **ENGINE)


def cases(seed: int = 0):
    """(prompt, images): one image mid-prompt, two of different sizes, three (one past
    max_pixels) with the first at the start, and text only."""
    return [
        (f"USER: describe {QWEN_IMAGE} What is it? ASSISTANT:", images(1, seed=seed)),
        (f"Two: {QWEN_IMAGE} and {QWEN_IMAGE} compared", images(0, 2, seed=seed + 1)),
        (f"{QWEN_IMAGE} a {QWEN_IMAGE} b {QWEN_IMAGE}", images(3, 1, 0, seed=seed + 2)),
        ("Only text here, no picture at all.", []),
    ]


def generate(llm, pairs, params=GREEDY):
    requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in pairs]
    return llm.generate(requests, params, use_tqdm=False)


def test_matches_transformers(qwen, oracle):
    pairs = cases()
    outs = generate(qwen, pairs)
    for (prompt, ims), out in zip(pairs, outs, strict=True):
        assert_matches_oracle(oracle, prompt, ims, out)
    counts = [len(o.prompt_token_ids) for o in outs]
    assert len(set(counts)) == len(counts)


def test_each_image_takes_its_own_token_count(qwen):
    pad = qwen.llm_engine.model_config.vision.image_token_id
    for i, n in enumerate([14, 20, 64, 60]):  # the grids of SIZES, merged 2x2
        out = generate(qwen, [(f"x {QWEN_IMAGE} y", images(i))])[0]
        assert out.prompt_token_ids.count(pad) == n


def test_mrope_positions_equal_transformers(oracle):
    """jllm.mrope for any stretch of tokens (as chunks and decodes ask) equals transformers'
    get_rope_index over the whole sequence, and its delta the decode offset."""
    prompt, ims = cases()[2]
    inputs = oracle.inputs(prompt, ims, tokens=[5, 6, 7])
    model = oracle.model.model
    want, delta = model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
    )
    want = want[:, 0].numpy()
    ids = inputs["input_ids"][0].numpy()
    pad = oracle.pad
    runs = np.split(
        np.flatnonzero(ids == pad), np.flatnonzero(np.diff(np.flatnonzero(ids == pad)) != 1) + 1
    )
    grids = inputs["image_grid_thw"].numpy() // np.array([1, 2, 2])
    spans = np.array([(r[0], len(r), g[1], g[2]) for r, g in zip(runs, grids, strict=True)])
    n = len(ids)
    np.testing.assert_array_equal(rope_positions(np.arange(n), spans), want)
    for lo, hi in [(0, 7), (7, 40), (40, n), (n - 3, n)]:
        np.testing.assert_array_equal(rope_positions(np.arange(lo, hi), spans), want[:, lo:hi])
    later = np.arange(n, n + 4)
    np.testing.assert_array_equal(rope_positions(later, spans)[0], later + int(delta[0, 0]))
    assert spans_of([]).shape == (0, 4)


def test_window_layout_equals_transformers(qwen):
    """The encoder's window order and windows equal transformers' get_vision_window_index,
    and each patch's (row, column) its get_vision_position_ids, for odd and even grids."""
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    cfg = qwen.llm_engine.model_config.vision
    for grid in [(1, 4, 14), (1, 10, 8), (1, 16, 16), (1, 12, 20), (1, 2, 2)]:
        order, seg, pos = cfg.layout(grid)
        thw = torch.tensor([grid])
        index, cu = get_vision_window_index(thw, cfg.merge, cfg.window_size, cfg.patch_size)
        np.testing.assert_array_equal(order, index.numpy())
        sizes = np.diff(cu.numpy()) // cfg.unit
        np.testing.assert_array_equal(np.bincount(seg), sizes)
        assert (np.diff(seg) >= 0).all()
        np.testing.assert_array_equal(pos.T, get_vision_position_ids(thw, cfg.merge).numpy())


def test_images_key_the_prefix_cache(qwen):
    prompt = "A long shared beginning, several blocks of text tokens before it: " + QWEN_IMAGE
    a, b = images(1, 1, seed=9)
    first, other, again = (generate(qwen, [(prompt, [im])])[0] for im in (a, b, a))
    n = len(first.prompt_token_ids)
    start = first.prompt_token_ids.index(qwen.llm_engine.model_config.vision.image_token_id)
    assert other.num_cached_tokens <= start // 16 * 16 < n - 16
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > start
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_preemption_and_a_full_batch_keep_the_answers(qwen_dir, qwen):
    """Few KV blocks: requests are preempted and recomputed (their images again, from the
    encoder cache or anew), and answer as alone."""
    pairs = cases(seed=30) * 2
    alone = [generate(qwen, [pair])[0].outputs[0].token_ids for pair in pairs[:4]]
    small = LLM(qwen_dir, **{**ENGINE, "num_gpu_blocks_override": 10})
    outs = generate(small, pairs, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone * 2


def test_chat_with_a_data_url(qwen, oracle):
    import base64
    import io

    image = images(1, seed=6)[0]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    out = qwen.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt.startswith(f"USER: Look: {QWEN_IMAGE}")
    assert_matches_oracle(oracle, out.prompt, [image], out)


def test_mm_processor_kwargs_resize(qwen):
    """A request's max_pixels below the engine's makes fewer tokens; above it, or an
    unknown key, is refused."""
    pad = qwen.llm_engine.model_config.vision.image_token_id
    im = images(2)
    small = qwen.generate(
        {
            "prompt": f"x {QWEN_IMAGE}",
            "multi_modal_data": {"image": im},
            "mm_processor_kwargs": {"max_pixels": 112 * 112},
        },
        GREEDY,
        use_tqdm=False,
    )[0]
    assert small.prompt_token_ids.count(pad) == 16
    for kwargs, error in [
        ({"max_pixels": 448 * 448}, "above the engine's"),
        ({"do_resize": False}, "not supported"),
        ({"max_pixels": -1}, "positive integer"),
        ({"max_pixels": 2**63}, "above the engine's"),
        ({"min_pixels": 2**31}, "must not exceed"),
        ({"max_pixels": float("nan")}, "positive integer"),
        ({"max_pixels": "50176"}, "positive integer"),
        ({"max_pixels": True}, "positive integer"),
    ]:
        with pytest.raises(ValueError, match=error):
            qwen.generate(
                {
                    "prompt": f"x {QWEN_IMAGE}",
                    "multi_modal_data": {"image": im},
                    "mm_processor_kwargs": kwargs,
                },
                GREEDY,
            )


def test_placeholders(qwen):
    """A text prompt holds one placeholder per image; a token prompt each image's expanded
    run, and answers as the text prompt."""
    im = images(0, 1)
    with pytest.raises(ValueError, match="placeholder"):
        generate(qwen, [(f"one {QWEN_IMAGE}", im)])
    with pytest.raises(ValueError, match="placeholder"):
        generate(qwen, [("none", im[:1])])
    text = generate(qwen, [(f"a {QWEN_IMAGE} b {QWEN_IMAGE}", im)])[0]
    tokens = qwen.generate(
        {"prompt_token_ids": text.prompt_token_ids, "multi_modal_data": {"image": im}},
        GREEDY,
        use_tqdm=False,
    )[0]
    assert tokens.outputs[0].token_ids == text.outputs[0].token_ids
    short = list(text.prompt_token_ids)
    short.remove(qwen.llm_engine.model_config.vision.image_token_id)
    with pytest.raises(ValueError, match="placeholder runs"):
        qwen.generate({"prompt_token_ids": short, "multi_modal_data": {"image": im}}, GREEDY)
    assert not qwen.llm_engine.has_unfinished_requests()


def test_no_compile_after_warmup(qwen):
    runner = qwen.llm_engine.runner
    assert runner.compile_guard
    generate(qwen, cases(seed=40))
    assert set(runner.table.details("image encoder")) == set(runner.encoder.buckets)


def test_tensor_parallel(qwen_dir, oracle):
    """TP = 2 on fake CPU devices: the vision tower whole on each device, the answers equal
    transformers'."""
    llm = LLM(qwen_dir, tensor_parallel_size=2, **ENGINE)
    qkv = llm.llm_engine.runner.state["visual"]["blocks"]["attn"]["qkv"]["weight"]
    assert qkv.get_value().sharding.is_fully_replicated
    pairs = cases(seed=50)[:2]
    for (prompt, ims), out in zip(pairs, generate(llm, pairs), strict=True):
        assert_matches_oracle(oracle, prompt, ims, out)


def test_images_need_no_torch(qwen_dir):
    """The engine's image path (processor, placeholders, hashes) runs with PyTorch
    unimportable, as in an install without it."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # import torch raises ImportError
        sys.modules["torchvision"] = None
        import numpy as np
        from PIL import Image
        from jllm.engine.multimodal import MultiModalProcessor
        from jllm.models.qwen2_5_vl import qwen2_5_vision_config
        from transformers import AutoConfig, AutoTokenizer
        path = {qwen_dir!r}
        vision = qwen2_5_vision_config(AutoConfig.from_pretrained(path))
        tok = AutoTokenizer.from_pretrained(path)
        mm = MultiModalProcessor(path, vision, None, None, 32, tokenizer=tok)
        image = Image.fromarray(np.zeros((150, 120, 3), np.uint8))
        ids, items = mm.process("a <|vision_start|><|image_pad|><|vision_end|>", None, [image])
        assert items[0].length == 20 and items[0].grid == (1, 10, 8), items[0]
        print("ok", mm.max_patches)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", "256"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tokenizer_dir):
    return save_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl")), tokenizer_dir)


def test_qwen3_vl_matches_transformers(qwen3_dir):
    """Qwen3-VL (16-pixel patches: the sizes give grids 4x12, 10x8, 16x16 and, scaled, 10x16
    patches): one, two and three images and text only, chunked at 32 tokens, so DeepStack's
    features reach the first decoder layers chunk by chunk; and a prefix hit through an
    image answers as the first run."""
    llm = LLM(qwen3_dir, **ENGINE)
    oracle = QwenVLOracle(qwen3_dir)
    pairs = cases(seed=60)
    outs = generate(llm, pairs)
    for (prompt, ims), out in zip(pairs, outs, strict=True):
        assert_matches_oracle(oracle, prompt, ims, out)
    again = generate(llm, pairs[:1])[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert llm.llm_engine.runner.encoder.pool.shape[-1] == 64 * 3  # embedding + 2 DeepStack


def test_position_taps_equal_transformers(qwen3_dir):
    """Qwen3-VL's bilinear taps into its learned grid equal transformers'
    get_vision_interpolation_indices_and_weights, in the merge squares' order."""
    from transformers import AutoConfig
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    from jllm.models.qwen3_vl import qwen3_vision_config

    cfg = qwen3_vision_config(AutoConfig.from_pretrained(qwen3_dir))
    for grid in [(1, 4, 12), (1, 10, 8), (1, 16, 16), (1, 2, 2)]:
        _, _, pos = cfg.layout(grid)
        taps, weights = cfg.position_taps(grid, pos)
        want_taps, want_weights = get_vision_interpolation_indices_and_weights(
            torch.tensor([grid]), cfg.position_side, align_corners=True, spatial_merge_size=2
        )
        np.testing.assert_array_equal(taps, want_taps.numpy())
        np.testing.assert_allclose(weights, want_weights.numpy(), rtol=0, atol=1e-7)


def test_qwen3_vl_moe_matches_transformers(tmp_path, tokenizer_dir):
    """Qwen3-VL-MoE (4 experts, top 2): equal to transformers, from the file transformers
    saves (its modules' stacked layout) and from the released layout ([E, D, 2F] and
    [E, F, D], which the test writes), with experts split over two devices (EP)."""
    import shutil

    import safetensors.numpy

    path = save_qwen3_vl(str(tmp_path / "moe"), tokenizer_dir, moe=True)
    oracle = QwenVLOracle(path)
    pairs = cases(seed=70)[:2]
    outs = generate(LLM(path, **ENGINE), pairs)
    for (prompt, ims), out in zip(pairs, outs, strict=True):
        assert_matches_oracle(oracle, prompt, ims, out)
    released = str(tmp_path / "released")
    shutil.copytree(path, released)
    file = f"{released}/model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = np.ascontiguousarray(tensors[name].transpose(0, 2, 1))
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
    llm = LLM(released, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    again = generate(llm, pairs)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_server_chat_equals_llm_chat(qwen, qwen_dir):
    """The openai client against the server: a Qwen2.5-VL chat with a data URL answers as
    LLM.chat; mm_processor_kwargs above the engine's max_pixels is a 400, and the server
    goes on."""
    import base64
    import io

    import openai
    from openai_server import MODEL_NAME, serving

    image = images(1, seed=8)[0]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [
        {"type": "text", "text": "What is it? "},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    messages = [{"role": "user", "content": content}]
    expected = qwen.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].text
    with serving(qwen_dir, "--limit-mm-per-prompt", '{"image": 1}') as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
        ask = dict(model=MODEL_NAME, messages=messages, max_tokens=GREEDY.max_tokens)
        reply = client.chat.completions.create(
            **ask, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].message.content == expected
        with pytest.raises(openai.BadRequestError, match="above the engine's"):
            client.chat.completions.create(
                **ask, extra_body={"mm_processor_kwargs": {"max_pixels": 1 << 24}}
            )
        again = client.chat.completions.create(**ask, temperature=0.0)
        assert again.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "engine",
    [
        {"async_scheduling": True},
        {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 2,
                "prompt_lookup_min": 1,
            }
        },
    ],
    ids=["async", "ngram"],
)
def test_crosses_answer_as_alone(qwen, qwen_dir, engine):
    """Async scheduling, or n-gram drafts verified beside the decodes (M-RoPE positions past
    the prompt for the drafts): two requests admitted in one step sharing a prefix and its
    image, an n=2 request beside them; every greedy answer equals the plain engine's alone."""
    image = images(1, seed=90)
    shared = f"One shared beginning of two prompts, {QWEN_IMAGE} then"
    pairs = [(shared + " the first", image), (shared + " another", image), cases(91)[1]]
    alone = [generate(qwen, [pair])[0].outputs[0].token_ids for pair in pairs]
    llm = LLM(qwen_dir, **{**ENGINE, **engine})
    outs = generate(llm, pairs)
    assert [o.outputs[0].token_ids for o in outs] == alone
    two = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    (both,) = generate(llm, pairs[2:], two)
    assert [c.token_ids for c in both.outputs] == [alone[2], alone[2]]

"""Image inputs against transformers: LLaVA-1.5 (CLIP) and Gemma 3 (SigLIP, image tokens
attending to each other in both directions), tiny random models built by the test with their
processors, in float32 on the C++, XLA and Pallas (interpret) attention paths; chunked
prefill inside an image, the encoder and prefix caches, the chat API, and bad input."""

from __future__ import annotations

import base64
import io

import jax
import pytest
from vision_oracle import (
    GEMMA3_IMAGE,
    LLAVA_IMAGE,
    VisionOracle,
    assert_matches_oracle,
    random_images,
    save_gemma3,
    save_llava,
)

from jllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
# A budget of 32 tokens splits the prompts below inside their images' 16 tokens (LLaVA;
# Gemma 3's are computed whole, so its chunks stop before them).
ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    max_num_batched_tokens=32,
    max_num_seqs=4,
    num_gpu_blocks_override=96,
    limit_mm_per_prompt={"image": 2},
)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, tokenizer_dir):
    return save_llava(str(tmp_path_factory.mktemp("llava")), tokenizer_dir)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, tokenizer_dir):
    return save_gemma3(str(tmp_path_factory.mktemp("gemma3")), tokenizer_dir)


@pytest.fixture(scope="module")
def llava(llava_dir):
    return LLM(llava_dir, **ENGINE)


def prompts_for(mark: str) -> list[tuple[str, int]]:
    """(prompt, images): one image mid-prompt, two images, an image first."""
    return [
        (f"USER: describe {mark}\nWhat is in the picture? ASSISTANT:", 1),
        (f"Two pictures: {mark} and then {mark} compared", 2),
        (f"{mark} short", 1),
    ]


def run(llm, mark: str, seed: int = 0):
    cases = [(p, random_images(n, seed + i)) for i, (p, n) in enumerate(prompts_for(mark))]
    requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in cases]
    return cases, llm.generate(requests, GREEDY, use_tqdm=False)


def test_llava_matches_transformers(llava, llava_dir):
    oracle = VisionOracle(llava_dir)
    cases, outs = run(llava, LLAVA_IMAGE)
    for (prompt, images), out in zip(cases, outs, strict=True):
        assert_matches_oracle(oracle, prompt, images, out)


@pytest.fixture(scope="module")
def gemma3_untied_dir(tmp_path_factory, tokenizer_dir):
    return save_gemma3(str(tmp_path_factory.mktemp("gemma3-untied")), tokenizer_dir, False)


# The Pallas GPU kernel's horizon is tested in the kit (tests/pallas_kernels/). On the XLA
# path the model's LM head is its own matrix (the top-level tie_word_embeddings=False). The
# C++ kernel's engine compiles every bucket at start-up, as the LLaVA engine does; the other
# two compile the buckets these prompts use (the Pallas interpreter's take long to compile).
@pytest.mark.parametrize("backend", ["cpu_kernel", "xla", "pallas_interpret"])
def test_gemma3_matches_transformers(request, backend):
    path = request.getfixturevalue("gemma3_untied_dir" if backend == "xla" else "gemma3_dir")
    eager = backend != "cpu_kernel"
    llm = LLM(path, attention_backend=backend, enforce_eager=eager, **ENGINE)
    oracle = VisionOracle(path)
    cases, outs = run(llm, GEMMA3_IMAGE)
    for (prompt, images), out in zip(cases, outs, strict=True):
        assert_matches_oracle(oracle, prompt, images, out)


def test_images_key_the_prefix_cache(llava):
    """The same text with another image shares only the blocks before the image, and
    answers as that image; the same image again hits the whole prefix."""
    prompt = "A long shared beginning of the prompt, several blocks of text tokens: " + LLAVA_IMAGE
    a, b = random_images(2, seed=7)
    first, other, again = (
        llava.generate(
            {"prompt": prompt, "multi_modal_data": {"image": im}}, GREEDY, use_tqdm=False
        )[0]
        for im in (a, b, a)
    )
    n = len(first.prompt_token_ids)
    image_start = first.prompt_token_ids.index(llava.llm_engine.model_config.vision.image_token_id)
    assert other.num_cached_tokens <= image_start // 16 * 16 < n - 16
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > image_start
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_parts(llava, llava_dir, tmp_path):
    """LLM.chat with a data URL and a local file equals generate with the rendered prompt."""
    image = random_images(1, seed=3)[0]
    path = tmp_path / "cat.png"
    image.save(path)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": data_url(image)}},
            ],
        }
    ]
    out = llava.chat(messages, GREEDY, use_tqdm=False)[0]
    oracle = VisionOracle(llava_dir)
    assert out.prompt.startswith(f"USER: Look: {LLAVA_IMAGE}")  # the template's rendering
    assert_matches_oracle(oracle, out.prompt, [image], out)
    file_part = {"type": "image_url", "image_url": {"url": f"file://{path}"}}
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        llava.chat([{"role": "user", "content": [file_part]}], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "request_, error",
    [
        ({"prompt": f"{LLAVA_IMAGE}{LLAVA_IMAGE}{LLAVA_IMAGE}", "n": 3}, "At most 2 image"),
        ({"prompt": f"one {LLAVA_IMAGE}", "n": 2}, "placeholder|<image> tokens"),
        ({"prompt": "no placeholder", "n": 1}, "placeholder|<image> tokens"),
        ({"prompt": f"{LLAVA_IMAGE}", "images": ["not an image"]}, "PIL.Image"),
        ({"prompt": f"{LLAVA_IMAGE}", "mm": {"video": 1}}, "images only"),
    ],
)
def test_bad_image_prompts_are_refused_and_harm_nothing(llava, request_, error):
    images = request_.get("images") or random_images(request_.get("n", 1))
    data = request_.get("mm") or {"image": images}
    with pytest.raises(ValueError, match=error):
        llava.generate({"prompt": request_["prompt"], "multi_modal_data": data}, GREEDY)
    assert not llava.llm_engine.has_unfinished_requests()
    good = llava.generate({"prompt": "ok", "multi_modal_data": {"image": []}}, GREEDY)
    assert len(good[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_media_rules():
    from jllm.entrypoints.media import MediaConnector

    media = MediaConnector()
    with pytest.raises(ValueError, match="not allowed"):
        media.fetch_image("http://example.com/cat.png")
    with pytest.raises(ValueError, match="could not be decoded"):
        media.fetch_image("data:image/png;base64," + base64.b64encode(b"junk").decode())
    with pytest.raises(ValueError, match="base64"):
        media.fetch_image("data:image/png;base64,@@@")


def test_removed_image_flags_are_refused():
    from jllm.config import EngineArgs

    with pytest.raises(ValueError, match="removed from vLLM"):
        EngineArgs.from_kwargs(image_input_type="pixel_values")


def test_beam_search_keeps_the_images(llava):
    """Every beam continues the prompt with its images: one beam is greedy search."""
    from jllm import BeamSearchParams

    prompt = f"USER: {LLAVA_IMAGE}\nWhat is it? ASSISTANT:"
    request = {"prompt": prompt, "multi_modal_data": {"image": random_images(1, seed=9)}}
    (beams,) = llava.beam_search([request], BeamSearchParams(beam_width=1, max_tokens=4))
    greedy = llava.generate(request, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    want = greedy[0].outputs[0].token_ids
    assert beams.sequences[0].tokens[-len(want) :] == want


def test_no_compile_after_warmup_with_images(llava):
    """Every encoder bucket compiled at start-up: a step with more images than before
    compiles nothing (the compile guard would raise)."""
    runner = llava.llm_engine.runner
    assert runner.compile_guard
    run(llava, LLAVA_IMAGE, seed=11)
    assert set(runner.table.details("image encoder")) == set(runner.encoder.buckets)


def test_server_chat_with_data_url_equals_llm_chat(llava, llava_dir):
    """The openai client against the server: an image as a data URL answers as LLM.chat;
    an http URL from a domain not allowed is a 400 at once, and the server goes on."""
    import httpx
    import openai
    from openai_server import MODEL_NAME, RunningServer, server_args

    from jllm.entrypoints.openai.api_server import build_app, build_engine

    image = random_images(1, seed=5)[0]
    content = [
        {"type": "text", "text": "What is it? "},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
    ]
    messages = [{"role": "user", "content": content}]
    expected = llava.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].text
    args = server_args(llava_dir, "--limit-mm-per-prompt", '{"image": 1}')
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=GREEDY.max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].message.content == expected
        far = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
        with pytest.raises(openai.BadRequestError, match="not allowed"):
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": [far]}], max_tokens=2
            )
        two = [*content, content[1]]
        with pytest.raises(openai.BadRequestError, match="At most 1 image"):
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": two}], max_tokens=2
            )
        again = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0.0
        )
        assert again.choices[0].finish_reason == "length"
        # The agent routes carry the same image: Responses' input_image, Anthropic's base64
        # block (the same greedy answer, EOS ignored through the routes' extra fields).
        url = data_url(image)
        r = client.responses.create(
            model=MODEL_NAME,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is it? "},
                        {"type": "input_image", "image_url": url},
                    ],
                }
            ],
            max_output_tokens=GREEDY.max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert r.output_text == expected
        media, _, b64 = url.removeprefix("data:").partition(";base64,")
        block = {"type": "image", "source": {"type": "base64", "media_type": media, "data": b64}}
        body = {
            "model": MODEL_NAME,
            "max_tokens": 2,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is it? "}, block]}
            ],
        }
        m = httpx.post(f"{running.url}/v1/messages", json=body, timeout=120)
        assert m.status_code == 200 and m.json()["usage"]["input_tokens"] == r.usage.input_tokens
    finally:
        running.stop()
        engine.shutdown()


def test_tensor_parallel_replicates_the_encoder(gemma3_dir):
    """TP = 2 on fake CPU devices: the vision tower and projector are whole on every device
    (replicated), the language model split, and the answers equal transformers'."""
    llm = LLM(gemma3_dir, tensor_parallel_size=2, **ENGINE)
    state = llm.llm_engine.runner.state
    tower = state["vision_tower"]["encoder"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert tower.get_value().sharding.is_fully_replicated
    q = state["layers" if "layers" in state else "blocks"]
    assert not all(a.sharding.is_fully_replicated for a in jax.tree.leaves(q))
    oracle = VisionOracle(gemma3_dir)
    cases, outs = run(llm, GEMMA3_IMAGE, seed=20)
    for (prompt, images), out in zip(cases, outs, strict=True):
        assert_matches_oracle(oracle, prompt, images, out)


def test_token_prompts_need_expanded_placeholders(llava):
    """A token-id prompt holds each image's placeholder tokens already expanded (16 here);
    one placeholder for an image is refused by jllm's own check."""
    image_id = llava.llm_engine.model_config.vision.image_token_id
    image = random_images(1, seed=4)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        llava.generate(
            {"prompt_token_ids": [1, 5, image_id, 7], "multi_modal_data": {"image": image}},
            GREEDY,
        )
    text = llava.generate(
        {"prompt": f"see {LLAVA_IMAGE} now", "multi_modal_data": {"image": image}},
        GREEDY,
        use_tqdm=False,
    )[0]
    tokens = llava.generate(
        {"prompt_token_ids": text.prompt_token_ids, "multi_modal_data": {"image": image}},
        GREEDY,
        use_tqdm=False,
    )[0]
    assert tokens.outputs[0].token_ids == text.outputs[0].token_ids

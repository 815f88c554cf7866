"""The official `openai` client against a real jllm server: answers equal the offline API's,
streaming equals non-streaming, and every error case has its status code and body."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from openai_server import MODEL_NAME, HeldEngine, RunningServer, server_args, wait_idle

from jllm import SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "In a hole in the ground"]
CHAT = [{"role": "user", "content": "Write a haiku about JAX."}]


def offline(llm, prompts, **params):
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def test_models_health_version(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, "other-name"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_matches_offline(client, llama_llm, stream):
    want = offline(llama_llm, PROMPTS, temperature=0, max_tokens=12, ignore_eos=True)
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS,
        temperature=0,
        max_tokens=12,
        stream=stream,
        extra_body={"ignore_eos": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    texts = ["" for _ in PROMPTS]
    reasons = [None for _ in PROMPTS]
    if stream:
        usage = None
        for chunk in got:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] += c.text
                reasons[c.index] = c.finish_reason or reasons[c.index]
    else:
        usage = got.usage
        for c in got.choices:
            texts[c.index], reasons[c.index] = c.text, c.finish_reason
        assert got.model == MODEL_NAME and got.object == "text_completion"
    assert texts == [o.outputs[0].text for o in want]
    assert reasons == ["length"] * len(PROMPTS)
    assert usage.completion_tokens == 12 * len(PROMPTS)
    assert usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_token_id_prompts_and_echo(client, llama_llm):
    ids = llama_llm.get_tokenizer().encode(PROMPTS[0])
    want = offline(llama_llm, [{"prompt_token_ids": ids}], temperature=0, max_tokens=6)
    for prompt in (ids, [ids]):
        got = client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=6
        )
        assert got.choices[0].text == want[0].outputs[0].text
    echo = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=6, echo=True
    )
    assert echo.choices[0].text == PROMPTS[0] + want[0].outputs[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_matches_offline(client, llama_llm, stream):
    want = llama_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    got = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        temperature=0,
        max_completion_tokens=10,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    if stream:
        chunks = list(got)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
    else:
        text, finish, usage = (
            got.choices[0].message.content,
            got.choices[0].finish_reason,
            got.usage,
        )
        assert got.choices[0].message.role == "assistant"
    assert text == want[0].outputs[0].text
    assert finish == want[0].outputs[0].finish_reason
    assert usage.prompt_tokens == len(want[0].prompt_token_ids)
    assert usage.completion_tokens == len(want[0].outputs[0].token_ids)


def test_chat_content_parts(client, llama_llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a haiku about JAX."}]}]
    a = client.chat.completions.create(
        model=MODEL_NAME, messages=parts, temperature=0, max_tokens=8
    )
    b = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_n2_seeded_sampling(client, stream):
    kwargs = dict(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        n=2,
        max_tokens=8,
        seed=7,
        temperature=1.0,
        stream=stream,
    )
    got = client.completions.create(**kwargs)
    texts = ["", ""]
    if stream:
        for chunk in got:
            for c in chunk.choices:
                texts[c.index] += c.text
    else:
        for c in got.choices:
            texts[c.index] = c.text
    again = client.completions.create(**{**kwargs, "stream": False})
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]


def test_completion_logprobs_match_offline(client, llama_llm):
    want = offline(llama_llm, [PROMPTS[0]], temperature=0, max_tokens=5, logprobs=3)[0].outputs[0]
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=5, logprobs=3
    ).choices[0]
    lp = got.logprobs
    assert lp.token_logprobs == pytest.approx(
        [entry[t].logprob for t, entry in zip(want.token_ids, want.logprobs, strict=True)],
        abs=1e-4,  # the two engines' prefix caches hold different prefixes
    )
    assert all(len(top) == 3 for top in lp.top_logprobs)  # greedy: the sampled is the top 1
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == got.text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(client, llama_llm, stream):
    want = llama_llm.chat(
        CHAT, SamplingParams(temperature=0, max_tokens=5, logprobs=2), use_tqdm=False
    )[0].outputs[0]
    got = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        stream=stream,
    )
    if stream:
        content = [
            t
            for c in got
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content
        ]
    else:
        content = got.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx(
        [entry[t].logprob for t, entry in zip(want.token_ids, want.logprobs, strict=True)],
        abs=1e-4,  # the two engines' prefix caches hold different prefixes
    )
    for t in content:
        assert [x.logprob for x in t.top_logprobs] == sorted(
            [x.logprob for x in t.top_logprobs], reverse=True
        )
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert bytes(t.bytes).decode() == t.token


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, llama_llm, stream):
    full = offline(llama_llm, [PROMPTS[2]], temperature=0, max_tokens=16, ignore_eos=True)
    text = full[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = text[: text.index(stop)]
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        temperature=0,
        max_tokens=16,
        stop=[stop],
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = [c.choices[0] for c in got]
        assert all(stop not in c.text for c in chunks)
        got_text, last = "".join(c.text for c in chunks), chunks[-1]
    else:
        got_text, last = got.choices[0].text, got.choices[0]
    assert got_text == want
    assert last.finish_reason == "stop" and last.stop_reason == stop


async def _stream_one(client, prompt):
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        temperature=0,
        max_tokens=10,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, chunks = "", 0
    async for chunk in stream:
        chunks += 1
        text += chunk.choices[0].text
    return text, chunks


def test_32_concurrent_streams_match_offline(async_client, llama_llm, server):
    prompts = [f"Request number {i} says" for i in range(32)]
    want = offline(llama_llm, prompts, temperature=0, max_tokens=10, ignore_eos=True)

    async def run():
        good = [_stream_one(async_client, p) for p in prompts]
        # Bad requests interleaved with the good ones must not disturb them.
        bad = [
            async_client.completions.create(model=MODEL_NAME, prompt="x", top_p=0) for _ in range(4)
        ]
        results = await asyncio.gather(*good, *bad, return_exceptions=True)
        return results[:32], results[32:]

    results, bad = asyncio.run(run())
    assert [r[0] for r in results] == [o.outputs[0].text for o in want]
    assert all(r[1] > 2 for r in results)  # streamed in pieces, not one final chunk
    assert all(isinstance(b, openai.BadRequestError) for b in bad)
    wait_idle(server)


@pytest.fixture
def held(server, monkeypatch):
    def hold(after: int) -> HeldEngine:
        return HeldEngine.install(server, after, monkeypatch)

    return hold


def test_disconnect_mid_stream_frees_blocks(server, held):
    hold = held(after=8)
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            assert all(next(events) for _ in range(3))
            # Leaving the iterator early closes the connection: the disconnect.
    wait_idle(server)
    assert not hold.timed_out, "the server never aborted the disconnected stream"
    assert len(hold.aborted) == 1 and hold.aborted[0].startswith("cmpl-")
    assert server.engine.engine.core.parents == {}


def test_disconnect_non_streaming_aborts(server, held):
    hold = held(after=1)
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
    }
    # The engine is held after the first token, so the reply cannot come before the timeout.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    wait_idle(server)
    assert not hold.timed_out, "the server never aborted the abandoned request"
    assert len(hold.aborted) == 1


def test_metrics(client, server):
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket",
    ):
        assert f'{name}{{engine="0"' in text or f"{name}{{" in text, name
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:") and "_bucket" not in line and "finished_reason" not in line
    }
    assert values["vllm:generation_tokens_total"] >= 4
    assert values["vllm:time_to_first_token_seconds_count"] >= 1
    assert f'model_name="{MODEL_NAME}"' in text


def test_tokenize_detokenize(server, llama_llm):
    tok = llama_llm.get_tokenizer()
    got = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert got["tokens"] == tok.encode("Hello world") and got["count"] == len(got["tokens"])
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    want = llama_llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    assert chat["tokens"] == want


def post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json=body, **kw)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -1}, None),
        ({"prompt": "x", "top_p": 0}, None),
        ({"prompt": "x", "n": 0}, None),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, None),
        ({"prompt": "x", "allowed_token_ids": []}, None),
        ({"prompt": "x", "logprobs": -2}, None),
        ({"prompt": "x", "logprobs": 50}, None),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
        ({"prompt": []}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "cache_salt": ""}, None),
    ],
)
def test_bad_completion_requests_are_400(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
    if param is not None:
        assert error["param"] == param


def test_logit_bias_allowed_token_ids_and_bad_words(client, llama_llm):
    """The server's fields reach the sampler as the offline API's do."""
    fields = [
        {"logit_bias": {"1234": 100}},
        {"allowed_token_ids": [11, 12, 13]},
        {"bad_words": ["the", "hello world"], "logit_bias": {"88": -100.0}},
    ]
    for extra in fields:
        params = {k: v for k, v in extra.items() if k != "logit_bias"}
        if "logit_bias" in extra:
            params["logit_bias"] = {int(k): v for k, v in extra["logit_bias"].items()}
        want = offline(llama_llm, PROMPTS[:1], temperature=0, max_tokens=6, **params)
        got = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[0],
            temperature=0,
            max_tokens=6,
            logit_bias=extra.get("logit_bias"),
            extra_body={k: v for k, v in extra.items() if k != "logit_bias"},
        )
        assert got.choices[0].text == want[0].outputs[0].text
    assert want[0].outputs[0].token_ids  # sanity: something was generated
    forced = offline(llama_llm, PROMPTS[:1], temperature=0, max_tokens=3, logit_bias={1234: 100})
    assert forced[0].outputs[0].token_ids == [1234] * 3


def test_prompt_logprobs_and_echo_with_logprobs(client, server, llama_llm):
    """prompt_logprobs (vLLM's extra field) and OpenAI's echo + logprobs equal the offline
    API's prompt logprobs; the first prompt token has none."""
    prompt = PROMPTS[1]
    want = offline(llama_llm, [prompt], temperature=0, max_tokens=3, prompt_logprobs=2)[0]
    ids = want.prompt_token_ids
    body = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "max_tokens": 3}
    got = post(server, "/v1/completions", {**body, "prompt_logprobs": 2}).json()["choices"][0]
    assert got["prompt_logprobs"][0] is None
    for pos in range(1, len(ids)):
        entry = got["prompt_logprobs"][pos]
        assert {int(t) for t in entry} == set(want.prompt_logprobs[pos])
        for t, lp in want.prompt_logprobs[pos].items():
            assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entry[str(t)]["rank"] == lp.rank
    r = post(server, "/v1/completions", {**body, "prompt_logprobs": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"

    for stream in (False, True):
        res = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            temperature=0,
            max_tokens=3,
            echo=True,
            logprobs=1,
            stream=stream,
        )
        chunks = list(res) if stream else [res]
        text = "".join(c.choices[0].text for c in chunks)
        token_logprobs = sum((c.choices[0].logprobs.token_logprobs for c in chunks), [])
        assert text == prompt + want.outputs[0].text
        assert len(token_logprobs) == len(ids) + 3 and token_logprobs[0] is None
        for pos in range(1, len(ids)):
            assert token_logprobs[pos] == pytest.approx(
                want.prompt_logprobs[pos][ids[pos]].logprob, abs=1e-5
            )


def test_use_beam_search(client, server, llama_llm):
    """The server's beam search returns the offline API's best beams, generated text only."""
    from jllm import BeamSearchParams

    tok = llama_llm.get_tokenizer()
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, temperature=0.0)
    want = llama_llm.beam_search(PROMPTS[0], params)[0].sequences
    n_prompt = len(tok.encode(PROMPTS[0]))
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        n=3,
        max_tokens=5,
        temperature=0,
        extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 1.0},
    )
    assert [c.text for c in got.choices] == [
        tok.decode(s.tokens[n_prompt:], skip_special_tokens=True) for s in want
    ]
    assert all(c.finish_reason == "length" for c in got.choices)
    body = {"model": MODEL_NAME, "prompt": "x", "use_beam_search": True, "stream": True}
    assert post(server, "/v1/completions", body).status_code == 400
    # Chat: the same search over the rendered conversation.
    prompt = llama_llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    want = llama_llm.beam_search({"prompt_token_ids": prompt.prompt_token_ids}, params)[0]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        n=3,
        max_tokens=5,
        temperature=0,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    n_chat = len(prompt.prompt_token_ids)
    assert [c.message.content for c in chat.choices] == [
        tok.decode(s.tokens[n_chat:], skip_special_tokens=True) for s in want.sequences
    ]
    wait_idle(server)


def test_prompt_over_context_is_400_and_max_tokens_fits_the_room(client):
    with pytest.raises(openai.BadRequestError, match="maximum model length"):
        client.completions.create(model=MODEL_NAME, prompt="word " * 600, max_tokens=4)
    # The prompt fits but prompt + max_tokens does not (max_model_len is 512): as vLLM's
    # get_max_tokens, max_tokens is the room the prompt leaves.
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="word " * 500,
        max_tokens=500,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 512
    assert out.choices[0].finish_reason == "length"


def test_malformed_json_is_400(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)


def test_bad_chat_requests_are_400(server):
    cases = [
        {"messages": CHAT, "top_logprobs": 2},
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": []},
        {"messages": "hello"},
    ]
    for body in cases:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]


def test_api_key(served):
    from jllm.entrypoints.openai.api_server import build_app

    running, args, metrics = served
    keyed_args = server_args(args.model, "--api-key", "secret")
    keyed = RunningServer(build_app(keyed_args, running.engine, metrics), running.engine)
    try:
        bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(f"{keyed.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="secret", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices
        assert httpx.get(f"{keyed.url}/health").status_code == 200  # outside /v1
    finally:
        keyed.stop()


def test_chat_template_and_response_role_flags(served, tmp_path, llama_llm):
    from jllm.entrypoints.openai.api_server import build_app

    running, args, metrics = served
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    flags = server_args(args.model, "--chat-template", str(template), "--response-role", "bot")
    custom = RunningServer(build_app(flags, running.engine, metrics), running.engine)
    try:
        got = httpx.post(f"{custom.url}/tokenize", json={"messages": CHAT}).json()
        tok = llama_llm.get_tokenizer()
        assert got["tokens"] == tok.encode(f"<user>{CHAT[0]['content']}", add_special_tokens=False)
        client = openai.OpenAI(base_url=f"{custom.url}/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=6
        )
        want = llama_llm.generate(
            {"prompt_token_ids": got["tokens"]},
            SamplingParams(temperature=0, max_tokens=6),
            use_tqdm=False,
        )[0].outputs[0]
        assert answer.choices[0].message.role == "bot"
        assert answer.choices[0].message.content == want.text
    finally:
        custom.stop()


def test_continuous_usage_stats(client):
    """`continuous_usage_stats`: every chunk carries usage with its choice's tokens so far (0
    on the role chunk), and the final chunk carries the totals; without it only the final one."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            temperature=0,
            max_tokens=7,
            stream=True,
            stream_options=opts,
            extra_body={"ignore_eos": True},
        )
    )
    prompt = chunks[0].usage.prompt_tokens
    assert prompt > 0 and chunks[0].usage.completion_tokens == 0
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage.prompt_tokens == prompt for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 7
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7

    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[:2],
            n=2,
            temperature=0.8,
            seed=3,
            max_tokens=5,
            stream=True,
            stream_options=opts,
            extra_body={"ignore_eos": True},
        )
    )
    last: dict[int, int] = {}
    for c in chunks[:-1]:
        index = c.choices[0].index
        assert c.usage.completion_tokens >= last.get(index, 0)
        last[index] = c.usage.completion_tokens
    assert last == {0: 5, 1: 5, 2: 5, 3: 5}
    assert chunks[-1].usage.completion_tokens == 20

    plain = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def test_cache_salt(client, server):
    """vLLM's cache_salt field: requests share prefix-cache blocks only within one salt."""
    kv = server.engine.engine.scheduler.kv_cache
    prompt = list(range(100, 150))

    def hits(**extra):
        before = kv.prefix_hits
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, **extra)
        return kv.prefix_hits - before

    hits(extra_body={"cache_salt": "tenant-1"})
    assert hits(extra_body={"cache_salt": "tenant-1"}) == 48
    assert hits(extra_body={"cache_salt": "tenant-2"}) == 0
    chat = [{"role": "user", "content": "a fairly long message " * 6}]
    client.chat.completions.create(
        model=MODEL_NAME, messages=chat, max_tokens=1, extra_body={"cache_salt": "t3"}
    )
    before = kv.prefix_hits
    client.chat.completions.create(
        model=MODEL_NAME, messages=chat, max_tokens=1, extra_body={"cache_salt": "t4"}
    )
    assert kv.prefix_hits == before


def test_tokenization_runs_off_the_event_loop(client, server, monkeypatch):
    """Prompts are tokenized and chat templates applied on the tokenization thread, never on
    the event loop that serves every stream."""

    tok = server.engine.get_tokenizer()
    threads = []
    encode, template = tok.encode, tok.apply_chat_template

    def record(fn):
        def wrapped(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(tok, "encode", record(encode))
    monkeypatch.setattr(tok, "apply_chat_template", record(template))
    client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=1)
    client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
    httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello"})
    assert len(threads) >= 4
    assert all(name.startswith("jllm-tokenize") for name in threads), threads

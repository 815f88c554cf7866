"""Hostile requests against a live server: boundary values of every field of every route
(2**31 and 2**63, negative, NaN and Infinity, empty and huge lists and strings, wrong types,
deep JSON, bodies that are not objects, invalid UTF-8). Each is answered without a server
error: a refusal is a 4xx with OpenAI's error body, a value the server can honour (a top_k
past the vocabulary, a huge seed) is served. While they arrive a well-formed request runs,
and its output equals its output alone; /health answers 200 after each."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from oracle import prompt_ids

BIG = [2**31, 2**63, 2**64, -(2**63) - 1, -5]
INT_FIELDS = [
    "n",
    "max_tokens",
    "min_tokens",
    "top_k",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "priority",
    "best_of",
]
FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
]
# Raw JSON that Python's reader turns into NaN and infinities.
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999"]
BASE = {"completions": {"prompt": "hello", "max_tokens": 2}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = "[" * 100_000 + "]" * 100_000


def raw(body: dict, field: str, literal: str) -> bytes:
    """`body` with `field` set to a raw JSON literal (NaN, Infinity: not valid JSON)."""
    text = json.dumps({**body, field: "@@"})
    return text.replace('"@@"', literal).encode()


def cases() -> list[tuple[str, str, bytes]]:
    """(id, path, body bytes)."""
    out = []
    for path, body in (("/v1/completions", BASE["completions"]), ("/v1/chat/completions", CHAT)):
        short = "chat" if "chat" in path else "cmpl"
        for field in INT_FIELDS + (["top_logprobs"] if "chat" in path else []):
            for value in [*BIG, 1.5, "7", True, [], {}]:
                out.append((f"{short}-{field}-{value!r}"[:60], path, _dump({**body, field: value})))
        for field in FLOAT_FIELDS:
            for literal in NON_FINITE + ['"x"', "-1e308", "[1]"]:
                out.append((f"{short}-{field}-{literal}", path, raw(body, field, literal)))
        hostile = {
            "stop-many": {"stop": ["a", "b", "c", "d", "e"]},
            "stop-empty": {"stop": [""]},
            "stop-huge": {"stop": "x" * 1_000_000},
            "stop-type": {"stop": [1, 2]},
            "stop-ids-big": {"stop_token_ids": [2**40]},
            "stop-ids-neg": {"stop_token_ids": [-1]},
            "logit-bias-key": {"logit_bias": {"abc": 1}},
            "logit-bias-big-key": {"logit_bias": {str(2**70): 1}},
            "logit-bias-value": {"logit_bias": {"1": 1e9}},
            "logit-bias-type": {"logit_bias": [1, 2]},
            "allowed-empty": {"allowed_token_ids": []},
            "allowed-big": {"allowed_token_ids": [2**63]},
            "bad-words-huge": {"bad_words": ["x" * 100_000]},
            "bad-words-many": {"bad_words": [f"w{i}" for i in range(1000)]},
            "bad-words-type": {"bad_words": [1]},
            "salt-empty": {"cache_salt": ""},
            "salt-type": {"cache_salt": 5},
            "unknown-field": {"no_such_field": {"a": [1, 2, 3]}},
            "model-unknown": {"model": "nope"},
            "model-type": {"model": 5},
            "regex-bad": {"structured_outputs": {"regex": "(("}},
            "schema-bad": {"response_format": {"type": "json_schema", "json_schema": 5}},
            "format-type": {"response_format": {"type": "xml"}},
            "xargs-type": {"vllm_xargs": [1]},
            "stream-options-type": {"stream_options": {"include_usage": "yes"}},
            "beam-stream": {"use_beam_search": True, "stream": True},
            "beam-huge": {"use_beam_search": True, "n": 2**40},
        }
        for name, extra in hostile.items():
            out.append((f"{short}-{name}", path, _dump({**body, **extra})))
    prompts = {
        "empty": "",
        "empty-list": [],
        "nested-empty": [[]],
        "negative-id": [-1],
        "big-id": [2**63],
        "float-ids": [1.5],
        "long": "word " * 50_000,
        "long-ids": [5] * 100_000,
        "dict": {"a": 1},
    }
    for name, prompt in prompts.items():
        out.append((f"prompt-{name}", "/v1/completions", _dump({"prompt": prompt})))
    # Prompt embeddings on a server without --enable-prompt-embeds, and no prompt at all.
    for name, body in {
        "embeds-off": {"prompt_embeds": "AAAA"},
        "embeds-type": {"prompt_embeds": 5},
        "embeds-empty": {"prompt_embeds": []},
        "none": {"max_tokens": 2},
    }.items():
        out.append((f"prompt-{name}", "/v1/completions", _dump(body)))
    messages = {
        "empty": [],
        "empty-message": [{}],
        "no-role": [{"content": "hi"}],
        "role-type": [{"role": 5, "content": "hi"}],
        "content-type": [{"role": "user", "content": 5}],
        "content-nested": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}],
        "unknown-part": [{"role": "user", "content": [{"type": "video", "video": "x"}]}],
        "image-on-text-model": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
                ],
            }
        ],
        "string": "hi",
        "long": [{"role": "user", "content": "word " * 50_000}],
    }
    for name, msgs in messages.items():
        body = {"messages": msgs, "max_tokens": 2}
        out.append((f"messages-{name}", "/v1/chat/completions", _dump(body)))
    template = "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"
    out += [
        ("chat-template", "/v1/chat/completions", _dump({**CHAT, "chat_template": template})),
        ("tokenize-template", "/tokenize", _dump({**CHAT, "chat_template": "{{ 'x' * 10**10 }}"})),
        (
            "chat-template-kwargs",
            "/v1/chat/completions",
            _dump({**CHAT, "chat_template_kwargs": {"tokenize": True, "conversation": []}}),
        ),
        ("tools-type", "/v1/chat/completions", _dump({**CHAT, "tools": "x"})),
        ("tools-bad", "/v1/chat/completions", _dump({**CHAT, "tools": [{"type": "function"}]})),
        ("tool-choice-bad", "/v1/chat/completions", _dump({**CHAT, "tool_choice": {"x": 1}})),
        ("tokenize-empty-message", "/tokenize", _dump({"messages": [{}]})),
        ("tokenize-nothing", "/tokenize", _dump({})),
        ("tokenize-both", "/tokenize", _dump({"prompt": "a", "messages": CHAT["messages"]})),
        ("detokenize-big", "/detokenize", _dump({"tokens": [2**63]})),
        ("detokenize-neg", "/detokenize", _dump({"tokens": [-1]})),
        ("detokenize-float", "/detokenize", _dump({"tokens": [1.5]})),
        ("detokenize-str", "/detokenize", _dump({"tokens": ["a"]})),
        ("detokenize-vocab", "/detokenize", _dump({"tokens": [10**6]})),
    ]
    out += anthropic_cases() + responses_cases()
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
    ):
        short = path.removeprefix("/v1/").replace("/", "-")
        for name, body in {
            "deep": DEEP.encode(),
            "null": b"null",
            "array": b"[]",
            "number": b"5",
            "empty": b"",
            "not-utf8": b'{"prompt": "\xff\xfe"}',
            "truncated": b'{"prompt": "a',
        }.items():
            out.append((f"{short}-body-{name}", path, body))
    return out


MESSAGES = {"model": "tiny-llama", "max_tokens": 2, "messages": CHAT["messages"]}


def anthropic_cases() -> list[tuple[str, str, bytes]]:
    """Anthropic's Messages route: its fields' boundaries and malformed content blocks."""
    out = []
    for field in ("max_tokens", "top_k"):
        for value in [*BIG, 0, 1.5, "7", True, None]:
            out.append(
                (f"msg-{field}-{value!r}"[:60], "/v1/messages", _dump({**MESSAGES, field: value}))
            )
    for field in ("temperature", "top_p"):
        for literal in NON_FINITE + ['"x"', "-1"]:
            out.append((f"msg-{field}-{literal}", "/v1/messages", raw(MESSAGES, field, literal)))
    image = {"type": "base64", "media_type": "image/png", "data": "not base64!"}
    blocks = {
        "unknown-block": [{"type": "document", "source": {}}],
        "text-type": [{"type": "text", "text": 5}],
        "image-on-text-model": [{"type": "image", "source": image}],
        "image-source": [{"type": "image", "source": {"type": "file", "path": "/etc/passwd"}}],
        "tool-use-from-user": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
        "tool-result-type": [{"type": "tool_result", "tool_use_id": "a", "content": 5}],
        "empty-blocks": [],
        "long": [{"type": "text", "text": "word " * 50_000}],
    }
    for name, content in blocks.items():
        body = {**MESSAGES, "messages": [{"role": "user", "content": content}]}
        out.append((f"msg-{name}", "/v1/messages", _dump(body)))
    hostile = {
        "no-model": {"model": None},
        "model-unknown": {"model": "nope"},
        "no-messages": {"messages": None},
        "role-system": {"messages": [{"role": "system", "content": "x"}]},
        "system-type": {"system": 5},
        "system-blocks": {"system": [{"type": "image", "source": image}]},
        "stop-many": {"stop_sequences": [str(i) for i in range(1000)]},
        "stop-empty": {"stop_sequences": [""]},
        "tools-bad": {"tools": [{"name": "f"}]},
        "tools-schema-type": {"tools": [{"name": "f", "input_schema": []}]},
        "tool-choice-unknown": {"tool_choice": {"type": "tool", "name": "nope"}},
        "tool-choice-no-name": {"tool_choice": {"type": "tool"}},
        "tool-choice-auto": {"tools": [{"name": "f", "input_schema": {}}]},
        "thinking-type": {"thinking": {"type": "always"}},
    }
    for name, extra in hostile.items():
        out.append((f"msg-{name}", "/v1/messages", _dump({**MESSAGES, **extra})))
        count = {k: v for k, v in {**MESSAGES, **extra}.items() if k != "max_tokens"}
        out.append((f"count-{name}", "/v1/messages/count_tokens", _dump(count)))
    return out


def responses_cases() -> list[tuple[str, str, bytes]]:
    """The Responses route: its fields' boundaries, malformed items, unknown stored ids."""
    base = {"input": "hi", "max_output_tokens": 2}
    out = []
    for field in ("max_output_tokens", "top_logprobs", "seed", "top_k", "priority"):
        for value in [*BIG, 0, 1.5, "7", True]:
            out.append(
                (f"resp-{field}-{value!r}"[:60], "/v1/responses", _dump({**base, field: value}))
            )
    for field in ("temperature", "top_p"):
        for literal in NON_FINITE + ['"x"']:
            out.append((f"resp-{field}-{literal}", "/v1/responses", raw(base, field, literal)))
    hostile = {
        "input-empty": {"input": ""},
        "input-empty-list": {"input": []},
        "input-long": {"input": "word " * 50_000},
        "item-unknown": {"input": [{"type": "computer_call"}]},
        "item-role": {"input": [{"role": "tool", "content": "x"}]},
        "item-image-bad": {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
                }
            ]
        },
        "item-image-file": {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "file:///etc/passwd"}],
                }
            ]
        },
        "call-args-not-json": {
            "input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{"}]
        },
        "encrypted": {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
        "tools-other": {"tools": [{"type": "mcp", "server_url": "http://x"}]},
        "tool-choice-missing": {"tool_choice": {"type": "function", "name": "nope"}},
        "format-bad": {"text": {"format": {"type": "json_schema", "schema": {"type": 5}}}},
        "previous-unknown": {"previous_response_id": "resp_nope"},
        "background-no-store": {"background": True, "store": False},
        "include-unknown": {"include": ["file_search_call.results"]},
        "metadata-type": {"metadata": {"a": 1}},
    }
    for name, extra in hostile.items():
        out.append((f"resp-{name}", "/v1/responses", _dump({**base, **extra})))
    return out


def _dump(body) -> bytes:
    return json.dumps(body).encode()


CASES = cases()


@pytest.fixture(scope="module")
def bystander(server):
    """A well-formed request's output alone: the one that runs beside the hostile ones."""
    body = {
        "prompt": prompt_ids(1, 20, seed=77)[0],
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    alone = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).json()
    return body, alone["choices"]


def test_hostile_requests_get_4xx_and_harm_nothing(server, bystander):
    body, alone = bystander
    beside = {}

    def run():
        beside["r"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)

    thread = threading.Thread(target=run)
    thread.start()
    failures = []
    with httpx.Client(base_url=server.url, timeout=300) as http:
        for name, path, content in CASES:
            try:
                r = http.post(path, content=content, headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                failures.append(f"{name}: {e!r}")
                continue
            if r.status_code >= 500:
                failures.append(f"{name}: {r.status_code} {r.text[:200]}")
            elif r.status_code >= 400 and path.startswith("/v1/messages"):
                body = r.json()
                if not (body.get("type") == "error" and body["error"].get("message")):
                    failures.append(f"{name}: not Anthropic's error body: {r.text[:200]}")
            elif r.status_code >= 400:
                error = r.json().get("error", {})
                if not (error.get("message") and error.get("code") == r.status_code):
                    failures.append(f"{name}: not OpenAI's error body: {r.text[:200]}")
            health = http.get("/health")
            if health.status_code != 200:
                failures.append(f"{name}: /health answered {health.status_code} after it")
                break
    thread.join()
    assert not failures, "\n".join(failures)
    assert beside["r"].status_code == 200
    (got,), (want,) = beside["r"].json()["choices"], alone
    assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(
        want["logprobs"]["token_logprobs"], abs=1e-4
    )

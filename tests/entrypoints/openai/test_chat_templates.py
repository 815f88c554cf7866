"""A request's chat template and its kwargs: a template sent in a request is refused unless
the server trusts request templates (vLLM's --trust-request-chat-template), and kwargs that
name the renderer's own parameters are refused by name, on /v1/chat/completions and
/tokenize alike."""

from __future__ import annotations

import httpx
import pytest
from openai_server import MODEL_NAME, RunningServer, server_args

from jllm.entrypoints.openai.api_server import build_app
from jllm.entrypoints.openai.chat_templates import UNTRUSTED_TEMPLATE

CHAT = [{"role": "user", "content": "Hello there"}]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
ROUTES = {
    "chat": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2}),
    "tokenize": ("/tokenize", {"messages": CHAT}),
}


def post(server, route: str, **fields) -> httpx.Response:
    path, body = ROUTES[route]
    return httpx.post(f"{server.url}{path}", json={**body, **fields}, timeout=60)


@pytest.fixture(scope="module")
def trusting(served):
    running, args, metrics = served
    flags = server_args(args.model, "--trust-request-chat-template")
    server = RunningServer(build_app(flags, running.engine, metrics), running.engine)
    yield server
    server.stop()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "fields",
    [
        {"chat_template": TEMPLATE},
        {"chat_template_kwargs": {"chat_template": TEMPLATE}},
    ],
    ids=["chat_template", "in_kwargs"],
)
def test_request_template_is_refused_by_default(server, route, fields):
    r = post(server, route, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == UNTRUSTED_TEMPLATE


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "key, value",
    [
        ("tokenize", True),
        ("conversation", []),
        ("messages", []),
        ("tools", []),
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("return_dict", True),
        ("return_tensors", "np"),
        ("tokenizer_kwargs", {}),
    ],
)
def test_kwargs_naming_renderer_parameters_are_refused(trusting, route, key, value):
    r = post(trusting, route, chat_template_kwargs={key: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert repr(key) in error["message"] and error["param"] == "chat_template_kwargs"


def test_kwargs_chat_template_is_refused_even_when_trusted(trusting):
    """A trusted template goes in `chat_template`; inside the kwargs it is the renderer's."""
    r = post(trusting, "tokenize", chat_template_kwargs={"chat_template": TEMPLATE})
    assert r.status_code == 400 and "'chat_template'" in r.json()["error"]["message"]


def test_template_variables_pass(server, llama_llm):
    """Other keys are the template's variables (here unused by the model's template), and
    `documents` is template data: both render as without them."""
    tok = llama_llm.get_tokenizer()
    r = post(server, "tokenize", chat_template_kwargs={"greeting": "Hi", "documents": []})
    assert r.status_code == 200, r.text
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)


def test_trusted_request_template_is_rendered(trusting, llama_llm):
    tok = llama_llm.get_tokenizer()
    r = post(
        trusting,
        "tokenize",
        chat_template="{{ greeting }}" + TEMPLATE,
        chat_template_kwargs={"greeting": "Hi!"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode("Hi![user] Hello there", add_special_tokens=False)
    chat = post(trusting, "chat", chat_template=TEMPLATE)
    assert chat.status_code == 200, chat.text

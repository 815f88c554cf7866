"""What a request may change of the chat template, checked before anything is rendered (for
/v1/chat/completions and /tokenize alike).

- A request's own `chat_template` (or one inside `chat_template_kwargs`) is Jinja the server
  would run for a client: refused unless the server runs with `--trust-request-chat-template`,
  with vLLM's message.
- `chat_template_kwargs` are variables for the template. A key that names one of the
  renderer's own parameters (`tokenize`, `conversation`, `tools`, `add_generation_prompt`,
  `return_dict`, ...) would steer the renderer instead, or clash with what the server passes:
  refused with a 400 naming it. vLLM refuses `chat_template` and `tokenize` and quietly lets
  its own values win for the rest; jllm names each one, as it does every input it will not
  honour. `documents` stays allowed: it is template data, and the request has no field of
  its own for it.
"""

from __future__ import annotations

import functools
import inspect

from jllm.entrypoints.openai.serving_engine import OpenAIError

UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
# Hugging Face's `apply_chat_template` parameters (and the template's `messages`) that the
# server sets itself; `renderer_parameters` adds those of the tokenizer at hand.
RENDERER_PARAMETERS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
TEMPLATE_DATA = frozenset({"documents"})


@functools.cache
def renderer_parameters(tokenizer_type: type) -> frozenset[str]:
    """The named parameters of `tokenizer_type.apply_chat_template`, with the base set."""
    try:
        signature = inspect.signature(tokenizer_type.apply_chat_template)
    except (AttributeError, TypeError, ValueError):
        return RENDERER_PARAMETERS
    named = {
        p.name
        for p in signature.parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
    }
    return RENDERER_PARAMETERS | (named - TEMPLATE_DATA)


def check_request_template(request, tokenizer, trusted: bool) -> dict:
    """The request's `chat_template_kwargs` to render with (a dict), after refusing an
    untrusted request template and keys that belong to the renderer (OpenAIError, 400)."""
    template_kwargs = getattr(request, "template_kwargs", None)
    kwargs = template_kwargs() if template_kwargs else request.chat_template_kwargs
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise OpenAIError("chat_template_kwargs must be an object.", 400, "chat_template_kwargs")
    if not trusted and (
        request.chat_template is not None or kwargs.get("chat_template") is not None
    ):
        raise OpenAIError(UNTRUSTED_TEMPLATE, 400, "chat_template")
    reserved = sorted(set(kwargs) & renderer_parameters(type(tokenizer)))
    if reserved:
        names = ", ".join(repr(k) for k in reserved)
        raise OpenAIError(
            f"chat_template_kwargs cannot set {names}: the server sets the renderer's own "
            "parameters (use the request's fields, such as add_generation_prompt, "
            "continue_final_message, tools and chat_template).",
            400,
            "chat_template_kwargs",
        )
    return kwargs

"""What the request handlers refuse beyond each field's own type and range, written into the
published document as JSON Schema (OpenAPI 3.1): rules across fields as `anyOf` branches
(the one structured-outputs constraint a request may give, a stream's, top_logprobs'), the
fields jllm does not support as null-only, and what depends on the server's flags (the
scheduling policy, a request's chat template, the grammar backend, images). A request the
document allows is then one the server takes, but for what no schema can describe (listed
in docs/server.md and checked by tests/entrypoints/openai/test_contract.py)."""

from __future__ import annotations

from jllm.sampling_params import StructuredOutputsParams

NOT_SUPPORTED = {"type": "null", "description": "Not supported by jllm: only null."}

# vLLM's structured_outputs object: exactly one kind of constraint, and its options.
STRUCTURED_KINDS = {
    "json": {"type": ["object", "string"]},
    "regex": {"type": "string"},
    "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "grammar": {"type": "string", "minLength": 1},
    "json_object": {"const": True},
    "structural_tag": {"type": "string"},
}
assert set(STRUCTURED_KINDS) == set(StructuredOutputsParams.KINDS)
STRUCTURED_OUTPUTS = {
    "type": "object",
    "properties": {
        **{k: {"anyOf": [v, {"type": "null"}]} for k, v in STRUCTURED_KINDS.items()},
        "disable_fallback": {"type": "boolean"},
        "disable_any_whitespace": {"type": "boolean"},
        "disable_additional_properties": {"type": "boolean"},
        "whitespace_pattern": {"type": ["string", "null"]},
    },
    "additionalProperties": False,
    "oneOf": [{"required": [k], "properties": {k: v}} for k, v in STRUCTURED_KINDS.items()],
}
RESPONSE_FORMAT = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object", "structural_tag"]}},
            "required": ["type"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "properties": {"schema": {"type": "object"}},
                    "required": ["schema"],
                },
            },
            "required": ["type", "json_schema"],
        },
        {"type": "null"},
    ]
}
# The fields that each give a constraint (as they look when they do; null or absent they
# do not, nor a response_format of type text); a request gives at most one.
CONSTRAINTS = {
    "structured_outputs": {"type": "object"},
    "guided_json": {"type": ["object", "string"]},
    "guided_regex": {"type": "string"},
    "guided_choice": {"type": "array"},
    "guided_grammar": {"type": "string"},
    "response_format": {
        "type": "object",
        "properties": {"type": {"enum": ["json_object", "json_schema", "structural_tag"]}},
        "required": ["type"],
    },
}
NO_CONSTRAINT = {
    **{name: {"type": "null"} for name in CONSTRAINTS},
    # (Not an anyOf: nested in every branch, schemathesis' canonical form gave up on it.)
    "response_format": {"type": ["object", "null"], "properties": {"type": {"const": "text"}}},
}


def below(n: int) -> list[str]:
    """Regexes that together match the decimal integers in [0, n), written canonically (no
    sign, no leading zero): the token ids a logit_bias key may name. Several patterns
    without alternation, as schemathesis generates from those."""
    top = str(n - 1)
    parts = ["0"] if len(top) > 1 else []
    if len(top) > 2:
        parts.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    elif len(top) == 2:
        parts.append("[1-9]")
    for i, digit in enumerate(top):
        lo = 1 if i == 0 and len(top) > 1 else 0
        last = i == len(top) - 1
        hi = int(digit) if last else int(digit) - 1
        if hi >= lo:
            rest = "" if last else f"[0-9]{{{len(top) - i - 1}}}"
            digits = str(lo) if lo == hi else f"[{lo}-{hi}]"  # schemathesis refuses [0-0]
            parts.append(f"{top[:i]}{digits}{rest}")
    return [f"^{part}$" for part in parts]


def logit_bias(vocab_size: int) -> dict:
    """Token ids of the vocabulary, each to a bias in OpenAI's [-100, 100]."""
    return {
        "anyOf": [
            {
                "type": "object",
                "patternProperties": {
                    pattern: {"type": "number", "minimum": -100, "maximum": 100}
                    for pattern in below(vocab_size)
                },
                "additionalProperties": False,
            },
            {"type": "null"},
        ]
    }


def one_constraint() -> dict:
    """At most one structured-outputs constraint; with none, no whitespace pattern (it
    shapes a JSON constraint); with one, no beam search. One `anyOf` rather than a rule per
    pair: schemathesis generates from it, where ten `if`s were too many."""
    no_pattern = {"guided_whitespace_pattern": {"type": "null"}}
    no_beams = {"use_beam_search": {"const": False}}
    branches = [{"properties": {**NO_CONSTRAINT, **no_pattern}}]
    for name in CONSTRAINTS:
        others = {k: v for k, v in NO_CONSTRAINT.items() if k != name}
        branches.append(
            {"properties": {**others, **no_beams, name: CONSTRAINTS[name]}, "required": [name]}
        )
    return {"anyOf": branches}


def both(rule: dict, branches: list[dict]) -> dict:
    """`rule` (an anyOf) and one of `branches`, as one anyOf over the pairs (the branches
    constrain other properties than the rule's)."""
    return {
        "anyOf": [
            {
                "properties": {**a["properties"], **b["properties"]},
                "required": a.get("required", []) + b.get("required", []),
            }
            for a in rule["anyOf"]
            for b in branches
        ]
    }


# A stream carries no prompt logprobs and no beams (vLLM's refusals).
STREAM = [  # not streamed: no stream options (vLLM's rule; an empty object passes)
    {
        "properties": {
            "stream": {"const": False},
            "stream_options": {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]},
        }
    },
    {"properties": {"prompt_logprobs": {"type": "null"}, "use_beam_search": {"const": False}}},
]
# top_logprobs asks for logprobs=true (chat).
TOP_LOGPROBS = [
    {"properties": {"top_logprobs": {"type": "null"}}},
    {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
]


def prompt_rule(schema: dict, limits: dict) -> dict:
    """Completions take a prompt, prompt embeddings (under --enable-prompt-embeds) or both;
    without the flag, `prompt_embeds` is null only."""
    props = schema["properties"]
    prompt = {"anyOf": [b for b in props["prompt"]["anyOf"] if b != {"type": "null"}]}
    if not limits["prompt_embeds"]:
        props["prompt_embeds"] = {
            "type": "null",
            "description": "Only with --enable-prompt-embeds.",
        }
        return {"properties": {"prompt": prompt}, "required": ["prompt"]}
    embeds = {"anyOf": [b for b in props["prompt_embeds"]["anyOf"] if b != {"type": "null"}]}
    embeds["anyOf"] = [
        {**b, "minItems": 1} if b.get("type") == "array" else b for b in embeds["anyOf"]
    ]
    return {
        "anyOf": [
            {"properties": {"prompt": prompt}, "required": ["prompt"]},
            {"properties": {"prompt_embeds": embeds}, "required": ["prompt_embeds"]},
        ]
    }


def write_rules(schemas: dict, limits: dict) -> None:
    """Write the rules into the request schemas of the completions and chat routes.
    `limits`: as `openapi.build_openapi`'s."""
    # Anthropic's bodies pass chat_template_kwargs to the same renderer (vLLM's field).
    templated = (
        "ChatCompletionRequest",
        "TokenizeRequest",
        "MessagesRequest",
        "CountTokensRequest",
    )
    for name in templated:
        props = schemas.get(name, {}).get("properties", {})
        if "chat_template" in props and not limits["trust_request_chat_template"]:
            props["chat_template"] = {
                "type": "null",
                "description": "Only with --trust-request-chat-template.",
            }
        if "chat_template_kwargs" in props:  # the renderer's own parameters are its own
            reserved = set(limits["renderer_parameters"])
            if limits["trust_request_chat_template"]:
                reserved.discard("chat_template")
            props["chat_template_kwargs"] = {
                "type": ["object", "null"],
                "properties": {key: False for key in sorted(reserved)},
            }
    tokenize = schemas.get("TokenizeRequest")
    if tokenize is not None:  # a prompt or messages, not both
        tokenize["anyOf"] = [
            {
                "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
                "required": ["prompt"],
            },
            {
                "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}},
                "required": ["messages"],
            },
        ]
    part = schemas.get("ContentPart")
    if part is not None:  # image parts only for a model that takes images
        kinds = ["text", "image_url"] if limits["images"] else ["text"]
        part["properties"]["type"] = {"enum": kinds}
        part["anyOf"] = [
            {"properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
            {
                "properties": {
                    "type": {"const": "image_url"},
                    "image_url": {
                        "type": "object",
                        "properties": {"url": {"type": "string"}},
                        "required": ["url"],
                    },
                },
                "required": ["image_url"],
            },
        ][: len(kinds)]
    responses = schemas.get("ResponsesRequest")
    if responses is not None:
        props = responses["properties"]
        if not limits["priority"]:
            props["priority"] = {"type": "integer", "const": 0}
        if not limits["responses_store"]:  # background runs live in the store
            props["background"] = {"type": "boolean", "const": False}
            props["previous_response_id"] = {"type": "null"}
        else:  # in the background, stored
            responses["anyOf"] = [
                {"properties": {"background": {"const": False}}},
                {"properties": {"store": {"const": True}}},
            ]
        # vLLM's fields as chat's; structured_outputs or text.format, not both.
        props["structured_outputs"] = {"anyOf": [STRUCTURED_OUTPUTS, {"type": "null"}]}
        props["logit_bias"] = logit_bias(limits["vocab_size"])
        responses["allOf"] = [
            {
                "anyOf": [
                    {"properties": {"structured_outputs": {"type": "null"}}},
                    {"properties": {"text": {"type": "null"}}},
                    {"properties": {"text": {"properties": {"format": {"type": "null"}}}}},
                ]
            }
        ]
    for name in ("ImageBlock", "InputImage"):  # Anthropic's image blocks, Responses' parts
        if name in schemas and not limits["images"]:
            schemas[name] = {"not": {}, "description": "Only for a model that takes images."}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema = schemas.get(name)
        if schema is None:
            continue
        props = schema["properties"]
        props["lora_request"] = NOT_SUPPORTED
        props["best_of"] = NOT_SUPPORTED
        props["structured_outputs"] = {"anyOf": [STRUCTURED_OUTPUTS, {"type": "null"}]}
        props["response_format"] = RESPONSE_FORMAT
        props["logit_bias"] = logit_bias(limits["vocab_size"])
        props["guided_json"] = {"type": ["object", "string", "null"]}
        props["guided_choice"] = {"anyOf": [STRUCTURED_KINDS["choice"], {"type": "null"}]}
        props["guided_grammar"] = {"type": ["string", "null"], "minLength": 1}
        props["guided_decoding_backend"] = {"enum": [limits["grammar_backend"], None]}
        if not limits["priority"]:  # under fcfs a priority is refused (vLLM's 400)
            props["priority"] = {
                "type": "integer",
                "const": 0,
                "description": "Only with --scheduling-policy priority.",
            }
        # Completions: the constraint and the stream rules side by side. Chat: the
        # constraint rule and top_logprobs' as one anyOf over their pairs; beside the
        # stream rule as well, schemathesis' canonical form gives up, so chat's document
        # does not state it (the one rule it leaves out).
        if name == "CompletionRequest":
            props["suffix"] = NOT_SUPPORTED
            rules = [one_constraint(), {"anyOf": STREAM}, prompt_rule(schema, limits)]
        else:
            rules = [both(one_constraint(), TOP_LOGPROBS)]
        schema["allOf"] = rules

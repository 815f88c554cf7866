"""The grammar engines behind structured outputs: xgrammar (vLLM's default) and llguidance
(vLLM's "guidance"), each from PyPI.

A backend turns a request's `StructuredOutputsParams` into a compiled grammar (on a worker
thread: `compile` may take a while) and a compiled grammar into a matcher per sequence. A
matcher accepts the sampled tokens one by one, rolls back draft tokens, and fills a row of
the packed token bitmask the sampler applies on the device: int32 [ceil(V / 32)], bit j of
word i set when token 32 i + j is allowed (the layout both libraries share). The stop
tokens are allowed exactly where the grammar can end.

`validate` only parses the constraint (no tokenizer work), for the front end's 400s.
Host-side only: no JAX.
"""

from __future__ import annotations

import json
import re

import numpy as np

from jllm.sampling_params import StructuredOutputsParams
from jllm.utils import cdiv

# The PyPI package behind each backend.
PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance"}


def bitmask_width(vocab_size: int) -> int:
    return cdiv(vocab_size, 32)


def _message(e: Exception) -> str:
    """A library error without its C++ source prefix ("[12:00:00] /path/file.cc:42: ")."""
    text = str(e).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return text.replace("Check failed: (error.empty()) is false: ", "").strip()


def _invalid(p: StructuredOutputsParams, e: Exception) -> ValueError:
    """A library's error about a request's constraint as the ValueError the front end turns
    into a 400 (our own such errors, from reading the constraint, pass as they are)."""
    prefix = f"Invalid {p.kind} for structured outputs"
    message = _message(e)
    if isinstance(e, ValueError) and message.startswith(prefix):
        return e
    return ValueError(f"{prefix}: {message}")


def _no_additional_properties(schema):
    """vLLM's `disable_additional_properties`: objects without `additionalProperties` get
    `false`."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def json_schema_text(p: StructuredOutputsParams) -> str:
    """The request's JSON schema as text (`{"type": "object"}` for json_object)."""
    if p.json_object:
        return '{"type": "object"}'
    schema = p.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"Invalid json for structured outputs: the schema is not JSON ({e})."
            ) from e
    if not isinstance(schema, dict | bool):
        raise ValueError(
            "Invalid json for structured outputs: a schema is an object, not "
            f"{type(schema).__name__}."
        )
    if p.disable_additional_properties:
        schema = _no_additional_properties(schema)
    return json.dumps(schema)


def _structural_tag_args(xgr, text: str) -> tuple:
    """xgrammar's arguments for a structural tag: its JSON (`{"type": "structural_tag",
    "format": ...}`), or, for vLLM's older form `{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}`, the tag items and triggers, as vLLM passes them."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"Invalid structural_tag for structured outputs: not JSON ({e}).") from e
    if isinstance(tag, dict) and "structures" in tag:
        try:
            items = [
                xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                )
                for s in tag["structures"]
            ]
            return items, list(tag["triggers"])
        except (KeyError, TypeError) as e:
            raise ValueError(
                "Invalid structural_tag for structured outputs: structures need begin, "
                f"schema and end, and triggers a list ({e!r})."
            ) from e
    return (text,)


class XgrammarMatcher:
    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    def fill(self, bitmask: np.ndarray, index: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, index)

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_ids) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def _grammar_source(self, p: StructuredOutputsParams):
        """(kind, text) with choice written as an EBNF alternation."""
        if p.whitespace_pattern is not None:
            raise ValueError(
                "whitespace_pattern is not supported by the xgrammar backend; use "
                "disable_any_whitespace, or the guidance backend."
            )
        kind = p.kind
        if kind in ("json", "json_object"):
            return "json", json_schema_text(p)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in p.choice)
            return "grammar", f"root ::= {alternatives}"
        return kind, p.spec

    def validate(self, p: StructuredOutputsParams) -> None:
        xgr = self._xgr
        kind, text = self._grammar_source(p)
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(text, any_whitespace=not p.disable_any_whitespace)
            elif kind == "regex":
                xgr.Grammar.from_regex(text)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(text)
            elif kind == "structural_tag":
                xgr.Grammar.from_structural_tag(*_structural_tag_args(xgr, text))
        except Exception as e:  # the library raises RuntimeError / its own types
            error = _invalid(p, e)
            raise error from (None if error is e else e)

    def compile(self, p: StructuredOutputsParams):
        kind, text = self._grammar_source(p)
        c = self._compiler
        if kind == "json":
            return c.compile_json_schema(text, any_whitespace=not p.disable_any_whitespace)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "grammar":
            return c.compile_grammar(text)
        return c.compile_structural_tag(*_structural_tag_args(self._xgr, text))

    def matcher(self, compiled) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))


class GuidanceMatcher:
    """llguidance's matcher behind the xgrammar-like interface: terminated once it accepted a
    stop token (llguidance's own `is_stopped` is true as soon as only a stop token may
    follow). A token is checked before it is consumed (a refused token would leave
    llguidance in an error state that rollback does not clear), and a stop token accepted
    after the grammar has stopped, which llguidance does not record, is rolled back here."""

    def __init__(self, matcher, fill, stop_ids) -> None:
        self._m, self._fill, self._stop_ids = matcher, fill, stop_ids
        self._accepted: list[tuple[bool, bool]] = []  # per token: (a stop token, recorded)

    def accept(self, token: int) -> bool:
        stop = token in self._stop_ids
        if self._m.is_stopped():
            if stop:
                self._accepted.append((True, False))
            return stop
        if self._m.validate_tokens([token]) < 1 or not self._m.consume_token(token):
            return False
        self._accepted.append((stop, True))
        return True

    def fill(self, bitmask: np.ndarray, index: int) -> None:
        self._fill(self._m, bitmask, index)

    def rollback(self, n: int) -> None:
        if not n:
            return
        undone = self._accepted[-n:]
        del self._accepted[-n:]
        recorded = sum(1 for _, rec in undone if rec)
        if recorded:
            self._m.rollback(recorded)

    def is_terminated(self) -> bool:
        return bool(self._accepted) and self._accepted[-1][0]


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, stop_ids) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self._ll = llguidance
        self._stop_ids = frozenset(stop_ids)
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_ids) or None
        )

    def _grammar(self, p: StructuredOutputsParams) -> str:
        ll = self._ll
        kind = p.kind
        if kind in ("json", "json_object"):
            defaults = {"whitespace_flexible": not p.disable_any_whitespace}
            if p.whitespace_pattern is not None:
                defaults["whitespace_pattern"] = p.whitespace_pattern
            return ll.LLMatcher.grammar_from_json_schema(json_schema_text(p), defaults=defaults)
        if kind == "choice":
            return ll.grammar_from("choice", json.dumps(p.choice))
        if kind == "regex":
            return ll.grammar_from("regex", p.regex)
        if kind == "grammar":
            return ll.grammar_from("grammar", p.grammar)
        raise ValueError("structural_tag is supported by the xgrammar backend only.")

    def validate(self, p: StructuredOutputsParams) -> None:
        try:
            grammar = self._grammar(p)
            error = self._ll.LLMatcher.validate_grammar(grammar, self._tokenizer)
        except Exception as e:  # the library raises ValueError, TypeError, ...
            error = _invalid(p, e)
            raise error from (None if error is e else e)
        if error:
            raise ValueError(f"Invalid {p.kind} for structured outputs: {error}")

    def compile(self, p: StructuredOutputsParams):
        """A matcher in the grammar's start state (llguidance compiles when it is built);
        each sequence gets a copy."""
        m = self._ll.LLMatcher(self._tokenizer, self._grammar(p))
        if m.is_error():
            raise ValueError(f"Invalid grammar: {m.get_error()}")
        return m

    def matcher(self, compiled) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy(), self._fill, self._stop_ids)


BACKEND_CLASSES = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}


def installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(PACKAGES[name]) is not None

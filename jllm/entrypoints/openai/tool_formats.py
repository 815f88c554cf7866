"""More of vLLM's `--tool-call-parser` formats: `mistral`, `pythonic`, `qwen3_coder` /
`qwen3_xml` and `deepseek_v3`. Each reads a finished output into (content, calls) and says
where a call may begin in a stream (`stream_start`), as `tool_parsers.py`'s do; text that
does not parse stays content.

- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (before v11
  tokenizers) or `name[ARGS]{...}` / `name{...}` per call (v11 and later); 9-character ids.
- `pythonic`: the whole output a Python list of calls with keyword arguments,
  `[get_weather(city="Paris", days=3)]`; values are literals only (read with `ast`, never
  evaluated).
- `qwen3_coder` / `qwen3_xml` (one format): `<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter>...</function></tool_call>`; each value is converted to its type in the
  request's tool schema (integer, number, boolean, object, array, null; else the string).
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a
  ```json block of the arguments, `<｜tool▁call▁end｜>` per call, `<｜tool▁calls▁end｜>`.
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import string

from jllm.entrypoints.openai.tool_calls import ToolCall, held_back, json_arguments


class MistralToolParser:
    name = "mistral"
    start = "[TOOL_CALLS]"
    skip_special_tokens = False  # [TOOL_CALLS] is a control token

    @staticmethod
    def _id() -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        content, _, rest = text.partition(self.start)
        calls = []
        if rest.lstrip().startswith(("[", "{")):  # the JSON array of older tokenizers
            try:
                value, _ = json.JSONDecoder().raw_decode(rest.strip())
            except ValueError:
                return text, []
            for item in value if isinstance(value, list) else [value]:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    return text, []
                calls.append(ToolCall(item["name"], json_arguments(item.get("arguments", {}))))
        else:  # name[ARGS]{...} per call (v11 and later)
            for piece in rest.split(self.start):
                name, sep, args = piece.partition("[ARGS]")
                if not sep:
                    brace = piece.find("{")
                    name, args = (piece, "{}") if brace < 0 else (piece[:brace], piece[brace:])
                try:
                    value, _ = json.JSONDecoder().raw_decode(args.strip() or "{}")
                except ValueError:
                    return text, []
                if not name.strip():
                    return text, []
                calls.append(ToolCall(name.strip(), json_arguments(value)))
        for call in calls:
            call.id = self._id()
        return (content if content.strip() else None), calls

    def stream_start(self, text: str) -> int | None:
        return held_back(text, (self.start,))


_LITERAL_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False}


def _literal(node):
    """A keyword argument's value: Python literals, and JSON's true/false/null."""
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:
        return _LITERAL_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)  # constants and signed numbers; anything else raises


class PythonicToolParser:
    name = "pythonic"
    skip_special_tokens = True

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or node.args:
                    return text, []
                name = ast.unparse(node.func)
                if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
                    return text, []
                args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return None, calls

    def stream_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if not stripped or stripped[0] == "[" else None


def _schema_types(schema) -> list[str]:
    if not isinstance(schema, dict):
        return ["string"]
    kind = schema.get("type")
    types = [kind] if isinstance(kind, str) else list(kind or [])
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            types += _schema_types(branch)
    return types or ["string"]


def coerce(value: str, schema) -> object:
    """A parameter's text as its schema's type: the first of the types that reads it (null,
    integer, number, boolean, object or array as JSON), else the string itself."""
    for kind in _schema_types(schema):
        stripped = value.strip()
        try:
            if kind == "null" and stripped.lower() == "null":
                return None
            if kind == "integer":
                return int(stripped)
            if kind == "number":
                number = float(stripped)
                if math.isfinite(number):
                    return int(number) if number.is_integer() else number
            if kind == "boolean" and stripped.lower() in ("true", "false", "1", "0"):
                return stripped.lower() in ("true", "1")
            if kind in ("object", "array"):
                return json.loads(stripped)
            if kind == "string":
                return value
        except ValueError:
            continue
    return value


class Qwen3XMLToolParser:
    name = "qwen3_xml"
    skip_special_tokens = False  # <tool_call> is a special token in Qwen's vocabulary
    markers = ("<tool_call>", "<function=")
    _call = re.compile(r"<function=([^>]*)>(.*?)(?:</function>|$)", re.DOTALL)
    _param = re.compile(
        r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))",
        re.DOTALL,
    )

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        start = held_back(text, self.markers)
        if start is None or not any(m in text for m in self.markers):
            return text, []
        schemas = {
            t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties", {})
            for t in tools or ()
        }
        calls = []
        for name, body in self._call.findall(text[start:]):
            name = name.strip()
            if not name:
                continue
            props = schemas.get(name, {})
            args = {}
            for key, value in self._param.findall(body):
                value = value.removeprefix("\n").removesuffix("\n")
                args[key.strip()] = (
                    coerce(value, props[key.strip()]) if key.strip() in props else value
                )
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def stream_start(self, text: str) -> int | None:
        return held_back(text, self.markers)


class Qwen3CoderToolParser(Qwen3XMLToolParser):
    name = "qwen3_coder"


class DeepSeekV3ToolParser:
    name = "deepseek_v3"
    skip_special_tokens = False
    begin = "<｜tool▁calls▁begin｜>"
    _call = re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n"
        r"(?P<args>.*?)\n```<｜tool▁call▁end｜>",
        re.DOTALL,
    )

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        if self.begin not in text:
            return text, []
        content = text[: text.index(self.begin)]
        calls = []
        for match in self._call.finditer(text):
            if match["type"].strip() != "function":
                return text, []
            calls.append(ToolCall(match["name"].strip(), match["args"]))
        if not calls:
            return text, []
        return (content if content.strip() else None), calls

    def stream_start(self, text: str) -> int | None:
        return held_back(text, (self.begin,))


MORE_TOOL_PARSERS = (
    MistralToolParser,
    PythonicToolParser,
    Qwen3XMLToolParser,
    Qwen3CoderToolParser,
    DeepSeekV3ToolParser,
)

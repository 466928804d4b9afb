"""Tool calls a model writes without its format's markers, under `tool_choice: auto`: a reply whose
whole text (trimmed) is one JSON object, or a list of them, each naming a function among the
request's tools with arguments valid against its JSON schema, or that same JSON in one fenced code
block (```json). Qwen2.5-Coder-0.5B-Instruct answers "What is the weather in Paris?" so, bare, where
its template teaches `<tool_call>` tags; vLLM's granite parser reads an unmarked list too.

`BareCalls(format, tools)` wraps a marker format's parser (the tools module's `Parser` protocol, so
the one scanner, `StreamParser`, still decides whole and streamed replies alike). A reply that may
still become such a call is one block, held back while it can; the moment it cannot (it is not
JSON, its first key is no call's, text follows it, a name is not among the tools, the arguments fail
the schema), its first character is content and the format's own parser reads the rest, exactly as
it would without this module. On by default for `DEFAULT_ON`'s formats (`tk serve --no-bare-tool-calls`
turns it off); llama3_json's own format is the bare object already, and pythonic's is not JSON.
"""

from __future__ import annotations

import json
import re

from tk.toolkit.serving.openai.tools import Parser, ToolCall, dumps

DEFAULT_ON = frozenset({"hermes", "granite"})  # the formats whose models write their calls bare
FORMATS = frozenset({"hermes", "mistral", "granite"})  # the marker formats it can wrap
_DECODER = json.JSONDecoder()
_FENCE = re.compile(r"```(?:json)?[ \t]*\n")
_FENCE_START = re.compile(r"`{1,2}|```(?:j(?:s(?:on?)?)?)?[ \t]*")  # what may still become a fence's first line
_LITERAL = re.compile(r"t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|-|u[0-9a-fA-F]{0,3}")  # (a \u escape's start too)
_NUMBER_TAIL = re.compile(r"\.|[eE][+-]?")
_FIRST_KEY = re.compile(r'\s*(?:\[\s*)?\{\s*"((?:[^"\\]|\\.)*)"')
_NOT_OBJECTS = re.compile(r"\s*\[\s*[^\s{]")  # a list that does not start with an object
_CALL_KEYS = ({"name", "arguments"}, {"name", "parameters"}, {"name"})
_OPEN = object()  # a JSON text not complete yet


def _json(text: str, i: int):
    """(value, end) of the JSON value at text[i]; _OPEN while some text after it could complete one;
    None when none can."""
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError as e:
        rest = text[e.pos:]
        if (e.pos >= len(text) or e.msg.startswith("Unterminated string") or _LITERAL.fullmatch(rest)
                or (_NUMBER_TAIL.fullmatch(rest) and text[e.pos - 1].isdigit())):
            return _OPEN
        return None
    except RecursionError:
        return None


def _validator(schema: dict | None):
    """A JSON-schema validator of a function's arguments (jsonschema's, the draft the schema names)."""
    from jsonschema.validators import validator_for

    schema = {"type": "object", **(schema or {})}
    return validator_for(schema)(schema)


class BareCalls(Parser):
    """A marker format's parser that also reads a reply made of nothing but JSON calls (module doc)."""

    def __init__(self, inner: Parser, tools: list[dict]):
        self.inner, self.name, self.args_key = inner, inner.name, inner.args_key
        self.markers = tuple(getattr(inner, "markers", ()))
        self.validators = {t["function"]["name"]: _validator(t["function"].get("parameters")) for t in tools}

    def next_block(self, text: str, first: bool, final: bool):
        if first:
            i = len(text) - len(text.lstrip())
            rest = text[i:]
            if not rest and not final:
                return 0, False  # blank so far: nothing is decided
            marked = any(m.startswith(rest) or rest.startswith(m) for m in self.markers)
            if rest and not marked and (rest[0] in "{[" or rest.startswith("```") or "```".startswith(rest)):
                return i, True
        return self.inner.next_block(text, first, final)

    def read_block(self, text: str, names: set[str], final: bool, memo: dict):
        if any(text.startswith(m) for m in self.markers):
            return self.inner.read_block(text, names, final, memo)
        got = self._bare(text, names, final)
        return (1, None) if got is False else got  # not a bare call: the format's parser reads on from here

    def _bare(self, text: str, names: set[str], final: bool):
        """(len(text), calls) where text is a bare call, None while it may still be one, False where not."""
        start = 0
        if text.startswith("`"):
            fence = _FENCE.match(text)
            if fence is None:
                return None if not final and _FENCE_START.fullmatch(text) else False
            start = fence.end()
        got = _json(text, start)
        if got is None or (got is _OPEN and final) or _NOT_OBJECTS.match(text, start):
            return False
        if got is _OPEN:
            key = _FIRST_KEY.match(text, start)
            return False if key is not None and key.group(1) not in ("name", "arguments", "parameters") else None
        value, end = got
        tail = text[end:].strip()
        if start:  # a fence closes after the JSON, and nothing follows it
            if not ("```".startswith(tail) if not final else tail == "```"):
                return False
        elif tail:
            return False
        calls = self._calls(value, names)
        if calls is None:
            return False
        return (len(text), calls) if final else None  # text may still follow

    def _calls(self, value, names: set[str]) -> list[ToolCall] | None:
        """The calls of a bare object or list of them, None unless every one is a call whose arguments
        validate against its function's schema."""
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or set(item) not in _CALL_KEYS or not isinstance(item["name"], str) \
                    or item["name"] not in names or item["name"] not in self.validators:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except (ValueError, RecursionError):
                    return None
            if not isinstance(args, dict) or not self._valid(item["name"], args):
                return None
            try:
                calls.append(ToolCall(item["name"], dumps(args)))
            except ValueError:  # NaN or Infinity
                return None
        return calls or None

    def _valid(self, name: str, args: dict) -> bool:
        try:
            return self.validators[name].is_valid(args)
        except Exception:  # noqa: BLE001: a client's schema jsonschema cannot apply (a $ref it cannot resolve, ...)
            return False

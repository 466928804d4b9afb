"""The tool-call formats of `tk serve`, by vLLM's `--tool-call-parser` names: how a model's reply says
which functions it calls, as its chat template taught it. Qwen, SmolLM3 and Hermes write a
`<tool_call>` block of JSON (`hermes`), Llama 3.1+ a bare `{"name", "parameters"}` object
(`llama3_json`), Mistral `[TOOL_CALLS]` and a JSON list (`mistral`), Granite 3 `<|tool_call|>` and
a JSON list (`granite`), small Llama 3.2/4 models a Python list of calls (`pythonic`), gpt-oss a
harmony message to `functions.NAME` in its commentary channel (`openai`). `detect` reads the format
off a chat template's source. The machinery they share (the parser protocol, the one scanner of
whole and streamed replies) is the tools module's.
"""

from __future__ import annotations

import ast
import json
import re

from tk.toolkit.serving.openai.tools import (Marked, Parser, ToolCall, as_call, as_calls, decode_json, dumps,
                                             lark_token, skip_ws)


class Hermes(Marked):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call (Qwen2.5,
    Qwen3, SmolLM3, Hermes). A last block left open (generation stopped) counts if its JSON is whole."""

    name, markers, close = "hermes", ("<tool_call>",), "</tool_call>"

    def read_block(self, text, names, final, memo):
        body = len(self.markers[0])
        end = text.find(self.close, body)
        if end < 0 and not final:
            return None
        body_text = text[body:end] if end >= 0 else text[body:]
        end = end + len(self.close) if end >= 0 else len(text)
        try:
            return end, (None if (c := as_call(json.loads(body_text), names)) is None else [c])
        except (ValueError, RecursionError):
            return end, None

    def grammar(self, call, parallel, specials):
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        block = f'{lark_token("<tool_call>", specials)} "\\n" call "\\n" {lark_token(self.close, specials)}'
        return f"{start}\nblock: {block}\ncall: %json {json.dumps(call)}\n"


class JsonList(Marked):
    """A marker and a JSON list of `{"name", "arguments"}`. A list that never completes runs to the end
    of the reply (it has no closing marker), and stays content."""

    def read_block(self, text, names, final, memo):
        i = skip_ws(text, len(next(m for m in self.markers if text.startswith(m))))
        got = decode_json(text, i, memo)
        if got is None:
            return (len(text), None) if final else None
        return got[1], as_calls(got[0], names)

    def grammar(self, call, parallel, specials):
        schema = {"x-guidance": call.pop("x-guidance"), "type": "array", "items": call, "minItems": 1,
                  **({} if parallel else {"maxItems": 1})}
        # The templates write a space after the marker (Mistral's "[TOOL_CALLS] ["): the model may.
        return f'start: {lark_token(self.markers[0], specials)} " "? calls\ncalls: %json {json.dumps(schema)}\n'


class Mistral(JsonList):
    """`[TOOL_CALLS] [{...}, ...]` (Mistral 7B v0.3, Nemo), or one call a marker as Mistral's newer
    tokenizers write them: `[TOOL_CALLS]name[ARGS]{...}` (`[CALL_ID]id` before `[ARGS]` allowed)."""

    name, markers = "mistral", ("[TOOL_CALLS]",)

    def read_block(self, text, names, final, memo):
        i = skip_ws(text, len(self.markers[0]))
        if i == len(text) or text[i] == "[":
            return super().read_block(text, names, final, memo) if i < len(text) or final else None
        k = text.find("[ARGS]", i)
        got = None if k < 0 else decode_json(text, skip_ws(text, k + len("[ARGS]")), memo)
        if got is None:
            return (len(text), None) if final else None
        call = as_call({"name": text[i:k].split("[CALL_ID]")[0].strip(), "arguments": got[0]}, names)
        return got[1], None if call is None else [call]


class Granite(JsonList):
    """`<|tool_call|>[{...}, ...]` (Granite 3.x; 3.1 also writes `<tool_call>` as text, as vLLM reads it)."""

    name, markers = "granite", ("<|tool_call|>", "<tool_call>")


class _AtStart(Parser):
    """Formats whose calls are the whole reply's beginning: the first non-blank text decides."""

    heads: tuple[str, ...]

    def next_block(self, text, first, final):
        if not first:  # past the beginning: the rest is content
            return len(text), False
        i = skip_ws(text, 0)
        if text.startswith(self.heads, i):
            return i, True
        if not final and any(h.startswith(text[i:]) for h in self.heads):
            return 0, False  # blank, or the beginning of a head
        return len(text), False


class Llama3Json(_AtStart):
    """`{"name": "f", "parameters": {...}}` opening the reply (Llama 3.1+; `<|python_tag|>` before it
    allowed), several separated by `;`. All of them are calls, or all of it is content."""

    name, heads, args_key = "llama3_json", ("{", "<|python_tag|>"), "parameters"

    def read_block(self, text, names, final, memo):
        i = len(self.heads[1]) if text.startswith(self.heads[1]) else 0
        calls, failed = [], (len(text), None)  # a failure ends the block anywhere: the rest is content too
        while True:
            i = skip_ws(text, i)
            if i == len(text):
                return ((i, calls) if calls else failed) if final else None
            if text[i] != "{":
                return failed
            got = decode_json(text, i, memo)
            if got is None:
                return failed if final else None
            if (call := as_call(got[0], names)) is None:
                return failed
            calls.append(call)
            i = skip_ws(text, got[1])
            if i == len(text) and not final:
                return None  # a `;` and another call may follow
            if i == len(text) or text[i] != ";":
                return got[1], calls
            i += 1

    def grammar(self, call, parallel, specials):
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return f"{start}\ncall: %json {json.dumps(call)}\n"


class Pythonic(_AtStart):
    """`[f(a=1, b="x"), g()]` as the whole reply (Llama 3.2 and 4's small models): Python literals
    only, read with `ast`, never run. No grammar (Python syntax is not JSON)."""

    name, heads = "pythonic", ("[",)
    _head = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
    _head_start = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")  # what may still become a head

    def read_block(self, text, names, final, memo):
        if not (self._head.match(text) or self._head_start.fullmatch(text)):
            return len(text), None
        return (len(text), _pythonic(text, names)) if final else None


def _pythonic(text: str, names: set[str]) -> list[ToolCall] | None:
    try:
        tree = ast.parse(text.rstrip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
                and not node.args and all(kw.arg for kw in node.keywords)):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(ToolCall(node.func.id, dumps(args)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # not a literal, or not JSON
            return None
    return calls


class Harmony(Marked):
    """gpt-oss's calls (harmony): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
    one message a call, its JSON object the arguments. The reasoning module's harmony reader hands a
    call message over in this form whatever the order its header was written in (`to=` before or
    after the channel), and one that ended with the reply (`<|call|>` is an EOS of gpt-oss) closed.
    One call a turn, as gpt-oss's template renders them (its grammar forces one)."""

    name, markers, ends = "openai", ("<|channel|>commentary to=",), ("<|call|>", "<|end|>", "<|return|>", "<|start|>")
    names_outside = True  # the function's name is in the header, outside the JSON (tool_grammar)
    tokens = ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|end|>", "<|return|>", "<|start|>")

    def read_block(self, text, names, final, memo):
        head = text.find("<|message|>")
        ends = [i for i in (text.find(e, max(head, 0)) for e in self.ends) if i >= 0] if head >= 0 else []
        if not ends and not final:
            return None
        end = min(ends) if ends else len(text)
        recipient = (text[len(self.markers[0]):head].split("<|")[0].split() or [""])[0] if head >= 0 else ""
        stop = end + len("<|call|>") if text.startswith("<|call|>", end) else end  # (<|start|> opens the next)
        if head < 0 or not recipient.startswith("functions."):
            return stop, None
        try:
            args = json.loads(text[head + len("<|message|>"):end])
        except (ValueError, RecursionError):
            return stop, None
        call = as_call({"name": recipient[len("functions."):], "arguments": args}, names)
        return stop, None if call is None else [call]

    def grammar_of(self, functions: list[tuple[str, dict]], specials: dict[str, int]) -> str:
        """The grammar of one call of any of `functions` ((name, arguments schema), each its own root)."""
        branches = [f'{lark_token("<|channel|>", specials)} {json.dumps(f"commentary to=functions.{name} ")} '
                    f'{lark_token("<|constrain|>", specials)} "json" {lark_token("<|message|>", specials)} args{i}'
                    for i, (name, _) in enumerate(functions)]
        args = "".join(f"args{i}: %json {json.dumps(schema)}\n" for i, (_, schema) in enumerate(functions))
        return "start: " + " | ".join(branches) + "\n" + args


PARSERS: dict[str, Parser] = {p.name: p for p in (Hermes(), Llama3Json(), Mistral(), Granite(), Pythonic(),
                                                  Harmony())}
# Formats tk knows by their signs but does not read (a request with tools is a 400 that names it):
# Qwen3.5's and Qwen3-Coder's XML calls (`<function=NAME>` and `<parameter=...>` inside `<tool_call>`).
UNREAD = {"qwen3_coder"}

# What a template's source shows of its format, first match wins: the marker formats before Llama's
# (Hermes 3 is a Llama with `<tool_call>`; vLLM's Llama 3.2 pythonic template keeps `ipython`); XML
# calls before hermes (their `<tool_call>` holds no JSON).
_SIGNS = (("openai", ("<|channel|>commentary",)), ("mistral", ("[TOOL_CALLS]",)), ("granite", ("<|tool_call|>",)),
          ("qwen3_coder", ("<function=",)), ("hermes", ("<tool_call>",)), ("pythonic", ("[func_name1(",)),
          ("llama3_json", ("<|python_tag|>",)))


def detect(template: str) -> str | None:
    """The format a chat template's source implies, None where it shows no tool-call format."""
    found = next((name for name, signs in _SIGNS if any(s in template for s in signs)), None)
    if found is None and '"parameters"' in template and "ipython" in template:  # Llama 3.2 lacks the tag
        return "llama3_json"
    return found

"""Tool calling's text side for `tk serve`: what a model's reply says about the functions it calls,
in the formats of vLLM's `--tool-call-parser` names, and the grammars that make a reply a call.

A model calls a tool by writing text its chat template taught it: Qwen, SmolLM3 and Hermes a
`<tool_call>` block of JSON (`hermes`), Llama 3.1+ a bare `{"name", "parameters"}` object
(`llama3_json`), Mistral `[TOOL_CALLS]` and a JSON list (`mistral`), Granite 3 `<|tool_call|>` and
a JSON list (`granite`), small Llama 3.2/4 models a Python list of calls (`pythonic`). `detect`
reads the format off a chat template's source. A parser splits a reply into its content and its
calls; a block that is not a well-formed call of a function the request offered stays in the
content as written, so that nothing the model said is lost and model output never raises.

One scanner does both non-streaming and streaming (`StreamParser`): a format only says where a
block may start and, given more text, where it ends and what it calls. Everything it decides holds
whatever text follows, so a reply split into any pieces gives the same content and calls as the
whole (the tests check every split). Content streams as it comes, except a tail that could begin a
call marker, whitespace that `strip()` could still remove, and call blocks until they end.

Each format also writes its piece of the grammar that forces a call (`Parser.grammar`); the
tool_grammar module puts the functions' schemas into it. No web framework here.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
# llguidance's JSON options inside each %json: no free whitespace (a weak model would pad until its
# token budget runs out), Python's separators (what templates' `tojson` and the models write).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text of an object (`dumps`)."""

    name: str
    arguments: str

    def openai(self, id: str) -> dict:
        return {"id": id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """A whole reply: its content (None: nothing but calls or blanks) and its calls, in order."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    """A streamed piece: content text, or one finished call."""

    content: str | None = None
    call: ToolCall | None = None


def dumps(value) -> str:
    """Arguments as the API returns them (as vLLM does: Python's separators, UTF-8 as is, no NaN)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def tool_names(tools: list[dict]) -> set[str]:
    return {t["function"]["name"] for t in tools}


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _decode(text: str, i: int, memo: dict):
    """(value, end) of the JSON array or object at text[i]; None while incomplete or not JSON. Only
    arrays and objects: they end at a bracket, so a complete one stays complete as text follows, and
    one that was incomplete at `memo[i]` characters needs a bracket after them: without `memo`, the
    growing text of a long reply would be decoded again at every piece, O(n^2)."""
    known = memo.get(i)
    if known is None or isinstance(known, int) and (text.find("}", known) >= 0 or text.find("]", known) >= 0):
        if i >= len(text) or text[i] not in "[{":
            return None
        try:
            known = memo[i] = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            known = memo[i] = len(text)
    return known if isinstance(known, tuple) else None


def _call(obj, names: set[str]) -> ToolCall | None:
    """The call a `{"name", "arguments"}` object makes (`parameters` too, as Llama writes; arguments
    may be JSON text of an object; none: no arguments), None unless it calls one of `names`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    try:
        return ToolCall(obj["name"], dumps(args))
    except ValueError:  # NaN or Infinity, which JSON has no text for
        return None


def _calls(items, names: set[str]) -> list[ToolCall] | None:
    """A JSON list's calls; None unless every item is a call (the block then stays content)."""
    calls = [_call(item, names) for item in items] if isinstance(items, list) and items else [None]
    return None if None in calls else calls


def _token(text: str, specials: dict[str, int]) -> str:
    """A marker in Lark: the token where it is one special token (it has no text to match), else the text."""
    return f"<[{specials[text]}]>" if text in specials else json.dumps(text)


class Parser:
    """A format, over the reply's text not yet decided. `next_block(text, first, final)` -> (n, found):
    text[:n] is content whatever follows, and a call block starts at n if `found`. `read_block(text,
    names, final, memo)`, text starting with a block -> (end, its calls, or None where it is not a call),
    or None while undecided. `first`: nothing of the reply is decided yet; `final`: no more text comes,
    and then both decide; `memo`: a dict kept for the block while it is open (`_decode`'s)."""

    args_key = "arguments"

    def parse(self, text: str, names: set[str]) -> Parsed:
        stream = StreamParser(self, names)
        deltas = stream.feed(text) + stream.finish()
        return Parsed("".join(d.content for d in deltas if d.content) or None, [d.call for d in deltas if d.call])

    def grammar(self, call: dict, parallel: bool, specials: dict[str, int]) -> str:
        raise ValueError(f"the {self.name} format has no grammar: tk serve cannot force its calls; "
                         "use tool_choice \"auto\" or \"none\"")


class _Marked(Parser):
    """Formats whose calls start at a marker, anywhere in the reply."""

    markers: tuple[str, ...]

    def next_block(self, text: str, first: bool, final: bool):
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:  # (granite's two markers cannot begin inside each other: the first found is the first)
            return min(found), True
        for n in range(0 if final else min(max(map(len, self.markers)) - 1, len(text)), 0, -1):
            if any(m.startswith(text[-n:]) for m in self.markers):
                return len(text) - n, False  # hold back what may begin a marker
        return len(text), False


class Hermes(_Marked):
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
            return end, (None if (c := _call(json.loads(body_text), names)) is None else [c])
        except (ValueError, RecursionError):
            return end, None

    def grammar(self, call, parallel, specials):
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        block = f'{_token("<tool_call>", specials)} "\\n" call "\\n" {_token(self.close, specials)}'
        return f"{start}\nblock: {block}\ncall: %json {json.dumps(call)}\n"


class _JsonList(_Marked):
    """A marker and a JSON list of `{"name", "arguments"}`. A list that never completes runs to the end
    of the reply (it has no closing marker), and stays content."""

    def read_block(self, text, names, final, memo):
        i = _skip_ws(text, len(next(m for m in self.markers if text.startswith(m))))
        got = _decode(text, i, memo)
        if got is None:
            return (len(text), None) if final else None
        return got[1], _calls(got[0], names)

    def grammar(self, call, parallel, specials):
        schema = {"x-guidance": call.pop("x-guidance"), "type": "array", "items": call, "minItems": 1,
                  **({} if parallel else {"maxItems": 1})}
        # The templates write a space after the marker (Mistral's "[TOOL_CALLS] ["): the model may.
        return f'start: {_token(self.markers[0], specials)} " "? calls\ncalls: %json {json.dumps(schema)}\n'


class Mistral(_JsonList):
    """`[TOOL_CALLS] [{...}, ...]` (Mistral 7B v0.3, Nemo), or one call a marker as Mistral's newer
    tokenizers write them: `[TOOL_CALLS]name[ARGS]{...}` (`[CALL_ID]id` before `[ARGS]` allowed)."""

    name, markers = "mistral", ("[TOOL_CALLS]",)

    def read_block(self, text, names, final, memo):
        i = _skip_ws(text, len(self.markers[0]))
        if i == len(text) or text[i] == "[":
            return super().read_block(text, names, final, memo) if i < len(text) or final else None
        k = text.find("[ARGS]", i)
        got = None if k < 0 else _decode(text, _skip_ws(text, k + len("[ARGS]")), memo)
        if got is None:
            return (len(text), None) if final else None
        call = _call({"name": text[i:k].split("[CALL_ID]")[0].strip(), "arguments": got[0]}, names)
        return got[1], None if call is None else [call]


class Granite(_JsonList):
    """`<|tool_call|>[{...}, ...]` (Granite 3.x; 3.1 also writes `<tool_call>` as text, as vLLM reads it)."""

    name, markers = "granite", ("<|tool_call|>", "<tool_call>")


class _AtStart(Parser):
    """Formats whose calls are the whole reply's beginning: the first non-blank text decides."""

    heads: tuple[str, ...]

    def next_block(self, text, first, final):
        if not first:  # past the beginning: the rest is content
            return len(text), False
        i = _skip_ws(text, 0)
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
            i = _skip_ws(text, i)
            if i == len(text):
                return ((i, calls) if calls else failed) if final else None
            if text[i] != "{":
                return failed
            got = _decode(text, i, memo)
            if got is None:
                return failed if final else None
            if (call := _call(got[0], names)) is None:
                return failed
            calls.append(call)
            i = _skip_ws(text, got[1])
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


PARSERS: dict[str, Parser] = {p.name: p for p in (Hermes(), Llama3Json(), Mistral(), Granite(), Pythonic())}

# What a template's source shows of its format, first match wins: the marker formats before Llama's
# (Hermes 3 is a Llama with `<tool_call>`; vLLM's Llama 3.2 pythonic template keeps `ipython`).
_SIGNS = (("mistral", ("[TOOL_CALLS]",)), ("granite", ("<|tool_call|>",)), ("hermes", ("<tool_call>",)),
          ("pythonic", ("[func_name1(",)), ("llama3_json", ("<|python_tag|>",)))


def detect(template: str) -> str | None:
    """The parser a chat template's source implies, None where it shows no tool-call format."""
    found = next((name for name, signs in _SIGNS if any(s in template for s in signs)), None)
    if found is None and '"parameters"' in template and "ipython" in template:  # Llama 3.2 lacks the tag
        return "llama3_json"
    return found


class StreamParser:
    """A reply's content and calls as its text arrives: `feed(piece)` and, at the end, `finish()`
    give deltas whose content joins to `parse(text).content or ""` and whose calls are its calls."""

    def __init__(self, parser: Parser, names: set[str]):
        self.parser, self.names = parser, set(names)
        self.text, self.first, self.open = "", True, False  # undecided text; nothing decided yet; text opens a block
        self.memo: dict = {}  # an open block's, for its parser
        self.leading, self.blank = True, ""  # content's whitespace: none emitted yet; a run held back

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        return self._scan(final=False)

    def finish(self) -> list[Delta]:
        out = self._scan(final=True)
        self.blank = ""  # trailing whitespace: strip() drops it
        return out

    def _scan(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if not self.open:
                n, self.open = self.parser.next_block(self.text, self.first, final)
                self._decided(n, out)
                if not self.open:
                    return out
            got = self.parser.read_block(self.text, self.names, final, self.memo)
            if got is None:
                return out
            self.memo = {}
            end, calls = got
            out += [Delta(call=c) for c in calls or ()]
            self._decided(end, out, content=calls is None)
            self.open = False

    def _decided(self, n: int, out: list[Delta], content: bool = True) -> None:
        """text[:n] is decided: content (or a call block's, when not `content`)."""
        if content:
            self._content(self.text[:n], out)
        self.text, self.first = self.text[n:], self.first and n == 0

    def _content(self, text: str, out: list[Delta]) -> None:
        """Content as `.strip()` leaves it: no leading whitespace, a whitespace run only once text follows."""
        if self.leading:
            text = text.lstrip()
            self.leading = not text
        text = self.blank + text
        kept = text.rstrip()
        self.blank = text[len(kept):]
        if kept:
            out.append(Delta(content=kept))

"""Tool calling's text side for `tk serve`, the machinery every format shares: a call (`ToolCall`),
what a reply parses into (`Parsed`, `Delta`), the parser protocol (`Parser`, `Marked` for formats
whose calls start at a marker) and the one scanner that reads whole and streamed replies alike
(`StreamParser`). The formats themselves (vLLM's `--tool-call-parser` names) are the tool_formats
module's.

A parser splits a reply into its content and its calls; a block that is not a well-formed call of a
function the request offered stays in the content as written, so that nothing the model said is
lost and model output never raises. A format only says where a block may start and, given more
text, where it ends and what it calls. Everything it decides holds whatever text follows, so a
reply split into any pieces gives the same content and calls as the whole (the tests check every
split). Content streams as it comes, except a tail that could begin a call marker (`held`),
whitespace that `strip()` could still remove (`Trim`), and call blocks until they end.

Each format also writes its piece of the grammar that forces a call (`Parser.grammar`); the
tool_grammar module puts the functions' schemas into it. No web framework here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
# llguidance's JSON options inside each %json: no free whitespace (a weak model would pad until its
# token budget runs out), Python's separators (what templates' `tojson` and the models write).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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
    """A streamed piece: content text, one finished call, or reasoning text (the reasoning module's)."""

    content: str | None = None
    call: ToolCall | None = None
    reasoning: str | None = None


def dumps(value) -> str:
    """Arguments as the API returns them (as vLLM does: Python's separators, UTF-8 as is, no NaN)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def tool_names(tools: list[dict]) -> set[str]:
    return {t["function"]["name"] for t in tools}


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def decode_json(text: str, i: int, memo: dict):
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


def as_call(obj, names: set[str]) -> ToolCall | None:
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


def as_calls(items, names: set[str]) -> list[ToolCall] | None:
    """A JSON list's calls; None unless every item is a call (the block then stays content)."""
    calls = [as_call(item, names) for item in items] if isinstance(items, list) and items else [None]
    return None if None in calls else calls


def lark_token(text: str, specials: dict[str, int]) -> str:
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


class Marked(Parser):
    """Formats whose calls start at a marker, anywhere in the reply."""

    markers: tuple[str, ...]

    def next_block(self, text: str, first: bool, final: bool):
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:  # (granite's two markers cannot begin inside each other: the first found is the first)
            return min(found), True
        return held(text, self.markers, final), False


def held(text: str, markers, final: bool) -> int:
    """How much of `text` (which holds none of `markers`) is decided: all of it but a tail that may
    begin a marker (none once `final`)."""
    for n in range(0 if final else min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return len(text) - n
    return len(text)


class StreamParser:
    """A reply's content and calls as its text arrives: `feed(piece)` and, at the end, `finish()`
    give deltas whose content joins to `parse(text).content or ""` and whose calls are its calls."""

    def __init__(self, parser: Parser, names: set[str]):
        self.parser, self.names = parser, set(names)
        self.text, self.first, self.open = "", True, False  # undecided text; nothing decided yet; text opens a block
        self.memo: dict = {}  # an open block's, for its parser
        self.trim = Trim()

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        return self._scan(final=False)

    def finish(self) -> list[Delta]:
        return self._scan(final=True)  # (trailing whitespace stays held: strip() drops it)

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
        if kept := self.trim(text):
            out.append(Delta(content=kept))


class Trim:
    """Text as `.strip()` leaves it, as it arrives: `trim(piece)` -> what can be shown (no leading
    whitespace; a whitespace run only once text follows it). What is still held at the end is the
    trailing whitespace strip() drops."""

    def __init__(self):
        self.leading, self.blank = True, ""  # none shown yet; a whitespace run held back

    def __call__(self, text: str) -> str:
        if self.leading:
            text = text.lstrip()
            self.leading = not text
        text = self.blank + text
        kept = text.rstrip()
        self.blank = text[len(kept):]
        return kept

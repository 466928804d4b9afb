"""Reasoning in `tk serve`'s chat replies, as vLLM serves it (`--reasoning-parser`): what a model
thinks comes back as `reasoning_content`, apart from `content`, whole (`message.reasoning_content`)
and streamed (`delta.reasoning_content`), never mixed into the content.

Parsers, by vLLM's names:
- `qwen3`: a `<think>...</think>` block at the reply's start (Qwen3, Qwen3.5, QwQ and the templates
  that write one); a reply that opens none is content. Where the chat template opened the block
  itself (Qwen3.5 and the thinking Qwen3s end their generation prompt with `<think>\\n`), the reply
  begins inside it; where it closed an empty one (`enable_thinking: false`), the reply is content.
- `deepseek_r1`: the same, except that a reply is reasoning until `</think>` whether or not it opens
  the block (DeepSeek-R1 and its distills often leave the `<think>` out).
- `openai_gptoss`: gpt-oss's harmony messages (the harmony module): the analysis channel is
  reasoning, the final channel content, a commentary message to `functions.NAME` a tool call.

`detect` picks one from the chat template's source (harmony's `<|channel|>`, DeepSeek's
`<｜Assistant｜>` with `<think>`, else `<think>`); `tk serve --reasoning-parser none` turns it off.
A reply's reasoning is read first and the rest goes on to tool calling (`ReplyStream`: the tools
module's scanner, for the request's functions), so reasoning is never read for calls, and the
model's own words about calling stay its reasoning. As with tool calls, one code path reads whole
and streamed replies: a whole reply is the stream fed once, so the two cannot disagree (the tests
feed every split). No web framework here.
"""

from __future__ import annotations

from tk.models.spec.errors import UsageProblem
from tk.toolkit.serving.openai import tool_grammar
from tk.toolkit.serving.openai.harmony import TOKENS as HARMONY_TOKENS, HarmonyStream
from tk.toolkit.serving.openai.tools import Delta, StreamParser, ToolCall, Trim, held

OPEN, CLOSE = "<think>", "</think>"
TAIL_TOKENS = 32  # the prompt's last tokens, read for a block the template opened


class ThinkStream:
    """One reply's `<think>` block as its text arrives (module doc): `feed(piece, final)` -> deltas
    of reasoning and of the rest (content, still to be read for calls)."""

    def __init__(self, always: bool, prompt_tail: str = ""):
        self.always, self.text, self.trim = always, "", Trim()
        self.state = "think" if prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE) else "start"
        self.after = False  # past a closed block: whitespace before the content is dropped

    def feed(self, piece: str, final: bool) -> list[Delta]:
        self.text += piece
        out: list[Delta] = []
        if self.state == "start":
            rest = self.text.lstrip()
            if rest.startswith(OPEN):
                self.text, self.state = rest[len(OPEN):], "think"
            elif not final and OPEN.startswith(rest):
                return out  # blank so far, or the beginning of <think>
            else:
                self.state = "think" if self.always else "content"
        if self.state == "think":
            at = self.text.find(CLOSE)
            n = at if at >= 0 else held(self.text, (CLOSE,), final)
            if kept := self.trim(self.text[:n]):
                out.append(Delta(reasoning=kept))
            self.text = self.text[n + len(CLOSE):] if at >= 0 else self.text[n:]
            if at < 0:
                return out
            self.state, self.after = "content", True
        text, self.text = self.text, ""
        if self.after:
            text = text.lstrip()
            self.after = not text
        return out + ([Delta(content=text)] if text else [])


class Think:
    """`qwen3` and `deepseek_r1` (`always`: reasoning until `</think>`, opened or not)."""

    tokens = (OPEN, CLOSE)

    def __init__(self, name: str, always: bool):
        self.name, self.always = name, always

    def stream(self, prompt_tail: str) -> ThinkStream:
        return ThinkStream(self.always, prompt_tail)


class Harmony:
    name, tokens = "openai_gptoss", HARMONY_TOKENS

    def stream(self, prompt_tail: str) -> HarmonyStream:
        return HarmonyStream(prompt_tail)


PARSERS = {p.name: p for p in (Think("qwen3", False), Think("deepseek_r1", True), Harmony())}


def detect(template: str) -> str | None:
    """The reasoning parser a chat template's source implies, None where it shows none."""
    if "<|channel|>" in template:
        return "openai_gptoss"
    if OPEN in template or CLOSE in template:
        return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"
    return None


class ReplyStream:
    """One chat reply read as it arrives: its reasoning (None: the server reads none), then its calls
    (`tools`: the request's StreamParser, None: its text is content). `feed(piece)` and `finish()`
    give deltas of reasoning, content and calls; `parallel` False keeps the first call only."""

    def __init__(self, reasoning, tools: StreamParser | None, parallel: bool = True):
        self.reasoning, self.tools, self.parallel, self.calls = reasoning, tools, parallel, 0

    def feed(self, piece: str) -> list[Delta]:
        return self._read(piece, False)

    def finish(self) -> list[Delta]:
        return self._read("", True)

    def _read(self, piece: str, final: bool) -> list[Delta]:
        deltas = self.reasoning.feed(piece, final) if self.reasoning is not None else [Delta(content=piece)]
        out: list[Delta] = []
        for d in deltas:
            if d.content is None or self.tools is None:
                out += [d] if d.content or d.reasoning else []
            else:
                out += self.tools.feed(d.content)
        out += self.tools.finish() if final and self.tools is not None else []
        kept = []
        for d in out:
            if d.call is not None:
                if self.calls and not self.parallel:
                    continue
                self.calls += 1
            kept.append(d)
        return kept

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a whole reply: the stream fed once (None: there is none)."""
        deltas = self.feed(text) + self.finish()
        return ("".join(d.reasoning for d in deltas if d.reasoning) or None,
                "".join(d.content for d in deltas if d.content) or None, [d.call for d in deltas if d.call])


class Reasoning:
    """A server's reasoning parser: `name` (tk serve --reasoning-parser; None: the chat template's;
    "none": off), whether its markers need special tokens kept in the text, and each reply's stream."""

    def __init__(self, tokenizer, name: str | None = None):
        template = tokenizer.hf.chat_template if tokenizer is not None else None
        template = template if isinstance(template, str) else ""
        if name not in (None, "none", *PARSERS):
            raise UsageProblem(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}, none")
        self.name = None if name == "none" else name or detect(template)
        self.parser = PARSERS.get(self.name) if self.name else None
        self.tokenizer = tokenizer
        specials = tool_grammar.specials_of(tokenizer.hf) if self.parser is not None else {}
        self.keep_special = self.parser is not None and tool_grammar.loses(tokenizer, specials, self.parser.tokens)

    def thinks_first(self, prompt_ids: list[int]) -> bool:
        """Whether a reply after `prompt_ids` is read as reasoning from its first token (the template
        opened a `<think>` block, or deepseek_r1): a grammar there would hold the reasoning, not the answer."""
        if not isinstance(self.parser, Think):
            return False
        return self.parser.always or self.parser.stream(self._tail(prompt_ids)).state == "think"

    def _tail(self, prompt_ids: list[int]) -> str:
        return self.tokenizer.decode(prompt_ids[-TAIL_TOKENS:], False)

    def stream(self, calls, prompt_ids: list[int]) -> ReplyStream | None:
        """A chat reply's reader after `prompt_ids` (None: its text is content as it is), with the
        request's tool calling (`calls`: the calling module's Calls, or None)."""
        tools = calls.stream() if calls is not None else None
        parallel = calls.parallel if calls is not None else True
        if self.parser is None:
            return None if tools is None else ReplyStream(None, tools, parallel)
        return ReplyStream(self.parser.stream(self._tail(prompt_ids)), tools, parallel)

"""toolkit/serving/openai/bare_calls.py: tool calls a model writes without its format's tags (issue 46;
Qwen2.5-Coder-0.5B answers a weather question with a bare `{"name": ..., "arguments": ...}`). A reply
that is nothing but JSON calls of the tools, valid against their schemas (or that JSON in one fenced
block), is calls; anything else stays content as the format's own parser reads it; streamed over
every split equals whole, and text streams as soon as it can no longer become a call."""

from __future__ import annotations

import pytest

from tk.toolkit.serving.openai.bare_calls import BareCalls
from tk.toolkit.serving.openai.tool_formats import PARSERS
from tk.toolkit.serving.openai.tools import StreamParser, ToolCall

pytest.importorskip("jsonschema", reason="the serve extra: pip install -e '.[serve]'")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: any object
]
NAMES = {t["function"]["name"] for t in TOOLS}
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
A = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
PARIS, ADD = ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("add", '{"a": 2, "b": 3}')
ALL = ...  # the whole reply stays content (stripped)

CASES = [  # (format, reply, content, calls)
    ("hermes", W, None, [PARIS]),
    ("hermes", f"\n  {W}\n", None, [PARIS]),
    ("hermes", f"```json\n{W}\n```", None, [PARIS]),
    ("hermes", f"```\n{W}\n```\n", None, [PARIS]),
    ("hermes", f"[{W}, {A}]", None, [PARIS, ADD]),
    ("hermes", '{"name": "add", "parameters": {"a": 2, "b": 3}}', None, [ADD]),  # Llama's key
    ("hermes", '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None, [PARIS]),
    ("hermes", '{"name": "get_time", "arguments": {"anything": [1]}}', None, [ToolCall("get_time", '{"anything": [1]}')]),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Rome"}}', ALL, []),  # fails its schema
    ("hermes", '{"name": "add", "arguments": {"a": "2", "b": 3}}', ALL, []),
    ("hermes", '{"name": "rm_rf", "arguments": {}}', ALL, []),  # names no tool
    ("hermes", '{"name": "add", "arguments": {"a": 2, "b": 3}, "id": 1}', ALL, []),  # not a call's keys
    ("hermes", '{"answer": 42}', ALL, []),
    ("hermes", f"[{W}, 7]", ALL, []),  # all of them calls, or none
    ("hermes", f"{W} Done.", ALL, []),  # text after it: an answer that quotes a call
    ("hermes", f"Here: {W}", ALL, []),
    ("hermes", f"```json\n{W}\n``` and more", ALL, []),
    ("hermes", f"```python\nprint(1)\n```", ALL, []),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Par', ALL, []),  # cut by max_tokens
    ("hermes", "[1] see the note", ALL, []),
    ("hermes", f'{{"a": 1}} <tool_call>\n{A}\n</tool_call>', '{"a": 1}', [ADD]),  # the format's own parser reads on
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", None, [PARIS]),  # the tagged form as before
    ("granite", f"[{W}]", None, [PARIS]),
    ("granite", f"<|tool_call|>[{A}]", None, [ADD]),
    ("mistral", f"[{W}]", None, [PARIS]),  # where it is turned on
    ("mistral", f"[TOOL_CALLS] [{A}]", None, [ADD]),
]


def _parser(fmt: str) -> BareCalls:
    return BareCalls(PARSERS[fmt], TOOLS)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_a_bare_call_is_a_call_and_anything_else_content(fmt, text, content, calls):
    parsed = _parser(fmt).parse(text, NAMES)
    assert (parsed.content, parsed.calls) == (text.strip() if content is ALL else content, calls)


@pytest.mark.parametrize("fmt, text", [(f, t) for f, t, _, _ in CASES])
def test_streamed_over_every_split_equals_whole(fmt, text):
    parser = _parser(fmt)
    whole = parser.parse(text, NAMES)
    for k in range(len(text) + 1):
        stream = StreamParser(parser, NAMES)
        deltas = stream.feed(text[:k]) + stream.feed(text[k:]) + stream.finish()
        assert ("".join(d.content for d in deltas if d.content) or None, [d.call for d in deltas if d.call]) == \
            (whole.content, whole.calls), k


@pytest.mark.parametrize("text, shown_by", [
    ('{"answer": 42, "more": "text text text"}', len('{"answer"')),  # its first key is no call's
    ("[1, 2, 3] are the numbers", len("[1")),
    ("```python\nprint(1)", len("```p")),
    ('{"a": 1} then words', len('{"a": 1} t')),
    ("Hello there", 1),
])
def test_text_streams_once_it_cannot_become_a_call(text, shown_by):
    """Held back only while it may still become a call: a character at a time, the first content
    comes out by the character that rules a call out."""
    stream = StreamParser(_parser("hermes"), NAMES)
    first = next((k for k in range(len(text)) if any(d.content for d in stream.feed(text[k]))), None)
    assert first is not None and first < shown_by, first


def test_a_bare_call_is_held_whole_until_the_reply_ends():
    stream = StreamParser(_parser("hermes"), NAMES)
    assert [d for ch in W for d in stream.feed(ch)] == [] and [d.call for d in stream.finish()] == [PARIS]


def test_which_formats_read_bare_calls_and_the_switch(tiny, tmp_path):
    """On by default for hermes and granite (their models write calls bare), off for the rest; tk serve
    --no-bare-tool-calls turns it off, --bare-tool-calls on for the marker formats."""
    import shutil

    from chat import TOOLS_TEMPLATE, add_chat_template
    from tk.toolkit.serving.openai.calling import ToolCalling
    from tk.toolkit.serving.openai.reasoning import ReplyStream
    from tk.toolkit.serving.openai.schemas import schemas
    from tk.toolkit.textgen import Tokenizer

    shutil.copytree(tiny, tmp_path / "ckpt")
    tokenizer = Tokenizer(add_chat_template(tmp_path / "ckpt", template=TOOLS_TEMPLATE))
    body = schemas("tiny", 512, 128).Chat.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                          "tools": TOOLS})
    def calls(c) -> list:  # a whole reply's, as the server reads it
        return ReplyStream(None, c.stream(), c.parallel).whole(W)[2] if c.parser is not None else []

    reads = {(fmt, bare): calls(ToolCalling(tokenizer, fmt, bare).request(body)) != []
             for fmt in PARSERS for bare in (None, True, False)}
    assert {k for k, v in reads.items() if v} == {("hermes", None), ("granite", None), ("hermes", True),
                                                  ("granite", True), ("mistral", True), ("llama3_json", None),
                                                  ("llama3_json", True), ("llama3_json", False)}
    # (llama3_json's own format is the bare object: its parser reads it whatever the switch says)
    required = body.model_copy(update={"tool_choice": "required"})
    assert not calls(ToolCalling(tokenizer, "hermes").request(required))  # auto only

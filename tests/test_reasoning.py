"""toolkit/serving/openai/reasoning.py and harmony.py: reasoning read apart from content and calls
(Qwen3's `<think>`, DeepSeek-R1's, gpt-oss's harmony channels) on typical replies, streamed against
whole over every split; tk's harmony reader against openai-harmony's own parser on the same replies;
gpt-oss's chat template (transformers' rendering, which tk uses) against openai-harmony's rendering
of the same conversations; and detection on the real templates (tests/fixtures/templates)."""

from __future__ import annotations

import datetime
import json

import pytest

from reasoning_models import template
from tk.toolkit.serving.openai import reasoning
from tk.toolkit.serving.openai.reasoning import PARSERS, ReplyStream
from tk.toolkit.serving.openai.tool_formats import PARSERS as FORMATS, detect
from tk.toolkit.serving.openai.tools import StreamParser, ToolCall

NAMES = {"get_weather", "get_time"}
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
QWEN = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"  # a prompt's tail, as the templates end it
OPENED = QWEN + "<think>\n"  # Qwen3.5's (and thinking Qwen3s'): the template opens the block
CLOSED = QWEN + "<think>\n\n</think>\n\n"  # enable_thinking: false
HARMONY = "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>"
HCALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'

# (parser, prompt tail, tool format or None, reply, reasoning, content, calls)
CASES = [
    ("qwen3", QWEN, None, "<think>\nThe user asks.\n</think>\n\nIt is sunny.", "The user asks.", "It is sunny.", []),
    ("qwen3", OPENED, None, "The user asks.\n</think>\n\nIt is sunny.", "The user asks.", "It is sunny.", []),
    ("qwen3", CLOSED, None, "It is sunny.", None, "It is sunny.", []),
    ("qwen3", QWEN, None, "It is sunny, <think> said as text.", None, "It is sunny, <think> said as text.", []),
    ("qwen3", QWEN, None, "<think>\nStill thinking when cut", "Still thinking when cut", None, []),
    ("qwen3", OPENED, None, "</think>\n\nNo thought.", None, "No thought.", []),
    ("qwen3", QWEN, "hermes", f"<think>\nCall get_weather.\n</think>\n\n{CALL}", "Call get_weather.", None, [PARIS]),
    ("qwen3", OPENED, "hermes", f"I'll call <tool_call> then.\n</think>\n\nChecking.\n{CALL}",
     "I'll call <tool_call> then.", "Checking.", [PARIS]),  # reasoning is never read for calls
    ("deepseek_r1", "<｜Assistant｜>", None, "Thinking first.</think>The answer.", "Thinking first.", "The answer.", []),
    ("deepseek_r1", "<｜Assistant｜>", None, "<think>\nA.\n</think>\n\nB.", "A.", "B.", []),
    ("deepseek_r1", "<｜Assistant｜>", None, "Never closed", "Never closed", None, []),
    ("openai_gptoss", HARMONY, "openai", f"{ANALYSIS}Need the weather.<|end|><|start|>assistant{HCALL}<|call|>"
     f"<|start|>assistant{FINAL}It is 18C.<|return|>", "Need the weather.", "It is 18C.", [PARIS]),
    ("openai_gptoss", HARMONY, "openai", f"{ANALYSIS}Need the weather.<|end|><|start|>assistant{HCALL}",
     "Need the weather.", None, [PARIS]),  # <|call|> is gpt-oss's EOS: the reply ends without it
    ("openai_gptoss", HARMONY, "openai", f"{ANALYSIS}x<|end|><|start|>assistant to=functions.get_weather"
     '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>', "x", None, [PARIS]),  # the template's order
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}Short.<|end|><|start|>assistant{FINAL}Hi!", "Short.", "Hi!", []),
    ("openai_gptoss", HARMONY, None, f"{FINAL}No analysis.<|return|>", None, "No analysis.", []),
    ("openai_gptoss", HARMONY, None, "Plain text, no header.", None, "Plain text, no header.", []),
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}cut by max_tokens", "cut by max_tokens", None, []),
    ("openai_gptoss", HARMONY, "openai", f"{ANALYSIS}a<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>", "a",  # not a function offered: content
     "<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>", []),
    ("openai_gptoss", HARMONY + f"{FINAL}", None, "Prefilled final.", None, "Prefilled final.", []),
]


def _reader(parser: str, tail: str, fmt: str | None) -> ReplyStream:
    return ReplyStream(PARSERS[parser].stream(tail), StreamParser(FORMATS[fmt], NAMES) if fmt else None)


def _joined(deltas) -> tuple:
    return ("".join(d.reasoning for d in deltas if d.reasoning) or None,
            "".join(d.content for d in deltas if d.content) or None, [d.call for d in deltas if d.call])


@pytest.mark.parametrize("parser, tail, fmt, reply, thought, content, calls", CASES)
def test_whole_replies(parser, tail, fmt, reply, thought, content, calls):
    assert _reader(parser, tail, fmt).whole(reply) == (thought, content, calls)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_streamed_equals_whole_over_every_split(case):
    """Every cut into two pieces and three, and token by token (a character at a time)."""
    parser, tail, fmt, reply, *_ = CASES[case]
    whole = _reader(parser, tail, fmt).whole(reply)
    cuts = [(i, j) for i in range(len(reply) + 1) for j in range(i, len(reply) + 1, 7)]
    for i, j in cuts:
        r = _reader(parser, tail, fmt)
        assert _joined(r.feed(reply[:i]) + r.feed(reply[i:j]) + r.feed(reply[j:]) + r.finish()) == whole, (i, j)
    r = _reader(parser, tail, fmt)
    assert _joined([d for ch in reply for d in r.feed(ch)] + r.finish()) == whole


def test_reasoning_streams_before_the_block_closes():
    r = _reader("qwen3", QWEN, None)
    assert r.feed("<think>\nFirst ") == [reasoning.Delta(reasoning="First")]
    assert r.feed("idea </thi") == [reasoning.Delta(reasoning=" idea")]  # a tail that may close it waits
    assert r.feed("nk>\n\nDone") == [reasoning.Delta(content="Done")]


def test_parallel_tool_calls_false_keeps_the_first():
    reply = f"<think>\nTwo.\n</think>\n\n{CALL}\n{CALL}"
    r = ReplyStream(PARSERS["qwen3"].stream(QWEN), StreamParser(FORMATS["hermes"], NAMES), parallel=False)
    assert r.whole(reply) == ("Two.", None, [PARIS])


@pytest.mark.parametrize("name, parser, fmt", [("qwen3", "qwen3", "hermes"), ("qwen3.5", "qwen3", "qwen3_coder"),
                                                ("gpt-oss", "openai_gptoss", "openai")])
def test_detect_on_the_real_templates(name, parser, fmt):
    assert (reasoning.detect(template(name)), detect(template(name))) == (parser, fmt)


def test_detect_deepseek_and_none():
    assert reasoning.detect("{{ '<｜Assistant｜><think>\\n' }}") == "deepseek_r1"
    assert reasoning.detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None


# --- against openai-harmony ---

@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    pytest.importorskip("openai_harmony", reason="a test extra: pip install -e '.[test]'")
    from reasoning_models import harmony_encoding

    return harmony_encoding(tmp_path_factory.mktemp("harmony"))


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[0] == "openai_gptoss" and c[1] == HARMONY
                                  and "no header" not in c[3]])
def test_the_harmony_reader_reads_what_openai_harmony_parses(encoding, case):
    """openai-harmony's StreamableParser over the reply's o200k_harmony tokens (then EOS): its analysis
    messages are the reasoning, its final ones the content, its commentary messages to an offered
    function the calls (named by the recipient, arguments its JSON), and one to any other recipient
    stays content as written, as tk's reader reads the same text."""
    from openai_harmony import Role, StreamableParser

    _, _, fmt, reply, *_ = CASES[case]
    parser = StreamableParser(encoding, Role.ASSISTANT)
    for token in encoding.encode(reply, allowed_special="all"):
        parser.process(token)
    parser.process_eos()
    thought, content, calls = [], [], []
    for m in parser.messages:
        text, name = m.content[0].text, (m.recipient or "").removeprefix("functions.")
        if m.channel == "analysis":
            thought.append(text)
        elif m.recipient and name in NAMES and fmt:
            calls.append((name, json.loads(text)))
        elif m.recipient:
            content.append(f"<|channel|>commentary to={m.recipient} <|constrain|>json<|message|>{text}<|call|>")
        else:
            content.append(text)
    got = _reader("openai_gptoss", HARMONY, fmt).whole(reply)
    assert got[:2] == ("".join(thought) or None, "".join(content) or None)
    assert [(c.name, json.loads(c.arguments)) for c in got[2]] == calls


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "A city"},
                                               "unit": {"type": "string", "enum": ["C", "F"]}},
                                               "required": ["city"]}}}]
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {"role": "assistant", "content": "", "reasoning_content": "I should call get_weather.",
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'}
CONVERSATIONS = {  # name -> (messages, tools)
    "user": ([ASK], None),
    "instructions": ([{"role": "system", "content": "Answer briefly."}, ASK], None),
    "tools": ([{"role": "system", "content": "Answer briefly."}, ASK], TOOLS),
    "turns": ([ASK, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."},
               {"role": "user", "content": "And tomorrow?"}], None),
    "a call and its result": ([ASK, CALLED, RESULT], TOOLS),
}


def _harmony(encoding, messages: list[dict], tools, date: str) -> str:
    """openai-harmony's rendering of a conversation for the assistant's next message, as vLLM builds it."""
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, Role, SystemContent,
                                ToolDescription)

    system = SystemContent.new().with_conversation_start_date(date)
    developer = DeveloperContent.new()
    rest = messages
    if messages[0]["role"] == "system":
        developer, rest = developer.with_instructions(messages[0]["content"]), messages[1:]
    if tools:
        developer = developer.with_function_tools([ToolDescription.new(
            t["function"]["name"], t["function"]["description"], parameters=t["function"]["parameters"]) for t in tools])
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    if tools or messages[0]["role"] == "system":
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    for m in rest:
        if m["role"] == "user":
            out.append(Message.from_role_and_content(Role.USER, m["content"]))
        elif m["role"] == "tool":
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), m["content"])
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            if m.get("reasoning_content"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"])
                           .with_channel("analysis"))
            for c in m.get("tool_calls", []):
                out.append(Message.from_role_and_content(Role.ASSISTANT, c["function"]["arguments"])
                           .with_channel("commentary").with_recipient(f"functions.{c['function']['name']}")
                           .with_content_type("json"))
            if m["content"]:
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("final"))
    return encoding.decode_utf8(encoding.render_conversation_for_completion(Conversation.from_messages(out),
                                                                            Role.ASSISTANT))


@pytest.fixture(scope="module")
def gpt_oss(tiny, tmp_path_factory):
    from reasoning_models import checkpoint
    from tk.toolkit.textgen import Tokenizer

    return Tokenizer(checkpoint(tiny, tmp_path_factory.mktemp("gpt-oss") / "ckpt", "gpt-oss"))


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_the_gpt_oss_template_renders_what_openai_harmony_renders(encoding, gpt_oss, name):
    """tk renders with the checkpoint's template (transformers' apply_chat_template: the ids are
    transformers' own); openai-harmony renders the same conversation (a past call's content type
    "json", as the template writes it). They agree but for two things, both the template's: it writes
    a tool's result as a JSON string (`"{\\"temp\\": 18}"`, its `|tojson`) where harmony writes the
    text as it is, and it ends the developer message's instructions with a blank line where no tools
    follow them."""
    from tk.toolkit.serving.openai.api import messages as as_template

    messages, tools = CONVERSATIONS[name]
    for _ in range(2):  # (the template writes today's date: once more if the day turned while rendering)
        date = datetime.date.today().isoformat()
        ids = gpt_oss.chat_messages(as_template(_parsed(messages)), tools=tools)
        if date == datetime.date.today().isoformat():
            break
    assert ids == gpt_oss.hf.apply_chat_template(as_template(_parsed(messages)), tools=tools,
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
    ours, theirs = gpt_oss.decode(ids, False), _harmony(encoding, messages, tools, date)
    if name == "a call and its result":
        assert theirs.count(RESULT["content"]) == 1 and ours.count(json.dumps(RESULT["content"])) == 1
        ours = ours.replace(json.dumps(RESULT["content"]), RESULT["content"])
    if name == "instructions":
        assert ours.count("Answer briefly.\n\n<|end|>") == 1 and theirs.count("Answer briefly.<|end|>") == 1
        ours = ours.replace("Answer briefly.\n\n<|end|>", "Answer briefly.<|end|>")
    assert ours == theirs


def _parsed(messages: list[dict]):
    """Messages as the chat body's schema reads them (what the server hands the template)."""
    from tk.toolkit.serving.openai.schemas import schemas

    return schemas("tiny", 512, 1024).Chat.model_validate({"messages": messages}).messages

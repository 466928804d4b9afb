"""Reasoning through tk serve (issue 44), with the official `openai` client: gpt-oss (harmony) and
Qwen3/Qwen3.5 (`<think>`) checkpoints with their real chat templates (tests/reasoning_models.py),
planted to write a chosen reply (tests/planted.py). A reply with reasoning, a tool call and an
answer comes back as `reasoning_content`, `tool_calls` and `content`, streamed and whole alike;
`chat_template_kwargs` reach the template (`enable_thinking`); a reasoning item in the Responses
API; gpt-oss's forced calls under harmony's grammar; `--reasoning-parser none`. Every server and
client on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from planted import Script, planted_server
from tk.toolkit.serving.openai.process import in_thread

pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="tool grammars need llguidance: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="a test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HARMONY_REPLY = ("<|channel|>analysis<|message|>The user wants the weather; call get_weather.<|end|>"
                 "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                 '{"city": "Paris"}<|call|><|start|>assistant<|channel|>final<|message|>Checking Paris.<|return|>')
QWEN_REPLY = ("<think>\nThe user wants the weather; call get_weather.\n</think>\n\nChecking Paris.\n"
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
THOUGHT, SAID, CALLED = "The user wants the weather; call get_weather.", "Checking Paris.", [("get_weather",
                                                                                             {"city": "Paris"})]


@pytest.fixture(scope="module")
def artifacts(tiny, tmp_path_factory):
    from reasoning_models import artifact

    made = {}

    def get(family: str):
        if family not in made:
            made[family] = artifact(tiny, tmp_path_factory.mktemp(family), family)
        return made[family]
    return get


def _serve(artifact, reply_for, **options):
    """A one-slot server of `artifact` planted to write `reply_for(prompt text)`; (server, client, prompts seen)."""
    from tk.models.spec.manifest import Manifest
    from tk.toolkit.textgen import Tokenizer

    seen = []

    def reply(prompt: str) -> str:
        seen.append(prompt)
        return reply_for(prompt)
    srv = planted_server(artifact, Script(Tokenizer(artifact), Manifest.read(artifact).eos_token_ids[0], reply),
                         slots=1, **options)
    return srv, seen


def _served(srv, seen):
    """(server, its openai client, the prompts it saw, its URL) while it serves on a thread."""
    with in_thread(srv) as url:
        yield srv, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), seen, url
    srv.batcher.close()


@pytest.fixture(scope="module")
def gpt_oss(artifacts):
    yield from _served(*_serve(artifacts("gpt-oss"), lambda prompt: HARMONY_REPLY))


@pytest.fixture(scope="module")
def qwen3(artifacts):
    yield from _served(*_serve(artifacts("qwen3"), lambda prompt: QWEN_REPLY))


def _whole(client, **body):
    c = client.chat.completions.create(model="tiny", **{"messages": ASK, "temperature": 0, "max_tokens": 120,
                                                        **body}).choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
    return c.message.reasoning_content, c.message.content, calls, c.finish_reason


def _streamed(client, **body):
    """The stream assembled as clients assemble it: reasoning and content deltas, calls by index."""
    thought, content, calls, finish, order = "", "", {}, None, []
    for chunk in client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=120,
                                                stream=True, **body):
        for choice in chunk.choices:
            d = choice.delta
            if getattr(d, "reasoning_content", None):
                thought += d.reasoning_content
                order.append("reasoning")
            if d.content:
                content += d.content
                order.append("content")
            for t in d.tool_calls or []:
                call = calls.setdefault(t.index, {"name": "", "arguments": ""})
                call["name"] += t.function.name or "" if t.function else ""
                call["arguments"] += t.function.arguments or "" if t.function else ""
                order.append("call")
            finish = choice.finish_reason or finish
    if "reasoning" in order:  # the reasoning first, all of it
        assert order[0] == "reasoning" and "reasoning" not in order[order.index(next(o for o in order
                                                                                 if o != "reasoning")):]
    return thought or None, content or None, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3"])
def test_reasoning_a_call_and_an_answer_streamed_and_whole(family, request):
    """Through the official openai client: the reply's reasoning is reasoning_content, its call a
    tool_call, its words content; streamed (reasoning first, as deltas) the same as whole."""
    client = request.getfixturevalue(family)[1]
    whole, streamed = _whole(client, tools=[WEATHER]), _streamed(client, tools=[WEATHER])
    assert whole == streamed == (THOUGHT, SAID, CALLED, "tool_calls")


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3"])
def test_without_tools_the_call_is_not_read_but_reasoning_is(family, request):
    thought, content, calls, finish = _whole(request.getfixturevalue(family)[1])
    assert (thought, calls, finish) == (THOUGHT, [], "stop") and SAID in content and "get_weather" in content


def test_the_reasoning_goes_back_to_the_template_in_the_next_turn(qwen3):
    """The agent's loop: the reply's message sent back as the client has it (reasoning_content with it),
    then the tool's result; Qwen3's template writes the reasoning of a turn after the last question."""
    srv, client, _, _ = qwen3
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=120)
    message = first.choices[0].message
    follow = [*ASK, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18C"}]
    again = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], temperature=0,
                                           max_tokens=120)
    assert again.choices[0].message.reasoning_content == THOUGHT
    rendered = srv.tokenizer.decode(client.post("/../tokenize", body={"messages": follow, "tools": [WEATHER]},
                                                cast_to=object)["tokens"], False)
    assert f"<think>\n{THOUGHT}\n</think>\n\nChecking Paris.\n<tool_call>" in rendered
    assert rendered.endswith("<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen35(artifacts):
    """Qwen3.5: the template opens the block (the reply starts inside it) unless enable_thinking is false."""
    yield from _served(*_serve(artifacts("qwen3.5"), lambda prompt: "Sunny." if prompt.endswith("</think>\n\n")
                               else "Weather means tools.\n</think>\n\nSunny."))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_template_kwargs_reach_the_template(qwen35, stream):
    """Qwen3.5's template opens the block (the reply begins inside it), or with enable_thinking false
    closes an empty one (the reply is content)."""
    client = qwen35[1]
    ask = _streamed if stream else _whole
    assert ask(client) == ("Weather means tools.", "Sunny.", [], "stop")
    assert ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == (None, "Sunny.", [], "stop")


def test_a_grammar_where_the_reply_begins_in_its_reasoning_is_a_400(qwen35):
    """Qwen3.5's reply begins inside <think>: a grammar would hold the reasoning, so tk says so (and
    with enable_thinking false the JSON is the content)."""
    client = qwen35[1]
    with pytest.raises(openai.BadRequestError, match="enable_thinking") as refused:
        _whole(client, response_format={"type": "json_object"})
    assert refused.value.body["param"] == "response_format"
    thought, content, _, _ = _whole(client, response_format={"type": "json_object"}, max_tokens=40,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thought is None and content.startswith("{")


def test_chat_template_kwargs_in_tokenize_and_their_400s(qwen35):
    from test_serve_api import _call

    srv, _, _, url = qwen35
    on = _call(url, "/tokenize", {"messages": ASK}, key=None)[1]["tokens"]
    off = _call(url, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, key=None)
    assert srv.tokenizer.decode(off[1]["tokens"], False).endswith("<think>\n\n</think>\n\n") and off[1]["tokens"] != on
    for bad in ({"tokenize": False}, ["enable_thinking"], {"not a name": 1}):
        status, err = _call(url, "/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": bad}, key=None)
        assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err
    status, err = _call(url, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER]}, key=None)
    assert status == 400 and "qwen3_coder" in err["error"]["message"] and err["error"]["param"] == "tools"


def test_a_responses_reply_has_a_reasoning_item_streamed_and_whole(gpt_oss):
    from test_responses import _items, _strict

    client = gpt_oss[1]
    body = {"input": ASK[0]["content"], "tools": [{"type": "function", **WEATHER["function"]}],
            "max_output_tokens": 120, "temperature": 0}
    whole = client.responses.create(model="tiny", **body)
    _strict(whole)
    assert [i.type for i in whole.output] == ["reasoning", "function_call", "message"]
    assert whole.output[0].content[0].text == THOUGHT and whole.output_text == SAID
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    events = list(client.responses.create(model="tiny", stream=True, **body))
    for e in events:
        _strict(e)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert _items(events[-1].response) == _items(whole)
    # the reasoning and the call sent back as input (as gpt-oss's turn ends: <|call|> is its EOS) with the
    # tool's result: the template renders the reasoning as the call's analysis message (no final after it)
    turn = [{"role": "user", "content": body["input"]}, *[i.model_dump(exclude_none=True) for i in whole.output[:2]],
            {"type": "function_call_output", "call_id": whole.output[1].call_id, "output": "18C"}]
    again = client.responses.create(model="tiny", input=turn, tools=body["tools"], max_output_tokens=120, temperature=0)
    assert again.status == "completed" and again.output_text == SAID
    seen = gpt_oss[2][-1]
    assert f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions.get_weather" in seen


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_under_harmonys_grammar(artifacts, choice):
    """The untrained model's own reply under the openai format's grammar: one call, in harmony."""
    from test_serve_api import _serve as serve

    srv = serve(artifacts("gpt-oss"), "ort")
    with in_thread(srv) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for seed in range(3):
            _, content, calls, finish = _whole(client, tools=[WEATHER], tool_choice=choice, seed=seed, temperature=1.0)
            assert calls in ([("get_weather", {"city": "Paris"})], [("get_weather", {"city": "Oslo"})])
            assert finish == "tool_calls" and content is None
    srv.batcher.close()


def test_reasoning_parser_none_leaves_the_text_as_written(artifacts):
    srv, _ = _serve(artifacts("qwen3"), lambda prompt: QWEN_REPLY, reasoning_parser="none")
    with in_thread(srv) as url:
        reply = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120).chat.completions.create(
            model="tiny", messages=ASK, temperature=0, max_tokens=120)
    srv.batcher.close()
    assert reply.choices[0].message.content == QWEN_REPLY
    assert "reasoning_content" not in reply.choices[0].message.model_dump(exclude_unset=True)

"""tk serve for agents (issue 36): tools rendered by the model's own chat template, tool calls read
back in its format (hermes here, Qwen2.5's), each tool_choice mode streamed and not, parallel
calls, a two-turn loop, a malformed call in auto, a template without tools refused, and required
and named calls whose arguments validate against their schemas on 64 concurrent requests. The
tiny model is untrained: `auto` replies are steered with guided_choice (a real model writes the
same text on its own), while required and named replies are the grammar's work alone. Every
server and client on 127.0.0.1."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_serve_api import _serve
from tk.toolkit.serving.openai.process import in_thread

pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="tool grammars need llguidance: pip install -e '.[serve]'")
jsonschema = pytest.importorskip("jsonschema", reason="a test extra: pip install -e '.[test]'")
openai = pytest.importorskip("openai", reason="a test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tools_artifact):
    srv = _serve(tools_artifact, "ort")
    with in_thread(srv) as url:
        yield srv, url
    srv.batcher.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client, **body):
    return client.chat.completions.create(model="tiny", **{"messages": ASK, "tools": TOOLS, **body})


def _stream(client, **body):
    """A streamed reply assembled as OpenAI's clients assemble it: content, and each call's id, name
    and argument fragments by index; with the finish reason and the usage."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **body):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish, usage


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_calls_and_keeps_the_text_around_them(client, stream):
    """auto: the text's calls come back as tool_calls (the reply here steered by guided_choice),
    the words before and after them as content, finish_reason tool_calls; streamed, the same."""
    said = f"Let me check.\n{CALL}\n{CALL_ADD}\nOne moment."
    body = {"extra_body": {"guided_choice": [said]}, "temperature": 0, "max_tokens": 200}
    if stream:
        content, calls, finish, usage = _stream(client, **body)
        assert all(c["id"].startswith("call_") for c in calls) and usage.completion_tokens > 0
        calls = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        reply = _chat(client, **body)
        content, calls, finish = reply.choices[0].message.content, _calls(reply.choices[0].message), \
            reply.choices[0].finish_reason
        assert all(c.id.startswith("call_") and c.type == "function" for c in reply.choices[0].message.tool_calls)
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]
    assert content == "Let me check.\n\n\nOne moment." and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(client, stream):
    body = {"extra_body": {"guided_choice": [f"{CALL}\n{CALL_ADD}"]}, "temperature": 0, "max_tokens": 200,
            "parallel_tool_calls": False}
    if stream:
        calls = [c["name"] for c in _stream(client, **body)[1]]
    else:
        calls = [name for name, _ in _calls(_chat(client, **body).choices[0].message)]
    assert calls == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("said", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
                                  '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'])
def test_a_malformed_call_in_auto_comes_back_as_content(client, said, stream):
    body = {"extra_body": {"guided_choice": [said]}, "temperature": 0, "max_tokens": 200}
    if stream:
        content, calls, finish, _ = _stream(client, **body)
    else:
        reply = _chat(client, **body)
        content, calls, finish = reply.choices[0].message.content, _calls(reply.choices[0].message), \
            reply.choices[0].finish_reason
    assert (content, calls, finish) == (said, [], "stop")


BARE = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'


@pytest.mark.parametrize("said, calls", [
    (BARE, [("get_weather", {"city": "Paris", "unit": "C"})]),  # what Qwen2.5-Coder-0.5B writes, untagged
    (f"```json\n{BARE}\n```", [("get_weather", {"city": "Paris", "unit": "C"})]),
    ('{"name": "get_weather", "arguments": {"city": "Rome"}}', []),  # fails its schema: content
    ('{"name": "get_time", "arguments": {}}', []),  # names no tool given: content
])
def test_auto_reads_a_call_written_without_tags_streamed_as_whole(client, said, calls):
    body = {"extra_body": {"guided_choice": [said]}, "temperature": 0, "max_tokens": 200}
    reply = _chat(client, **body).choices[0]
    content, streamed, finish, _ = _stream(client, **body)
    assert _calls(reply.message) == calls == [(c["name"], json.loads(c["arguments"])) for c in streamed]
    assert reply.message.content == content == (None if calls else said)
    assert reply.finish_reason == finish == ("tool_calls" if calls else "stop")


def test_tool_choice_none_renders_the_tools_and_parses_nothing(client, server):
    reply = _chat(client, tool_choice="none", extra_body={"guided_choice": [CALL]}, temperature=0, max_tokens=200)
    assert reply.choices[0].message.content == CALL and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    ids = server[0].tokenizer.chat_messages(ASK, tools=TOOLS)
    assert "get_weather" in server[0].tokenizer.decode(ids, False)  # rendered by the template


def _validate(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_and_named_calls_validate_on_64_concurrent_requests(client):
    """The grammar's work alone (the untrained model would never write a call): every reply of 64
    concurrent requests, greedy and sampled, streamed and not, required (parallel or one) and
    named, is calls to the right functions whose arguments validate against their schemas. Each
    reply ends where the model leaves the call format (issue 46; tests/test_forced_calls.py): the
    untrained model's own next token after a call is almost never another call's start, so no
    reply runs on to max_tokens."""
    def ask(i: int):
        choice = ["required", {"type": "function", "function": {"name": "add"}}][i % 2]
        body = {"tool_choice": choice, "parallel_tool_calls": i % 4 != 0, "max_tokens": 300, "seed": i,
                "temperature": 0 if i % 3 == 0 else 1.0}
        if i % 5 == 0:
            content, calls, finish, _ = _stream(client, **body)
            calls = [(c["name"], c["arguments"]) for c in calls]
        else:
            m = _chat(client, **body).choices[0]
            content, finish = m.message.content, m.finish_reason
            calls = [(c.function.name, c.function.arguments) for c in m.message.tool_calls or []]
        return choice, body["parallel_tool_calls"], content, calls, finish

    with ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(ask, range(64)))
    for choice, parallel, content, calls, finish in replies:
        assert calls and finish == "tool_calls" and content is None, (choice, content, finish)
        assert len(calls) == 1 or (parallel and choice == "required"), calls
        for name, arguments in calls:
            assert name == (choice["function"]["name"] if isinstance(choice, dict) else name) and name in SCHEMAS
            _validate(name, arguments)


def test_a_two_turn_loop_call_result_answer(client, server):
    """The agent's loop with the openai client: a call (required), the tool's result sent back as a
    tool message with the call's id, and the model's answer as text (auto)."""
    messages = list(ASK)
    first = _chat(client, messages=messages, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    _validate(call.function.name, call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = _chat(client, messages=messages, temperature=0, max_tokens=40,
                   extra_body={"guided_choice": ["It is 18 degrees in Paris."]})
    assert second.choices[0].message.content == "It is 18 degrees in Paris." and second.choices[0].finish_reason == "stop"
    rendered = server[0].tokenizer.decode(server[0].tokenizer.chat_messages(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}], tools=TOOLS), False)
    assert '<tool_call>\n{"name": "get_weather"' in rendered and "18 degrees, sunny" in rendered
    assert second.usage.prompt_tokens == len(server[0].tokenizer.encode(rendered, False))


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of the tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "share a name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "grammar of its own"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "content is required"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **body)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


def test_a_template_that_cannot_render_tools_is_refused(serve_artifact):
    """The plain test template ignores tools: a request with tools is a 400 saying so, not a reply
    from a model that never saw them."""
    from tk.toolkit.serving.openai.api import ApiError
    from tk.toolkit.serving.openai.calling import ToolCalling
    from tk.toolkit.serving.openai.schemas import schemas
    from tk.toolkit.textgen import Tokenizer

    tokenizer = Tokenizer(serve_artifact)
    assert not tokenizer.renders_tools
    body = schemas("tiny", 512, 128).Chat.model_validate({"messages": ASK, "tools": TOOLS})
    with pytest.raises(ApiError) as e:
        ToolCalling(tokenizer).request(body)
    assert e.value.status == 400 and e.value.param == "tools" and "does not render tools" in e.value.message


def test_the_parser_comes_from_the_template_or_the_flag(tools_artifact):
    from tk.toolkit.serving.openai.calling import ToolCalling
    from tk.toolkit.textgen import Tokenizer

    tokenizer = Tokenizer(tools_artifact)
    assert ToolCalling(tokenizer).parser_name == "hermes" and tokenizer.renders_tools
    assert ToolCalling(tokenizer, "mistral").parser_name == "mistral"


def test_the_document_says_tool_choice_needs_tools_and_a_tool_turn_its_call(server):
    """Issue 36's fuzz run: /openapi.json admitted bodies the server refuses (a tool message without
    tool_call_id, tool_choice required with no tools); its `if`/`then` rules now refuse them too, and
    admit what the server takes (an assistant turn of calls and no content, the tool's answer)."""
    import urllib.request

    url = server[1]
    doc = json.loads(urllib.request.urlopen(url + "/openapi.json", timeout=10).read())
    chat = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/Chat", "components": doc["components"]})
    named = {"type": "function", "function": {"name": "add"}}
    for choice in ("required", named):
        assert not chat.is_valid({"messages": ASK, "tool_choice": choice})
        assert chat.is_valid({"messages": ASK, "tool_choice": choice, "tools": TOOLS})
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    assert chat.is_valid({"messages": turns, "tools": TOOLS})
    assert not chat.is_valid({"messages": [*turns[:2], {"role": "tool", "content": "3"}], "tools": TOOLS})
    assert not chat.is_valid({"messages": [*ASK, {"role": "assistant", "content": None}]})


def test_an_assistant_message_appended_as_a_client_dumps_it_is_taken(client):
    """`message.model_dump()` carries refusal, annotations, audio and function_call (null): the
    conversation goes on, as llama-server takes it (openai-agents and hand loops send it so)."""
    turn = {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
            "function_call": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    reply = _chat(client, messages=[*ASK, turn, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
                  max_tokens=1)
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, messages=[*ASK, {**turn, "function_call": {"name": "get_weather", "arguments": "{}"}}],
              max_tokens=1)
    assert e.value.body["param"] == "messages" and "function_call" in e.value.body["message"]


@pytest.fixture(scope="module")
def prose_after_a_call(tools_artifact):
    """A server of the tiny model planted to prefer prose after a call, as Qwen2.5-Coder-0.5B does:
    +30 on a newline after ">" (a call's close), and on "I" after a newline (tests/planted.py)."""
    from planted import bigram, planted_server
    from tk.toolkit.textgen import Tokenizer

    tokenizer = Tokenizer(tools_artifact)
    (close,), (newline,), (prose,) = (tokenizer.encode(t, False) for t in (">", "\n", "I"))
    srv = planted_server(tools_artifact, bigram({close: newline, newline: prose}))
    with in_thread(srv) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    srv.batcher.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_model_that_prefers_prose_after_its_call_gets_that_call_alone(prose_after_a_call, choice, temperature,
                                                                        stream):
    """Issue 46: after its call the planted model writes a newline, then prose; the grammar used to
    take each newline for the start of another call (seven calls and "length" on the real 0.5B).
    Now its reply is its one call, finish_reason tool_calls, greedy and sampled, whole and streamed."""
    body = {"tool_choice": choice, "max_tokens": 300, "temperature": temperature, "seed": 3}
    if stream:
        content, calls, finish, usage = _stream(prose_after_a_call, **body)
        calls = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        reply = _chat(prose_after_a_call, **body)
        content, calls, finish, usage = (reply.choices[0].message.content, _calls(reply.choices[0].message),
                                         reply.choices[0].finish_reason, reply.usage)
    assert content is None and finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
    assert usage.completion_tokens < 100  # one call and its newline, not a run to max_tokens
    name, arguments = calls[0]
    jsonschema.validate(arguments, SCHEMAS[name])

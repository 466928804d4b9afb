"""OpenAI's Responses API on tk serve (issue 46), through the official `openai` client's
`client.responses` and the Agents SDK's default model (`OpenAIResponsesModel`): plain, streamed (the
event sequence, equal to the whole reply), instructions, tools (required calls; a bare call),
`previous_response_id` with a tool's result, a JSON schema, the store (GET, store: false, eviction),
`max_output_tokens`, and the 400s that name what tk does not implement. The tiny model is untrained:
where a test needs it to mean something (an agent's turns), it is planted (tests/planted.py). Every
server and client on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json

import pytest

from planted import Script, planted_server
from test_tool_calling import ASK, SCHEMAS, TOOLS
from tk.toolkit.serving.openai.process import in_thread

pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="tool grammars need llguidance: pip install -e '.[serve]'")
jsonschema = pytest.importorskip("jsonschema", reason="a test extra: pip install -e '.[test]'")
openai = pytest.importorskip("openai", reason="a test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.slow

FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses shape: no "function" level


@pytest.fixture(scope="module")
def served(tools_artifact):
    from test_serve_api import _serve

    srv = _serve(tools_artifact, "ort")
    with in_thread(srv) as url:
        yield srv, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    srv.batcher.close()


@pytest.fixture(scope="module")
def client(served):
    return served[1]


def _events(client, **body) -> list:
    return list(client.responses.create(model="tiny", stream=True, **body))


def _strict(obj) -> None:
    """As OpenAI's own types require it (the client constructs them leniently): every required field
    there, with its type, for the response, each item and each event."""
    type(obj).model_validate(obj.model_dump(by_alias=True, exclude_unset=True))


def _items(response) -> list[dict]:
    """Output items without their ids (each reply draws new ones)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in response.output]


@pytest.mark.parametrize("instructions", [None, "Answer in French."])
def test_a_plain_response_is_the_chat_completion_of_the_same_conversation(client, instructions):
    body = {"input": "Hello there", "max_output_tokens": 12, "temperature": 0}
    r = client.responses.create(model="tiny", **body, **({"instructions": instructions} if instructions else {}))
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    _strict(r)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content and r.instructions == instructions
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == chat.usage.total_tokens
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
        ("incomplete", "max_output_tokens") if chat.choices[0].finish_reason == "length" else ("completed", None))


def test_the_stream_is_openais_event_sequence_and_ends_in_the_whole_response(client):
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
            "max_output_tokens": 12, "temperature": 0}
    events = _events(client, **body)
    whole = client.responses.create(model="tiny", **body)
    kinds = [e.type for e in events]
    for e in events:
        _strict(e)
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text \
        == whole.output_text
    assert _items(final) == _items(whole) and final.usage == whole.usage
    assert events[0].response.status == "in_progress" and events[0].response.output == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_is_a_function_call_item(client, stream):
    body = {"input": ASK, "tools": FUNCTIONS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": 200, "temperature": 0}
    if stream:
        events = _events(client, **body)
        response = events[-1].response
        kinds = [e.type for e in events]
        for e in events:
            _strict(e)
        assert kinds[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                              "response.function_call_arguments.done", "response.output_item.done"]
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == response.output[0].arguments
    else:
        response = client.responses.create(model="tiny", **body)
    assert response.status == "completed" and [i.type for i in response.output] == ["function_call"]
    call = response.output[0]
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_previous_response_id_continues_the_conversation_with_a_tools_result(client, served):
    first = client.responses.create(model="tiny", input=ASK, tools=FUNCTIONS, instructions="Be brief.",
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100)
    call = first.output[0]
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=FUNCTIONS, max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 degrees, sunny"}])
    assert second.previous_response_id == first.id
    # the same conversation sent whole to chat completions: its prompt, token for token (the
    # instructions are not carried over, as OpenAI's are not)
    chat = client.chat.completions.create(model="tiny", tools=TOOLS, max_tokens=1, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()


def test_a_json_schema_format_holds_the_text(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {
        "type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Pick a city.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_a_bare_call_in_auto_is_a_function_call(client):
    """A reply that is nothing but a JSON call (here a JSON schema makes the untrained model write
    one) is a function_call item, as the model's tagged calls are."""
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    r = client.responses.create(model="tiny", input=ASK, tools=FUNCTIONS, max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": {"const": call}}})
    assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output] == [("function_call", "add", call["arguments"])]


def test_the_store_get_store_false_and_unknown_ids(client):
    kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    for ident in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ident)
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model="tiny", input="Hi", previous_response_id=ident)
        assert e.value.body["param"] == "previous_response_id" and "store" in e.value.body["message"]


def test_the_store_keeps_the_newest_responses():
    from tk.toolkit.serving.openai.api import ApiError
    from tk.toolkit.serving.openai.responses import Store

    store = Store(capacity=3)
    for i in range(5):
        store.put(f"r{i}", {"id": f"r{i}"}, [])
    assert [store.get(f"r{i}")[0]["id"] for i in (2, 3, 4)] == ["r2", "r3", "r4"]
    with pytest.raises(ApiError) as e:
        store.get("r1", "previous_response_id")
    assert e.value.status == 404 and "evicted" in e.value.message


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search: a hosted tool"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}, {"type": "code_interpreter"}]}, "tools",
     "file_search, code_interpreter: a hosted tool"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "does not implement"),
    ({"background": True}, "background", "does not implement"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "at most 0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", ""),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not one of the tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema is required"),
    ({"max_output_tokens": 100000}, "max_output_tokens", ""),
    ({"max_output_tokens": 500, "input": "word " * 100}, "input", "exceeds the model's context"),  # said as chat's
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nope"}}}}, "text",
     "text.format: not a valid json constraint"),
])
def test_what_tk_does_not_implement_is_a_400_naming_it(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", **{"input": "Hi", **body})
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


def test_the_document_has_both_operations(served):
    doc = served[0].app.openapi()
    assert {"post"} <= set(doc["paths"]["/v1/responses"]) and "get" in doc["paths"]["/v1/responses/{response_id}"]
    assert "404" in doc["paths"]["/v1/responses"]["post"]["responses"]


WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CONVERT_CALL = '{"name": "convert_temperature", "arguments": {"celsius": 18, "to": "F"}}'  # bare, as Qwen2.5 writes


@pytest.fixture(scope="module")
def agent_server(tools_artifact):
    """The tiny model planted as an agent's model: with no tool result yet it calls get_weather (in
    its template's tags), with one it calls convert_temperature (bare JSON), with two it answers."""
    from tk.models.spec.manifest import Manifest
    from tk.toolkit.textgen import Tokenizer

    tokenizer = Tokenizer(tools_artifact)
    replies = [WEATHER_CALL, CONVERT_CALL, "It is 18 C in Paris, which is 64.4 F."]
    script = Script(tokenizer, Manifest.read(tools_artifact).eos_token_ids[0],
                    lambda prompt: replies[min(prompt.count("<|tool|>"), 2)])
    srv = planted_server(tools_artifact, script, slots=1)
    with in_thread(srv) as url:
        yield url
    srv.batcher.close()


@pytest.mark.parametrize("stream", [False, True])
def test_the_agents_sdk_default_model_runs_a_two_tool_task(agent_server, stream):
    """openai-agents with its default model class (OpenAIResponsesModel, over the Responses API),
    tool_choice left to the model: it calls get_weather, then convert_temperature with the first
    tool's result, then answers; streamed (Runner.run_streamed) as well."""
    agents = pytest.importorskip("agents", reason="a test extra: pip install -e '.[test]'")
    ran = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(("get_weather", {"city": city}))
        return "18 C, sunny"

    @agents.function_tool
    def convert_temperature(celsius: float, to: str) -> str:
        """A temperature in Celsius, converted to F or K."""
        ran.append(("convert_temperature", {"celsius": celsius, "to": to}))
        return "64.4" if to == "F" else "291.15"

    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=openai.AsyncOpenAI(
        base_url=agent_server + "/v1", api_key="none", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Use the tools.", model=model,
                         tools=[get_weather, convert_temperature], model_settings=agents.ModelSettings(max_tokens=80))
    question = "What is the weather in Paris? Then convert its temperature to Fahrenheit."
    if stream:
        async def run():
            result = agents.Runner.run_streamed(agent, question, max_turns=5)
            async for _ in result.stream_events():
                pass
            return result
        result = asyncio.run(run())
    else:
        result = agents.Runner.run_sync(agent, question, max_turns=5)
    assert ran == [("get_weather", {"city": "Paris"}), ("convert_temperature", {"celsius": 18, "to": "F"})]
    assert "64.4 F" in result.final_output

"""The clients and the task of examples/agent_tools.py: the two tools, the official `openai`
package's loop by hand and the OpenAI Agents SDK's run (over Chat Completions, `agents`, or its
default Responses model, `agents-responses`), each recording its exchanges (requests and responses
as sent and received; a streamed Responses run keeps its requests only) for --json. Imported by
agent_tools.py, which starts the servers.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from typing import Literal

# No request may leave the machine: dummy keys, no proxies for loopback, no tracing upload, hub offline.
OFFLINE = {"OPENAI_API_KEY": "sk-local-dummy", "OPENAI_AGENTS_DISABLE_TRACING": "1", "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)
os.environ.pop("OPENAI_BASE_URL", None)

SYSTEM = ("You are a helpful assistant with tools. To answer, first call get_weather for the city. Then call "
          "convert_temperature with the Celsius temperature that get_weather returned. When you have both "
          "results, answer the user in one short sentence with the weather and the converted temperature.")
QUESTION = "What is the weather in Paris? Then convert its temperature to Fahrenheit."
WEATHER = {"paris": "Paris: 18 C, sunny, light wind", "oslo": "Oslo: -3 C, snow", "lima": "Lima: 24 C, cloudy"}
EXPECTED = [("get_weather", {"city": "Paris"}), ("convert_temperature", {"celsius": 18, "to": "F"})]
ANSWER = "64.4"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city; its temperature is in Celsius.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "convert_temperature", "description": "Convert a temperature in Celsius to Fahrenheit (F) or Kelvin (K).",
        "parameters": {"type": "object", "properties": {
            "celsius": {"type": "number", "description": "The temperature in Celsius"},
            "to": {"type": "string", "enum": ["F", "K"], "description": "The unit to convert to"}},
            "required": ["celsius", "to"], "additionalProperties": False}}},
]


class Toolbox:
    """The two tools, recording each call made (name, arguments as received, result) in order."""

    def __init__(self):
        self.calls: list[dict] = []

    def get_weather(self, city: str) -> str:
        result = WEATHER.get(str(city).strip().lower(), f"no weather for {city!r}; known cities: Paris, Oslo, Lima")
        self.calls.append({"name": "get_weather", "arguments": {"city": city}, "result": result})
        return result

    def convert_temperature(self, celsius: float, to: str) -> str:
        try:
            c = float(celsius)
            value = {"F": c * 9 / 5 + 32, "K": c + 273.15}[str(to).upper()]
            result = f"{c:g} C = {round(value, 2):g} {str(to).upper()}"
        except (TypeError, ValueError, KeyError):
            result = f"cannot convert {celsius!r} to {to!r}: celsius is a number, to is F or K"
        self.calls.append({"name": "convert_temperature", "arguments": {"celsius": celsius, "to": to},
                           "result": result})
        return result

    def run(self, name: str, arguments: str) -> str:
        """A call as the openai loop gets it (arguments: JSON text); a bad call's error goes back to the model."""
        try:
            args = json.loads(arguments or "{}")
            if not isinstance(args, dict):
                raise TypeError("the arguments are not an object")
            if name == "get_weather":
                return self.get_weather(**args)
            if name == "convert_temperature":
                return self.convert_temperature(**args)
            raise ValueError(f"no tool named {name!r}")
        except (TypeError, ValueError) as e:
            self.calls.append({"name": name, "arguments": arguments, "result": f"error: {e}"})
            return f"error: {e}"


def right(calls: list[dict], final: str | None) -> bool:
    """Both expected calls made, in order (other calls allowed around them), and 64.4 in the answer."""
    wanted = iter(EXPECTED)
    want = next(wanted)
    for c in calls:
        a = c["arguments"] if isinstance(c["arguments"], dict) else {}
        if want and c["name"] == want[0] and all(_same(a.get(k), v) for k, v in want[1].items()):
            want = next(wanted, None)
    return want is None and ANSWER in (final or "")


def call_as_text(final: str | None) -> bool:
    """The final text is a tool call the model wrote without its format's markers (bare JSON, or
    in a code fence): a call neither server reads as one, left in the content."""
    text = (final or "").strip().removeprefix("```json").removeprefix("```").strip()
    try:
        first, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return False
    return isinstance(first, dict) and first.get("name") in {t["function"]["name"] for t in TOOLS}


def _same(got, want) -> bool:
    if isinstance(want, str):
        return isinstance(got, str) and got.strip().lower().startswith(want.lower())
    try:
        return float(got) == float(want)
    except (TypeError, ValueError):
        return False


def record(client, exchanges: list[dict], responses: bool = False):
    """The client's chat.completions.create (responses.create), wrapped to keep each request's body
    and its response (or error) as sent and received; the Agents SDK calls the same method."""
    completions = client.responses if responses else client.chat.completions
    create = completions.create

    def body(kwargs):
        return {k: v for k, v in kwargs.items() if not k.startswith("extra_") and type(v).__name__ != "Omit"}

    def done(kwargs, reply=None, error=None):
        entry = {"request": json.loads(json.dumps(body(kwargs), default=_plain))}
        if error is not None:
            entry["error"] = repr(error)
            entry["error_body"] = getattr(error, "body", None)
        exchanges.append(entry)
        if reply is None:
            return None
        if kwargs.get("stream") is True:  # the chunks, as the client reads them
            entry["chunks"] = []
            return _Tap(reply, entry["chunks"])
        entry["response"] = reply.model_dump(exclude_none=True)
        return reply

    if type(client).__name__ == "AsyncOpenAI":  # (its create is wrapped: iscoroutinefunction cannot tell)
        async def wrapped(**kwargs):
            try:
                reply = await create(**kwargs)
            except Exception as e:
                done(kwargs, error=e)
                raise
            return done(kwargs, reply)
    else:
        def wrapped(**kwargs):
            try:
                reply = create(**kwargs)
            except Exception as e:
                done(kwargs, error=e)
                raise
            return done(kwargs, reply)
    completions.create = wrapped
    return client


class _Tap:
    """A stream (sync or async) that keeps each chunk it hands on; anything else is the stream's."""

    def __init__(self, stream, chunks: list):
        self._stream, self._chunks = stream, chunks

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __iter__(self):
        for chunk in self._stream:
            self._chunks.append(chunk.model_dump(exclude_none=True))
            yield chunk

    def __aiter__(self):
        return self._async()

    async def _async(self):
        async for chunk in self._stream:
            self._chunks.append(chunk.model_dump(exclude_none=True))
            yield chunk


def _plain(obj):
    return obj.model_dump(exclude_none=True) if hasattr(obj, "model_dump") else str(obj)


def assemble(stream) -> tuple[dict, str | None]:
    """A streamed reply as OpenAI's clients assemble it: (the assistant message, finish_reason);
    each call's id, name and argument pieces joined by their index."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["function"]["name"] += d.function.name or ""
                    call["function"]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


def openai_loop(base_url: str, model: str, max_turns: int, max_tokens: int, mode: str, stream: bool) -> dict:
    """The official openai package's tool loop by hand, temperature 0 (streamed: the deltas assembled)."""
    import openai

    exchanges: list[dict] = []
    client = record(openai.OpenAI(base_url=base_url, api_key=OFFLINE["OPENAI_API_KEY"], max_retries=0, timeout=600),
                    exchanges)
    box, turns, final, finished, error, message = Toolbox(), 0, None, False, None, None
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    t0 = time.perf_counter()
    try:
        while turns < max_turns:
            forced = {"tool_choice": "required", "parallel_tool_calls": False} \
                if mode == "required-first" and turns == 0 else {}
            reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                                   max_tokens=max_tokens, stream=stream, **forced)
            turns += 1
            if stream:
                message, _ = assemble(reply)
                content, calls = message["content"], [(c["id"], c["function"]["name"], c["function"]["arguments"])
                                                      for c in message.get("tool_calls", [])]
            else:
                message = reply.choices[0].message
                content, calls = message.content, [(c.id, c.function.name, c.function.arguments)
                                                   for c in message.tool_calls or []]
            messages.append(message)  # as OpenAI's guide does: the assistant message, its tool_calls with it
            if not calls:
                final, finished = content, True
                break
            for call_id, name, arguments in calls:
                messages.append({"role": "tool", "tool_call_id": call_id, "content": box.run(name, arguments)})
        else:
            final = content if message is not None else None
    except Exception as e:  # noqa: BLE001 (a client that trips on the server's reply: reported, not raised)
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    return {"finished": finished, "right": finished and right(box.calls, final), "calls": box.calls, "final": final,
            "turns": turns, "seconds": round(seconds, 2), "error": error, "exchanges": exchanges}


def agents_run(base_url: str, model: str, max_turns: int, max_tokens: int, mode: str, stream: bool,
               responses: bool = False) -> dict:
    """The OpenAI Agents SDK over the server's Chat Completions API (`responses`: its default model,
    over the Responses API), temperature 0 (streamed: Runner.run_streamed, its events read to the end)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import AgentsException
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    box, exchanges = Toolbox(), []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city; its temperature is in Celsius.

        Args:
            city: The city's name.
        """
        return box.get_weather(city)

    @function_tool
    def convert_temperature(celsius: float, to: Literal["F", "K"]) -> str:
        """Convert a temperature in Celsius to Fahrenheit (F) or Kelvin (K).

        Args:
            celsius: The temperature in Celsius.
            to: The unit to convert to.
        """
        return box.convert_temperature(celsius, to)

    client = record(AsyncOpenAI(base_url=base_url, api_key=OFFLINE["OPENAI_API_KEY"], max_retries=0, timeout=600),
                    exchanges, responses)
    # required-first: the SDK's reset_tool_choice (on by default) returns to auto once a tool ran
    forced = {"tool_choice": "required", "parallel_tool_calls": False} if mode == "required-first" else {}
    agent = Agent(name="weather", instructions=SYSTEM, tools=[get_weather, convert_temperature],
                  model=(OpenAIResponsesModel if responses else OpenAIChatCompletionsModel)(model=model,
                                                                                            openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=max_tokens, **forced))
    final, finished, error, turns = None, False, None, 0
    t0 = time.perf_counter()
    try:
        if stream:
            async def streamed():
                run = Runner.run_streamed(agent, QUESTION, max_turns=max_turns)
                async for _ in run.stream_events():
                    pass
                return run
            result = asyncio.run(streamed())
        else:
            result = Runner.run_sync(agent, QUESTION, max_turns=max_turns)
        final, finished, turns = result.final_output, True, len(result.raw_responses)
    except AgentsException as e:  # MaxTurnsExceeded, a ModelBehaviorError (a call it cannot read), ...
        error = f"{type(e).__name__}: {e}"
        turns = len(e.run_data.raw_responses) if e.run_data else len(exchanges)
    except Exception as e:  # noqa: BLE001 (as the openai loop's)
        error = f"{type(e).__name__}: {e}"
        turns = len(exchanges)
    seconds = time.perf_counter() - t0
    final = final if final is None or isinstance(final, str) else str(final)
    return {"finished": finished, "right": finished and right(box.calls, final), "calls": box.calls, "final": final,
            "turns": turns, "seconds": round(seconds, 2), "error": error, "exchanges": exchanges}


CLIENTS = {"openai": openai_loop, "agents": agents_run, "agents-responses": functools.partial(agents_run, responses=True)}
MODES = ("auto", "required-first")

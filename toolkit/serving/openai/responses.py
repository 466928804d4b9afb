"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API (what the Agents SDK's
default model, `OpenAIResponsesModel`, and Codex-style clients speak) on the same engine as chat
completions. A Responses body is read as the chat body it means (`chat_body`: the instructions as
a system turn, the previous response's conversation, then the input's items as messages, an
assistant turn's `tool_calls` and `role: tool` results; tools, tool_choice and text.format in their
chat shapes), so the chat template, tool calling (the grammar of a required call, bare JSON calls,
parallel_tool_calls), structured outputs and every limit and 400 are chat's own; the reply comes
back as Responses items and events (the response_items module).

`store` (OpenAI's default: true) keeps a response and its conversation in a bounded store
(`Store`: the least recently stored go first), for `GET /v1/responses/{id}` and for a later
request's `previous_response_id`; an id that is not there (unknown, made with store: false, or
evicted) is a 404 saying so, never a 500. As OpenAI does, a previous response's instructions are
not carried over. Where the server reads reasoning (`--reasoning-parser`), a reply's reasoning is a
`reasoning` item before its message or call, streamed as `response.reasoning_text.delta` events; a
reasoning item sent back as input is that turn's `reasoning_content`. The request's `reasoning`
(effort, summaries) is a 400: tk has no effort to set beyond what the chat template takes
(gpt-oss's `reasoning_effort` is a template variable) and writes no summaries.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict

from tk.toolkit.serving.openai import response_items as items
from tk.runtimes.decoding.rows import FinishReason
from tk.toolkit.serving.openai.api import ApiError, Choice, invalid
from tk.toolkit.serving.openai.edge import documented, endpoint, run_in_threadpool
from tk.toolkit.serving.openai.run import Run

STORE_CAPACITY = 1024  # responses a server keeps
# a chat body's fields in a 400, as the Responses body names them
FIELDS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens"}


class Store:
    """Stored responses by id, at most `capacity` (the oldest out first): each its response object and
    its conversation as chat messages (what a `previous_response_id` continues)."""

    def __init__(self, capacity: int = STORE_CAPACITY):
        self.capacity, self._kept, self._lock = capacity, OrderedDict(), threading.Lock()

    def put(self, ident: str, response: dict, messages: list[dict]) -> None:
        with self._lock:
            self._kept[ident] = (response, messages)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, ident: str, param: str | None = None) -> tuple[dict, list[dict]]:
        with self._lock:
            found = self._kept.get(ident)
        if found is None:
            raise ApiError(404, f"no response {ident!r} is stored on this server (unknown, made with store: false, "
                                f"or evicted: it keeps the last {self.capacity}); send the conversation as input "
                                "instead", param, code="previous_response_not_found" if param else "not_found")
        return found


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def messages(given: list[dict]) -> list[dict]:
    """Responses items (as dicts) as chat messages: a message's text parts joined; function_call items
    as the `tool_calls` of an assistant turn (the one before them where it has none of a tool's
    results after it), function_call_output items as `role: tool` turns; a reasoning item's text as
    the `reasoning_content` of the assistant turn after it (what reasoning templates read)."""
    out: list[dict] = []
    thought = None
    for item in given:
        kind = item.get("type") or "message"
        if kind == "reasoning":
            thought = (thought or "") + "".join(part["text"] for part in item.get("content") or [])
            continue
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and thought is None:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        if thought is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], thought = thought, None
    return out


class Responses:
    """The Responses endpoints of a `Server` (its prepare, schemas' sizes and model), and their store."""

    def __init__(self, server, capacity: int = STORE_CAPACITY):
        from tk.toolkit.serving.openai.responses_schemas import body

        self.server, self.store = server, Store(capacity)
        self.Body = body(server.schemas.sizes)

    def routes(self, keyed: tuple) -> list[tuple]:
        """Both operations, for the API document. (No OpenAPI link from a response's id to its GET: with
        store: false, or a streamed body, there is nothing to follow.)"""
        generation = documented(400, *keyed, 404, 413, 429, 503, stream=True)
        return [("/v1/responses", endpoint("responses", self.create, self.Body), "POST", {"responses": generation}),
                ("/v1/responses/{response_id}", self.get, "GET", {"name": "get_response",
                                                                  "responses": documented(*keyed, 404)})]

    async def get(self, response_id: str):
        return self.store.get(response_id)[0]

    def chat_body(self, body):
        """(the chat body a Responses body means, its conversation as chat messages)."""
        history = self.store.get(body.previous_response_id, "previous_response_id")[1] \
            if body.previous_response_id else []
        given = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else \
            [i.model_dump(by_alias=True, exclude_none=True) for i in body.input]
        conversation = history + messages(given)
        fmt = body.text.format if body.text else None
        chat = {"messages": ([{"role": "system", "content": body.instructions}] if body.instructions is not None
                             else []) + conversation,
                "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                          for t in body.tools] if body.tools else None,
                "tool_choice": body.tool_choice if isinstance(body.tool_choice, (str, type(None))) else
                {"type": "function", "function": {"name": body.tool_choice.name}},
                "parallel_tool_calls": body.parallel_tool_calls, "max_tokens": body.max_output_tokens,
                "response_format": None if fmt is None or fmt.type == "text" else {"type": fmt.type, **(
                    {"json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}
                    if fmt.type == "json_schema" else {})},
                "seed": body.seed, "user": body.user,
                **{k: v for k, v in (("temperature", body.temperature), ("top_p", body.top_p)) if v is not None}}
        try:
            return self.server.schemas.Chat.model_validate(chat), conversation
        except ValueError as e:  # (pydantic's ValidationError) a conversation the chat body cannot take
            err = invalid(e.errors(), self.server.model_name)
            raise ApiError(400, f"input, as chat messages: {err.message}", "input") from None

    def _prepare(self, body, loop, queue):
        chat, conversation = self.chat_body(body)
        try:
            prompts, jobs, calls = self.server.prepare(chat, True, loop, queue)
        except ApiError as e:
            if e.param in FIELDS:  # said of the chat body: say it of this one
                e.message = e.message.replace(f"{e.param}:", f"{FIELDS[e.param]}:", 1)
                e.param = FIELDS[e.param].split(".")[0]
            raise
        reply = Reply(self, body, items.Output(self.server.reasoning.stream(calls, prompts[0].ids)), conversation)
        return Run(jobs, [Choice(0, prompts[0])], queue, len(prompts[0].ids)), reply

    async def create(self, http, body):
        from fastapi.responses import JSONResponse, StreamingResponse

        queue = asyncio.Queue()
        with self.server.batcher.arriving():  # (Arrivals, as the chat endpoint's)
            run, reply = await run_in_threadpool(self._prepare, body, asyncio.get_running_loop(), queue)
        if body.stream:
            watch = asyncio.ensure_future(run.cancel_when_gone(http))
            return StreamingResponse(self._events(run, reply, watch), media_type="text/event-stream")
        if not await run.collect(http):
            return None
        run.raise_failure()
        c = run.choices[0]
        reply.output.feed(c.text, True, incomplete=c.reason == FinishReason.LENGTH)
        return JSONResponse(reply.done(c, run.usage()))

    async def _events(self, run: Run, reply: "Reply", watch):
        try:
            yield reply.event({"type": "response.created", "response": reply.snapshot("in_progress")})
            yield reply.event({"type": "response.in_progress", "response": reply.snapshot("in_progress")})
            while run.pending:
                index, piece, event = await run.queue.get()
                run.take(index, piece, event)
                c = run.choices[0]
                if event.token is None and not event.finish_reason.completed:
                    error = run.failure(index)
                    yield reply.event({"type": "response.failed", "response": reply.snapshot(
                        "failed", error={"code": "server_error", "message": error.message})})
                    break
                for e in reply.output.feed(piece, event.token is None, incomplete=c.reason == FinishReason.LENGTH):
                    yield reply.event(e)
            else:
                done = reply.done(run.choices[0], run.usage())
                yield reply.event({"type": f"response.{done['status']}", "response": done})
        finally:  # the client went away mid-stream (or the stream ended): its slot is freed
            watch.cancel()
            run.cancel()


class Reply:
    """One response being made: its id, its Output, its events' sequence numbers, and what is stored."""

    def __init__(self, api: Responses, body, output: items.Output, conversation: list[dict]):
        self.api, self.body, self.output, self.conversation = api, body, output, conversation
        self.ident, self.created, self.sequence = items.new_id("resp"), time.time(), 0

    def snapshot(self, status: str, output: list[dict] | None = None, usage: dict | None = None,
                 error: dict | None = None) -> dict:
        return items.response(self.ident, self.api.server.model_name, self.body, status=status,
                              output=output or [], usage=usage, created=self.created, error=error)

    def event(self, event: dict) -> str:
        self.sequence += 1
        return items.event_text({**event, "sequence_number": self.sequence - 1})

    def done(self, c: Choice, usage: dict) -> dict:
        """The finished response (stored where the body says store)."""
        status = "incomplete" if c.reason == FinishReason.LENGTH else "completed"
        # reasoning tokens: its text's, encoded again (the parser reads text; its markers are not counted)
        thought = "".join(p["text"] for i in self.output.items if i["type"] == "reasoning" for p in i["content"])
        reasoning = len(self.api.server.tokenizer.encode(thought, False)) if thought else 0
        out = self.snapshot(status, self.output.items, items.usage(usage["prompt_tokens"], usage["completion_tokens"],
                                                                   reasoning))
        if self.body.store:
            self.api.store.put(self.ident, out, self.conversation + messages(self.output.items))
        return out


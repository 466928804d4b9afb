"""`tk serve`'s routes: the OpenAI API over the continuous batcher, as a FastAPI app (`Server.app`).

`POST /v1/completions` and `/v1/chat/completions` (the artifact's chat template), `stream: true`
as server-sent events, OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`: the
responses module, over the same preparation), vLLM's `POST /tokenize`, `/detokenize` and `GET
/tokenizer_info`, `GET /v1/models`, `/health` and Prometheus `/metrics`. Bodies are the schemas module's pydantic models
(validated by FastAPI, documented in /openapi.json); prompts are tokenized, grammars compiled and
jobs submitted on a worker thread; each choice becomes one batcher job (`HttpJob`; the front end's
`Job`: its `Request`, text, stop strings and metrics), whose events the batcher's thread hands to
the event loop. The edge limits bodies, checks the API key and counts requests by route. Errors
are OpenAI's JSON shape (400 naming the field, 401, 404, 413, 429, 503); a client that goes away
cancels its request. The response shapes are the api module's. The process around the app
(loading, the socket, uvicorn, signals) is the process module's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Union

from tk.models.spec.errors import TkError, UsageProblem
from tk.runtimes.base import InputError
from tk.runtimes.serving.batching import Batcher, BatcherClosed, QueueFull
from tk.toolkit.serving.openai import api
from tk.toolkit.serving.openai import structured
from tk.toolkit.serving.openai.api import ApiError
from tk.toolkit.serving.openai.calling import Calls, ToolCalling
from tk.toolkit.serving.openai.edge import (DEFAULT_BODY_LIMIT, BodyLimit, CountRequests, PrometheusMetrics,
                                            bearer_check, documented, endpoint, run_in_threadpool)
from tk.toolkit.serving.openai.reasoning import Reasoning
from tk.toolkit.serving.openai.responses import Responses
from tk.toolkit.serving.openai.run import HttpJob, Run
from tk.toolkit.textgen import Tokenizer
from tk.toolkit.versions import package_version

MISSING = "the serving stack is not installed; pip install 'tk[serve]' (fastapi, uvicorn, prometheus-client)"


def require() -> None:
    """UsageProblem unless the serving stack is installed."""
    try:
        import fastapi, prometheus_client, uvicorn  # noqa: F401, E401 (what tk[serve] installs)
    except ImportError:
        raise UsageProblem(MISSING) from None


def _handle_errors(app, model_name: str) -> None:
    """Every error in OpenAI's JSON shape."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def invalid_body(request, exc: RequestValidationError):
        err = api.invalid(list(exc.errors()), model_name)
        return JSONResponse(err.body(), status_code=err.status)

    async def bug(request, exc: Exception):  # its traceback goes to the log (Starlette re-raises it)
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(),
                            status_code=500)

    async def http_error(request, exc: HTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=exc.headers)  # a 405's Allow

    for kind, handler in ((ApiError, api_error), (RequestValidationError, invalid_body), (Exception, bug),
                          (HTTPException, http_error)):
        app.add_exception_handler(kind, handler)


class Server:
    """The FastAPI app over one batcher (`app`); the process module serves it."""

    def __init__(self, batcher: Batcher, tokenizer: Tokenizer, model_name: str, *, drain_s: float = 10.0,
                 api_key: str | None = None, max_body: int = DEFAULT_BODY_LIMIT, tool_parser: str | None = None,
                 bare_tool_calls: bool | None = None, reasoning_parser: str | None = None):
        require()
        from tk.toolkit.serving.openai.schemas import schemas  # (pydantic: once the serving stack is known there)

        self.batcher, self.tokenizer, self.model_name, self.drain_s = batcher, tokenizer, model_name, drain_s
        self.api_key, self.max_body = api_key, max_body
        self.created = int(time.time())
        limits = batcher.limits
        self.schemas = schemas(model_name, batcher.runtime.dims.vocab_size, batcher.runtime.max_context,
                               api.max_choices(limits.slots + limits.max_queue))
        self.metrics = PrometheusMetrics(batcher)
        self.constraints = structured.Compiler(tokenizer, batcher.runtime.dims.vocab_size, sorted(batcher.eos))
        self.tools = ToolCalling(tokenizer, tool_parser, bare_tool_calls)
        self.reasoning = Reasoning(tokenizer, reasoning_parser)
        self.responses = Responses(self)
        self.app = self._app()

    # --- the app ---

    def _app(self):
        from fastapi import Depends, FastAPI

        app = FastAPI(title="tk serve", version=package_version("tk") or "unknown",
                      description="The OpenAI API over tk's continuous batcher")
        _handle_errors(app, self.model_name)
        app.add_middleware(BodyLimit, limit=self.max_body)  # before anything reads the body
        app.add_middleware(CountRequests, counter=self.metrics.requests)  # outermost: counts the 413s too
        guard = [Depends(bearer_check(self.api_key))] if self.api_key else []
        for path, endpoint, method, options in self._routes((401,) if self.api_key else ()):
            app.add_api_route(path, endpoint, methods=[method], dependencies=guard if path != "/health" else None,
                              **options)

        def openapi() -> dict:  # FastAPI's, its bounds as the schemas give them and no 422 (invalid bodies get 400s)
            if app.openapi_schema is None:
                app.openapi_schema = _as_served(FastAPI.openapi(app))
            return app.openapi_schema
        app.openapi = openapi
        return app

    def _routes(self, keyed: tuple) -> list[tuple]:
        """(path, endpoint, method, options) of every endpoint, in the API document's order; every
        one but /health (which load balancers probe) needs the API key where there is one."""
        from fastapi.responses import PlainTextResponse

        S, info, tokens = self.schemas, documented(*keyed), documented(400, *keyed, 413)
        generation = documented(400, *keyed, 413, 429, 503, stream=True)
        return [
            ("/health", self._health, "GET", {"name": "health"}),
            ("/metrics", self._scrape, "GET", {"name": "metrics", "responses": info,
                                                "response_class": PlainTextResponse}),
            ("/v1/models", self._models, "GET", {"name": "models", "responses": info}),
            ("/v1/completions", endpoint("completions", lambda http, body: self._generate(http, body, False),
                                          S.Completion), "POST", {"responses": generation}),
            ("/v1/chat/completions", endpoint("chat", lambda http, body: self._generate(http, body, True), S.Chat),
             "POST", {"responses": generation}),
            ("/tokenize", endpoint("tokenize", lambda http, body: run_in_threadpool(self._tokenize, body),
                                    Union[S.TokenizeChat, S.Tokenize]), "POST", {"responses": tokens}),
            ("/detokenize", endpoint("detokenize", self._detokenize, S.Detokenize), "POST", {"responses": tokens}),
            *self.responses.routes(keyed),
            ("/tokenizer_info", self._tokenizer_info, "GET", {"name": "tokenizer_info", "responses": info}),
        ]

    # (the GET endpoints have no docstrings: FastAPI would publish them as the operations' descriptions)

    async def _health(self):
        from fastapi.responses import JSONResponse

        ok = self.batcher.alive
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    async def _scrape(self):
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "tk", "max_model_len": self.batcher.runtime.max_context}]}

    async def _tokenizer_info(self):
        return self.tokenizer.info(self.batcher.runtime.max_context)

    async def _detokenize(self, http, body):
        return {"prompt": await run_in_threadpool(self.tokenizer.decode, body.tokens, False)}

    def _tokenize(self, body) -> dict:
        """vLLM's /tokenize: a prompt's ids (or a conversation's, through the chat template)."""
        try:
            if hasattr(body, "messages"):
                tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
                ids = self.tokenizer.chat_messages(api.messages(body.messages), body.add_generation_prompt, tools,
                                                   body.chat_template_kwargs)
            else:
                ids = self.tokenizer.encode(body.prompt, body.add_special_tokens)
        except InputError as e:
            raise ApiError(400, str(e), "messages" if hasattr(body, "messages") else "prompt") from None
        strs = self.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None  # vLLM's: raw tokens
        return {"count": len(ids), "max_model_len": self.batcher.runtime.max_context, "tokens": ids,
                "token_strs": strs}

    def prepare(self, body, chat: bool, loop, queue) -> tuple[list[api.Prompt], list[HttpJob], Calls | None]:
        """The request's prompts, its jobs, submitted, and its tool calling (on a worker thread:
        tokenizing, chat templates, compiling a grammar and starting its matchers take time the
        event loop must not spend). The batcher's submit checks each prompt."""
        calls = self.tools.request(body) if chat else None
        prompts = api.prompts(body, chat, self.tokenizer, calls.template_tools if calls else None)
        constraint = self.constraints.compile(body, calls.grammar if calls else None)
        if constraint is not None and chat and self.reasoning.thinks_first(prompts[0].ids):
            field = "tool_choice" if calls is not None and calls.grammar else structured.requested(body)[0]
            raise ApiError(400, f"{field}: this model's reply begins in its reasoning (its chat template opens a "
                                "<think> block), which a grammar would hold instead of the answer; send "
                                "chat_template_kwargs {\"enable_thinking\": false}, or leave the constraint out", field)
        limits = self.batcher.limits
        if problem := api.choices_problem(len(prompts) * body.n, limits.slots + limits.max_queue):
            raise ApiError(400, problem, "n")
        if problem := api.echo_problem(body, chat, self.batcher.runtime):
            raise ApiError(400, problem, "echo")
        jobs, special = [], chat and (calls is not None and calls.keep_special or self.reasoning.keep_special)
        try:
            for i, prompt in enumerate(prompts):
                params = api.params(body, chat, len(prompt.ids), self.batcher.runtime.max_context, constraint,
                                    special_tokens=special)
                jobs += [HttpJob(self.batcher, prompt.ids, params, tokenizer=self.tokenizer, metrics=self.metrics,
                                 loop=loop, queue=queue, index=i * body.n + j, choice=j) for j in range(body.n)]
            self._submit(jobs)
        except InputError as e:  # the prompt (and max_tokens) do not fit, a token id is out of range, ...
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        except TkError as e:  # a sampling value the schema let through
            raise ApiError(400, str(e)) from None
        return prompts, jobs, calls

    async def _generate(self, http, body, chat: bool):
        from fastapi.responses import JSONResponse, StreamingResponse

        queue = asyncio.Queue()
        with self.batcher.arriving():  # an idle batcher waits for a burst's requests (Arrivals)
            prompts, jobs, calls = await run_in_threadpool(self.prepare, body, chat, asyncio.get_running_loop(), queue)
        readers = [self.reasoning.stream(calls, p.ids) if chat else None for p in prompts for _ in range(body.n)]
        choices = [api.Choice(job.index, prompts[job.index // body.n], parsing=readers[job.index]) for job in jobs]
        reply = api.Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", self.model_name, chat, body,
                          self.tokenizer, reasoning=self.reasoning.parser is not None)
        run = Run(jobs, choices, queue, sum(len(p.ids) for p in prompts))
        if body.stream:
            options = body.stream_options
            watch = asyncio.ensure_future(run.cancel_when_gone(http))  # even before the stream starts
            return StreamingResponse(run.chat_events(reply, options, watch), media_type="text/event-stream")
        return JSONResponse(await self._complete(http, run, reply))

    @staticmethod
    def _submit(jobs: list[HttpJob]) -> None:
        """All of a request's choices, or none (a refused one cancels those before it): a full queue
        is a 429, a closing batcher a 503, a prompt no slot can take its InputError."""
        try:
            for job in jobs:
                job.submit()
        except (QueueFull, BatcherClosed, InputError) as e:
            for job in jobs:
                job.cancel()
            if isinstance(e, QueueFull):
                raise ApiError(429, str(e), kind="requests", code="rate_limit_exceeded") from None
            if isinstance(e, BatcherClosed):
                raise ApiError(503, str(e), kind="server_error") from None
            raise

    async def _complete(self, http, run: Run, reply: api.Reply):
        if not await run.collect(http):  # the client went away: nobody to answer
            return None
        run.raise_failure()  # the response's texts are decoded off the event loop
        return await run_in_threadpool(reply.complete, run.choices, run.prompt_scores(), run.usage())

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _as_served(doc: dict) -> dict:
    """FastAPI's /openapi.json as this server answers: without the 422 (and its schemas) FastAPI declares for
    every body, which `_handle_errors` answers with OpenAI's 400, and with whole bounds (`_whole_bounds`)."""
    for operation in (op for path in doc.get("paths", {}).values() for op in path.values()):
        operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        doc.get("components", {}).get("schemas", {}).pop(name, None)
    return _whole_bounds(doc)


def _whole_bounds(schema):
    """/openapi.json with its whole-number bounds written as integers. FastAPI's OpenAPI model holds every
    bound as a float, and a float's shortest text is not always its value: 2**63 is written 9.223372036854776e+18,
    which a reader takes for 9223372036854776000 (schemathesis did: it sent seeds the server refuses). Exact for
    bounds a float holds exactly (the schemas' are: the seed's is `lt=2**63`, not `le=2**63 - 1`)."""
    if isinstance(schema, dict):
        return {k: int(v) if k in _BOUNDS and isinstance(v, float) and v.is_integer() else _whole_bounds(v)
                for k, v in schema.items()}
    return [_whole_bounds(v) for v in schema] if isinstance(schema, list) else schema

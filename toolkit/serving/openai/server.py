"""`tk serve`: the OpenAI API over the continuous batcher, on FastAPI and uvicorn.

`POST /v1/completions` and `/v1/chat/completions` (the artifact's chat template), `stream: true`
as server-sent events, vLLM's `POST /tokenize`, `/detokenize` and `GET /tokenizer_info`, `GET
/v1/models`, `/health` and Prometheus `/metrics`. Bodies are openai_schemas.py's pydantic models
(validated by FastAPI, documented in /openapi.json); prompts are tokenized and grammars compiled
on a worker thread; each choice becomes one batcher job (openai_run.py; frontend.py: its
`Request`, text, stop strings and metrics), whose events the batcher's thread hands to the event
loop. The edge (edge.py) limits bodies, checks the API key and counts requests by route. Errors
are OpenAI's JSON shape (400 naming the field, 401, 413, 429, 503); a client that goes away
cancels its request. The response shapes are openai_api.py's.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Union

from tk.models.spec.errors import TkError, UsageProblem
from tk.runtimes.base import InputError
from tk.runtimes.serving.batching import DEFAULT_PREFIX_CACHE_BYTES, Batcher, BatcherClosed, QueueFull
from tk.runtimes.cache_layouts import slots_problem
from tk.runtimes.decoding.rows import FinishReason
from tk.toolkit.serving import frontend
from tk.toolkit.serving.openai import structured
from tk.toolkit.serving.openai import api as openai_api
from tk.toolkit.serving.openai.edge import (DEFAULT_BODY_LIMIT, BodyLimit, CountRequests, PrometheusMetrics, bearer_check,
                                     documented)
from tk.toolkit.serving.openai.api import ApiError
from tk.toolkit.serving.openai.run import HttpJob, Run
from tk.toolkit.serving.openai.schemas import schemas
from tk.toolkit.textgen import Tokenizer

MISSING = "the serving stack is not installed; pip install 'tk[serve]' (fastapi, uvicorn, prometheus-client)"


def _require():
    try:
        import fastapi, prometheus_client, uvicorn  # noqa: F401, E401 (what tk[serve] installs)
    except ImportError:
        raise UsageProblem(MISSING) from None


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("tk")
    except metadata.PackageNotFoundError:
        return "unknown"


async def run_in_threadpool(fn, *args):
    """`fn(*args)` on Starlette's worker threads (imported here: the serving stack is optional)."""
    from starlette.concurrency import run_in_threadpool as run

    return await run(fn, *args)


def _typed(endpoint, **annotations):
    """An endpoint whose parameters take these types, before FastAPI reads its signature (the body
    schemas are built at run time, and this module's annotations are strings that FastAPI would
    resolve in the module's globals)."""
    names = endpoint.__code__.co_varnames[:endpoint.__code__.co_argcount]
    endpoint.__annotations__.update({k: v for k, v in annotations.items() if k in names})
    return endpoint


class Server:
    """The FastAPI app over one batcher: `app`; `run(sock)` serves until interrupted."""

    def __init__(self, batcher: Batcher, tokenizer: Tokenizer, model_name: str, drain_s: float = 10.0,
                 api_key: str | None = None, max_body: int = DEFAULT_BODY_LIMIT):
        _require()
        self.batcher, self.tokenizer, self.model_name, self.drain_s = batcher, tokenizer, model_name, drain_s
        self.api_key, self.max_body = api_key, max_body
        self.created = int(time.time())
        self.schemas = schemas(model_name, batcher.runtime.dims.vocab_size, batcher.runtime.max_context)
        self.metrics = PrometheusMetrics(batcher)
        self.constraints = structured.Compiler(tokenizer, batcher.runtime.dims.vocab_size, sorted(batcher.eos))
        self.app = self._app()

    # --- the app ---

    def _app(self):
        from fastapi import Depends, FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse, Response
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.exceptions import HTTPException

        app = FastAPI(title="tk serve", version=_version(), description="The OpenAI API over tk's continuous batcher")
        S = self.schemas

        @app.exception_handler(ApiError)
        async def api_error(request, exc: ApiError):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(RequestValidationError)
        async def invalid_body(request, exc: RequestValidationError):
            err = openai_api.invalid(list(exc.errors()), self.model_name)
            return JSONResponse(err.body(), status_code=err.status)

        @app.exception_handler(Exception)  # a bug: its traceback goes to the log (Starlette re-raises it)
        async def bug(request, exc: Exception):
            return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(),
                                status_code=500)

        @app.exception_handler(HTTPException)
        async def http_error(request, exc: HTTPException):
            return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                                headers=exc.headers)  # a 405's Allow

        app.add_middleware(BodyLimit, limit=self.max_body)  # before anything reads the body
        app.add_middleware(CountRequests, counter=self.metrics.requests)  # outermost: counts the 413s too
        guard = [Depends(bearer_check(self.api_key))] if self.api_key else []
        keyed = (401,) if self.api_key else ()

        @app.get("/health")  # open even with an API key: load balancers probe it
        async def health():
            ok = self.batcher.alive
            return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

        @app.get("/metrics", dependencies=guard, responses=documented(*keyed), response_class=PlainTextResponse)
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models", dependencies=guard, responses=documented(*keyed))
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "tk", "max_model_len": self.batcher.runtime.max_context}]}

        async def completions(request: Request, body):
            return await self._generate(request, body, False)

        async def chat(request: Request, body):
            return await self._generate(request, body, True)

        async def tokenize(body):
            return await run_in_threadpool(self._tokenize, body)

        async def detokenize(body):
            return {"prompt": await run_in_threadpool(self.tokenizer.decode, body.tokens, False)}

        generation = documented(400, *keyed, 413, 429, 503, stream=True)
        for path, endpoint, schema, responses in (
                ("/v1/completions", completions, S.Completion, generation),
                ("/v1/chat/completions", chat, S.Chat, generation),
                ("/tokenize", tokenize, Union[S.TokenizeChat, S.Tokenize], documented(400, *keyed, 413)),
                ("/detokenize", detokenize, S.Detokenize, documented(400, *keyed, 413))):
            app.add_api_route(path, _typed(endpoint, body=schema, request=Request), methods=["POST"],
                              dependencies=guard, responses=responses)

        @app.get("/tokenizer_info", dependencies=guard, responses=documented(*keyed))
        async def tokenizer_info():
            return self.tokenizer.info(self.batcher.runtime.max_context)

        return app

    def _tokenize(self, body) -> dict:
        """vLLM's /tokenize: a prompt's ids (or a conversation's, through the chat template)."""
        try:
            if hasattr(body, "messages"):
                ids = self.tokenizer.chat_messages(openai_api.messages(body.messages), body.add_generation_prompt)
            else:
                ids = self.tokenizer.encode(body.prompt, body.add_special_tokens)
        except InputError as e:
            raise ApiError(400, str(e), "messages" if hasattr(body, "messages") else "prompt") from None
        strs = self.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None  # vLLM's: raw tokens
        return {"count": len(ids), "max_model_len": self.batcher.runtime.max_context, "tokens": ids,
                "token_strs": strs}

    def _prepare(self, body, chat: bool, loop, queue) -> tuple[list[openai_api.Prompt], list[HttpJob]]:
        """The request's prompts and its jobs, each prompt checked before any runs (on a worker
        thread: tokenizing, chat templates, compiling a grammar and starting its matchers take time
        the event loop must not spend)."""
        prompts, constraint = openai_api.prompts(body, chat, self.tokenizer), self.constraints.compile(body)
        if problem := openai_api.choices_problem(len(prompts) * body.n, self.batcher.slots + self.batcher.max_queue):
            raise ApiError(400, problem, "n")
        if problem := openai_api.echo_problem(body, chat, self.batcher.runtime):
            raise ApiError(400, problem, "echo")
        jobs = []
        try:
            for i, prompt in enumerate(prompts):
                params = openai_api.params(body, chat, len(prompt.ids), self.batcher.runtime.max_context, constraint)
                self.batcher.check(prompt.ids, params.max_tokens, params.prompt_logprobs is not None)
                jobs += [HttpJob(self.batcher, prompt.ids, params, self.tokenizer, self.metrics, loop, queue,
                                 i * body.n + j, j) for j in range(body.n)]
        except InputError as e:  # the prompt (and max_tokens) do not fit, a token id is out of range, ...
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        except TkError as e:  # a sampling value the schema let through
            raise ApiError(400, str(e)) from None
        return prompts, jobs

    async def _generate(self, http, body, chat: bool):
        from fastapi.responses import JSONResponse, StreamingResponse

        queue = asyncio.Queue()
        prompts, jobs = await run_in_threadpool(self._prepare, body, chat, asyncio.get_running_loop(), queue)
        self._submit(jobs)
        choices = [openai_api.Choice(job.index, prompts[job.index // body.n]) for job in jobs]
        reply = openai_api.Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", self.model_name, chat, body,
                                 self.tokenizer)
        run = Run(jobs, choices, queue, sum(len(p.ids) for p in prompts))
        if body.stream:
            options = body.stream_options
            watch = asyncio.ensure_future(self._cancel_when_gone(http, run))  # even before the stream starts
            return StreamingResponse(self._events(run, reply, options, watch), media_type="text/event-stream")
        return JSONResponse(await self._complete(http, run, reply))

    def _submit(self, jobs: list[HttpJob]) -> None:
        """All of a request's choices, or none (a full queue or a closing batcher refuses the rest)."""
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
            raise ApiError(400, str(e), "prompt") from None

    async def _complete(self, http, run: Run, reply: openai_api.Reply):
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            while run.pending:
                getter = asyncio.ensure_future(run.queue.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the client went away: nobody to answer
                    getter.cancel()
                    run.cancel()
                    return None
                run.take(*getter.result())
        except asyncio.CancelledError:  # the server stops (uvicorn cancels its handlers): so do the choices
            run.cancel()
            raise
        finally:
            gone.cancel()
        run.raise_failure()  # the response's texts are decoded off the event loop
        return await run_in_threadpool(reply.complete, run.choices, run.prompt_scores(), run.usage())

    async def _cancel_when_gone(self, http, run: Run) -> None:
        await _disconnected(http)
        run.cancel()

    async def _events(self, run: Run, reply: openai_api.Reply, options, watch):
        usage_at_end = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage_stats
        try:
            if reply.chat:
                for c in run.choices:
                    yield reply.role(c.index)
            while run.pending:
                index, piece, event = await run.queue.get()
                c = run.choices[index]
                if reply.echo and not c.echoed:  # before its first event: the prompt's scores are in
                    head, scores, ids = reply.head(c, run.jobs[index].request.prompt_scores)
                    c.echoed = True
                    yield reply.chunk(c, head, None, [], ids, scores, prompt=True)
                run.take(index, piece, event)
                if event.token is None and not event.finish_reason.completed:
                    yield openai_api.sse(run.failure(index).body())
                    run.cancel()
                    break
                usage = run.usage() if continuous else None
                if event.token is None:
                    eos = [] if c.eos is None else [c.eos]
                    yield reply.chunk(c, piece, event.finish_reason, c.before(), eos, c.scores[-1:] if eos
                                      else [], usage)
                elif piece or reply.token_ids or reply.logprobs:
                    yield reply.chunk(c, piece, None, c.before(1), [event.token], [event.logprob], usage)
            else:
                if usage_at_end:
                    yield reply.usage_chunk(run.usage())
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream (or the stream ended): its slots are freed
            watch.cancel()
            run.cancel()

    # --- running ---

    def _config(self):
        import uvicorn

        return uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=self.drain_s, lifespan="on")

    def run(self, sock) -> None:
        """Serve on a bound socket until SIGINT/SIGTERM (main thread); in-flight requests get
        `drain_s` to finish, then the rest are cancelled, and this returns."""
        import uvicorn

        def stopped(sig, frame):  # uvicorn shuts down gracefully, then re-raises the signal it caught
            raise _Stopped
        gc.collect()
        gc.freeze()  # the loaded heap (tokenizer, schemas, runtime) is never garbage: no GC pass walks it (vLLM's too)
        server = uvicorn.Server(self._config())
        handlers = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[sock])
        except _Stopped:
            pass
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            self.batcher.close(timeout=self.drain_s)

    @contextmanager
    def in_thread(self, host: str = "127.0.0.1", port: int = 0):
        """Serve on a background thread (tests, benchmarks) -> the base URL; stop on exit."""
        import uvicorn

        sock = bind(host, port)
        server = uvicorn.Server(self._config())
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started and thread.is_alive():
            time.sleep(0.01)
        try:
            yield f"http://{host}:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join()
            sock.close()


class _Stopped(Exception):
    """A stop signal, once uvicorn has shut down."""


async def _disconnected(request) -> None:
    """Returns when the client of a request whose body was read disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def bind(host: str, port: int):
    """A listening TCP socket (port 0: a free one), or a one-line error."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageProblem(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port or --host") from None
    sock.listen(2048)
    return sock


@dataclass(frozen=True)
class ServeOptions:
    """How `tk serve` listens and what it takes: its address, the batcher's limits and budgets (Batcher's
    arguments), the name clients send, the drain at shutdown, the API key (None: none) and the body limit."""

    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 8
    max_queue: int = 64
    model_name: str | None = None
    drain_s: float = 10.0
    api_key: str | None = None
    max_body: int = DEFAULT_BODY_LIMIT
    step_tokens: int | None = None  # None: the batcher's default
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # 0: no prefix cache


def open_server(artifact, backend: str, backend_options, options: ServeOptions = ServeOptions()):
    """Load the artifact on the backend, its tokenizer (transformers' too: no request waits for it),
    start its batcher and bind the socket: (Server, socket). Everything that can fail (a missing
    package, a dynamic-cache artifact, a busy port) fails here, before the server says it listens."""
    import dataclasses
    from pathlib import Path

    from tk.models.spec.manifest import Manifest
    from tk.toolkit.backends import open_runtime

    _require()
    artifact = Path(artifact)
    manifest = Manifest.read(artifact)
    if problem := slots_problem(manifest.dims):
        raise UsageProblem(f"{artifact}: {problem}")
    tokenizer = Tokenizer(artifact)
    tokenizer.hf  # noqa: B018  (loaded now, not on the first chat request's event loop)
    runtime = open_runtime(artifact, backend, dataclasses.replace(backend_options, static_cache=True))
    sock = bind(options.host, options.port)
    try:
        batcher = Batcher(runtime, options.slots, options.max_queue, manifest.eos_token_ids, options.step_tokens,
                          options.prefix_cache_bytes).start()
    except BaseException:
        sock.close()
        raise
    name = options.model_name or artifact.resolve().name
    return Server(batcher, tokenizer, name, options.drain_s, options.api_key, options.max_body), sock

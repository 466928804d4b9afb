"""`tk serve`: the OpenAI API over the continuous batcher, on FastAPI and uvicorn.

`POST /v1/completions` and `/v1/chat/completions` (the artifact's chat template), `stream: true`
as server-sent events, `GET /v1/models`, `/health` and Prometheus `/metrics`. Each HTTP request
becomes one job (toolkit/serving/frontend.py: its batcher `Request`, its text and stop strings,
its metrics), whose pieces of text the batcher's thread hands to the event loop. Errors are
OpenAI's JSON shape: 400 naming the field, 429 when the queue is full, 503 while shutting down.
A client that goes away cancels its request, which frees its slot before the next step. The
API's shapes are toolkit/serving/openai_api.py's.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from contextlib import contextmanager

from tk.models.errors import TkError, UsageProblem
from tk.runtimes.base import InputError
from tk.runtimes.batching import Batcher, BatcherClosed, QueueFull
from tk.runtimes.cache_layouts import slots_problem
from tk.runtimes.rows import FinishReason
from tk.toolkit.serving import frontend, openai_api
from tk.toolkit.serving.frontend import METRICS
from tk.toolkit.serving.openai_api import ApiError
from tk.toolkit.textgen import Tokenizer

MISSING = "the serving stack is not installed; pip install 'tk[serve]' (fastapi, uvicorn, prometheus-client)"


def _require():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageProblem(MISSING) from None


class _HttpJob(frontend.Job):
    """One HTTP request's generation: its pieces of text go to the event loop's queue."""

    def __init__(self, server: "Server", prompt: list[int], params: frontend.Params, loop: asyncio.AbstractEventLoop):
        super().__init__(server.batcher, prompt, params, server.tokenizer, server.metrics)
        self.loop, self.queue = loop, asyncio.Queue()

    def deliver(self, piece, event) -> None:  # the batcher's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (piece, event.token, event.finish_reason))


class _Prometheus(frontend.Metrics):
    """The server's metrics (frontend.METRICS' names) in a registry of its own."""

    def __init__(self, batcher: Batcher):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        Gauge("tk_queue_depth", METRICS["tk_queue_depth"], registry=reg).set_function(lambda: batcher.waiting)
        Gauge("tk_active_slots", METRICS["tk_active_slots"], registry=reg).set_function(lambda: batcher.running)
        Gauge("tk_slots", METRICS["tk_slots"], registry=reg).set(batcher.slots)
        counter = lambda name, *labels: Counter(name, METRICS[name], labels, registry=reg)  # noqa: E731
        buckets = frontend.LATENCY_BUCKETS
        histogram = lambda name: Histogram(name, METRICS[name], buckets=buckets, registry=reg)  # noqa: E731
        self.requests = counter("tk_requests", "endpoint", "status")
        self.reasons = counter("tk_requests_finished", "reason")
        self.prompt, self.generated = counter("tk_prompt_tokens"), counter("tk_generation_tokens")
        self.ttft, self.itl = histogram("tk_time_to_first_token_seconds"), histogram("tk_inter_token_latency_seconds")

    def submitted(self, prompt_tokens: int) -> None:
        self.prompt.inc(prompt_tokens)

    def token(self, first: bool, seconds: float) -> None:
        (self.ttft if first else self.itl).observe(seconds)
        self.generated.inc()

    def finished(self, reason: FinishReason, tokens: int) -> None:
        self.reasons.labels(reason.value).inc()


class Server:
    """The FastAPI app over one batcher: `app`; `run(host, port)` serves until interrupted."""

    def __init__(self, batcher: Batcher, tokenizer: Tokenizer, model_name: str, drain_s: float = 10.0):
        _require()
        self.batcher, self.tokenizer, self.model_name, self.drain_s = batcher, tokenizer, model_name, drain_s
        self.created = int(time.time())
        self.Completion, self.Chat = openai_api.schemas()
        self.metrics = _Prometheus(batcher)
        self.app = self._app()

    def default_max_tokens(self, body, prompt_len: int) -> int:
        """OpenAI's defaults: 16 for completions, the rest of the context for chat."""
        return 16 if isinstance(body, self.Completion) else max(1, self.batcher.runtime.max_context - prompt_len)

    def params(self, body, prompt_len: int) -> frontend.Params:
        """The body's generation parameters, OpenAI's defaults where it gives none."""
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        budget = body.max_completion_tokens or body.max_tokens or self.default_max_tokens(body, prompt_len)
        return frontend.Params(max_tokens=budget, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                               repetition_penalty=body.repetition_penalty, seed=body.seed,
                               ignore_eos=body.ignore_eos, stop=stops)

    # --- the app ---

    def _app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response, StreamingResponse
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.exceptions import HTTPException

        app = FastAPI(title="tk serve")

        @app.exception_handler(ApiError)
        async def api_error(request, exc: ApiError):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(HTTPException)
        async def http_error(request, exc: HTTPException):
            return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

        app.add_middleware(_CountRequests, counter=self.metrics.requests)

        @app.get("/health")
        async def health():
            ok = self.batcher.alive
            return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "tk", "max_model_len": self.batcher.runtime.max_context}]}

        async def completions(request):  # Starlette routes: the body is parsed here, errors are 400s
            return await self._generate(request, self.Completion, False, StreamingResponse, JSONResponse)

        async def chat(request):
            return await self._generate(request, self.Chat, True, StreamingResponse, JSONResponse)

        app.add_route("/v1/completions", completions, methods=["POST"])
        app.add_route("/v1/chat/completions", chat, methods=["POST"])

        return app

    async def _generate(self, request, schema, chat: bool, stream_cls, json_cls):
        body = openai_api.parse(await request.body(), schema, self.model_name)
        prompt = openai_api.prompt_ids(body, chat, self.tokenizer)
        try:
            job = _HttpJob(self, prompt, self.params(body, len(prompt)), asyncio.get_running_loop())
        except TkError as e:  # a sampling value the schema let through
            raise ApiError(400, str(e)) from None
        try:
            job.submit()
        except QueueFull as e:
            raise ApiError(429, str(e), kind="requests", code="rate_limit_exceeded") from None
        except BatcherClosed as e:
            raise ApiError(503, str(e), kind="server_error") from None
        except InputError as e:  # the prompt (and max_tokens) do not fit, or a token id is out of range
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        reply = openai_api.Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", self.model_name, chat,
                                 body.return_token_ids)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            watch = asyncio.ensure_future(self._cancel_when_gone(request, job))  # even before the stream starts
            return stream_cls(self._events(job, reply, usage, watch), media_type="text/event-stream")
        return json_cls(await self._complete(request, job, reply))

    def _usage(self, job: _HttpJob) -> dict:
        return openai_api.Reply.usage(len(job.prompt), len(job.request.tokens))

    async def _complete(self, http, job: _HttpJob, reply: openai_api.Reply):
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            while True:
                getter = asyncio.ensure_future(job.queue.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the client went away: nobody to answer
                    getter.cancel()
                    job.cancel()
                    return None
                reason = getter.result()[2]
                if reason is not None:
                    break
        finally:
            gone.cancel()
        if reason == FinishReason.ERROR:
            raise ApiError(500, f"the batcher failed this request: {job.request.error}", kind="server_error")
        return reply.complete(job.text.text, reason, list(job.request.tokens), self._usage(job))

    async def _cancel_when_gone(self, http, job: _HttpJob) -> None:
        await _disconnected(http)
        job.cancel()

    async def _events(self, job: _HttpJob, reply: openai_api.Reply, usage: bool, watch):
        try:
            if reply.chat:
                yield reply.role()
            while True:
                text, token, reason = await job.queue.get()
                if reason == FinishReason.ERROR:
                    yield openai_api.sse(ApiError(500, job.request.error or "error", kind="server_error").body())
                    break
                if reason is not None:
                    yield reply.chunk(text, reason, [])
                    if usage:
                        yield reply.usage_chunk(self._usage(job))
                    break
                if text or reply.token_ids:
                    yield reply.chunk(text, None, [token])
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream (or the stream ended): its slot is freed
            watch.cancel()
            job.cancel()

    # --- running ---

    def _config(self):
        import uvicorn

        return uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=self.drain_s, lifespan="on")

    def run(self, sock) -> None:
        """Serve on a bound socket until SIGINT/SIGTERM (main thread); in-flight requests get
        `drain_s` to finish, then the rest are cancelled, and this returns."""
        import signal

        import uvicorn

        def stopped(sig, frame):  # uvicorn shuts down gracefully, then re-raises the signal it caught
            raise _Stopped

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


class _CountRequests:
    """Counts responses by path and status: plain ASGI (Starlette's BaseHTTPMiddleware would hide a
    client's disconnect from a streaming response, and the request would run on)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.counter.labels(scope["path"], str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


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


def open_server(artifact, backend: str, options, host: str, port: int, slots: int, max_queue: int,
                model_name: str | None, drain_s: float):
    """Load the artifact on the backend, start its batcher and bind the socket: (Server, socket).
    Everything that can fail (a missing package, a dynamic-cache artifact, a busy port) fails here,
    before the server says it listens."""
    import dataclasses
    from pathlib import Path

    from tk.models.artifact import Manifest
    from tk.toolkit.backends import open_runtime

    _require()
    artifact = Path(artifact)
    manifest = Manifest.read(artifact)
    if problem := slots_problem(manifest.dims):
        raise UsageProblem(f"{artifact}: {problem}")
    tokenizer = Tokenizer(artifact)
    runtime = open_runtime(artifact, backend, dataclasses.replace(options, static_cache=True))
    sock = bind(host, port)
    try:
        batcher = Batcher(runtime, slots, max_queue, manifest.eos_token_ids).start()
    except BaseException:
        sock.close()
        raise
    return Server(batcher, tokenizer, model_name or artifact.resolve().name, drain_s), sock

"""`tk serve`'s edge, before a request reaches an endpoint: plain ASGI middleware (Starlette's
BaseHTTPMiddleware would hide a client's disconnect from a streaming response, and its request
would run on) and the API key's check.

- `BodyLimit`: a body over `limit` bytes gets a 413 before it is parsed (by its Content-Length, or
  as it arrives when chunked); the body read is then replayed to the app, as JSON.
- `CountRequests`: responses by route template and status (an unknown path counts as "unmatched":
  a client cannot grow the metric's series by inventing URLs).
- `bearer_check(key)`: a FastAPI dependency that answers 401 unless `Authorization: Bearer KEY`.
- `documented(*codes)`: the error responses an endpoint declares in /openapi.json; `endpoint(name,
  handle, schema)`: an endpoint whose body FastAPI validates; `run_in_threadpool`: Starlette's.
- `PrometheusMetrics`: what the server counts (frontend.METRICS' names), in a registry of its own.
"""

from __future__ import annotations

import json
import secrets

from tk.runtimes.serving.batching import Batcher
from tk.runtimes.decoding.rows import FinishReason
from tk.toolkit.serving import frontend
from tk.toolkit.serving.frontend import METRICS
from tk.toolkit.serving.openai.api import ApiError

DEFAULT_BODY_LIMIT = 8 * 2**20  # bytes: a list of 1,024 prompts of 2,048 token ids fits
UNMATCHED = "unmatched"


async def _answer(send, status: int, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app, limit: int = DEFAULT_BODY_LIMIT):
        self.app, self.limit = app, limit

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than this server's limit of {self.limit} bytes "
                             "(tk serve --max-body-bytes); send fewer or shorter prompts")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _answer(send, 400, ApiError(400, "the Content-Length header is not a number"))
            if int(declared) > self.limit:
                return await _answer(send, 413, self._too_large())
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _answer(send, 413, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect the endpoint may wait for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        # every endpoint takes JSON: a body is read as JSON whatever its Content-Type says (`curl -d`
        # sends form-urlencoded; FastAPI would otherwise not parse it)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, replay, send)


class CountRequests:
    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        def count(status: int) -> None:
            route = scope.get("route")  # set by the router on this scope when a route matched
            self.counter.labels(getattr(route, "path", UNMATCHED), str(status)).inc()

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:  # a bug: Starlette's outer error middleware answers its 500
            if not started:
                count(500)
            raise


def bearer_check(key: str):
    """A FastAPI dependency: 401 unless the request carries `Authorization: Bearer <key>` (declared
    in /openapi.json as an HTTP bearer scheme)."""
    from fastapi import Depends
    from fastapi.security import HTTPBearer

    scheme = HTTPBearer(auto_error=False, description="tk serve --api-key")
    expected = key.encode()

    async def check(credentials=Depends(scheme)):
        given = credentials.credentials.encode() if credentials is not None else b""
        if not secrets.compare_digest(given, expected):
            raise ApiError(401, "a valid API key is required: send Authorization: Bearer <key> (tk serve --api-key)",
                           kind="authentication_error", code="invalid_api_key")
    return check


async def run_in_threadpool(fn, *args):
    """`fn(*args)` on Starlette's worker threads (imported here: the serving stack is optional)."""
    from starlette.concurrency import run_in_threadpool as run

    return await run(fn, *args)


def endpoint(name: str, handle, schema):
    """An endpoint `name` (its operation in /openapi.json) whose body is `schema` (built at run time:
    FastAPI reads the annotations given here, not the callers', which are strings) -> `handle(http, body)`."""
    from fastapi import Request

    async def call(request, body):
        return await handle(request, body)
    call.__name__ = call.__qualname__ = name
    call.__annotations__ = {"request": Request, "body": schema}
    return call


ERRORS = {400: "A field is wrong or not implemented (the message names it)", 401: "A missing or wrong API key",
          404: "No such stored response (unknown, made with store: false, or evicted from the bounded store)",
          413: "The body is over the server's limit", 429: "Every slot is busy and the queue is full",
          503: "The server is shutting down"}


def documented(*codes: int, stream: bool = False) -> dict:
    """The responses an endpoint declares in /openapi.json besides its 200 (OpenAI's error body)."""
    error = {"content": {"application/json": {"schema": {"type": "object", "properties": {"error": {
        "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}}}}}}
    out = {code: {"description": ERRORS[code], **error} for code in codes}
    if stream:
        out[200] = {"description": "The response, or with stream: true its server-sent events",
                    "content": {"application/json": {}, "text/event-stream": {"schema": {  # one event
                        "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}}
    return out


class _EngineCounters:
    """The batcher's own counters (prefill and prefix cache), read at each scrape: a Prometheus collector."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        b, cache = self.batcher, self.batcher.prefix
        yield CounterMetricFamily("tk_prefill_tokens", METRICS["tk_prefill_tokens"], value=b.prefill_tokens)
        if (spec := b.speculating) is not None:
            for name, value in (("tk_spec_decode_draft_tokens", spec.proposed),
                                ("tk_spec_decode_accepted_tokens", spec.accepted)):
                yield CounterMetricFamily(name, METRICS[name], value=value)
        if cache is not None:
            for name, value in (("tk_prefix_cache_queries", cache.queried), ("tk_prefix_cache_hits", cache.reused)):
                yield CounterMetricFamily(name, METRICS[name], value=value)
            for name, value in (("tk_prefix_cache_hit_rate", cache.hit_rate), ("tk_prefix_cache_bytes", cache.bytes)):
                yield GaugeMetricFamily(name, METRICS[name], value=value)


class PrometheusMetrics(frontend.Metrics):
    """The server's metrics (frontend.METRICS' names) in a registry of its own."""

    def __init__(self, batcher: Batcher):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        Gauge("tk_queue_depth", METRICS["tk_queue_depth"], registry=reg).set_function(lambda: batcher.waiting)
        Gauge("tk_active_slots", METRICS["tk_active_slots"], registry=reg).set_function(lambda: batcher.running)
        Gauge("tk_slots", METRICS["tk_slots"], registry=reg).set(batcher.limits.slots)
        counter = lambda name, *labels: Counter(name, METRICS[name], labels, registry=reg)  # noqa: E731
        buckets = frontend.LATENCY_BUCKETS
        histogram = lambda name: Histogram(name, METRICS[name], buckets=buckets, registry=reg)  # noqa: E731
        self.requests = counter("tk_requests", "endpoint", "status")
        self.reasons = counter("tk_requests_finished", "reason")
        self.prompt, self.generated = counter("tk_prompt_tokens"), counter("tk_generation_tokens")
        self.ttft, self.itl = histogram("tk_time_to_first_token_seconds"), histogram("tk_inter_token_latency_seconds")
        reg.register(_EngineCounters(batcher))

    def submitted(self, prompt_tokens: int) -> None:
        self.prompt.inc(prompt_tokens)

    def token(self, first: bool, seconds: float) -> None:
        (self.ttft if first else self.itl).observe(seconds)
        self.generated.inc()

    def finished(self, reason: FinishReason, tokens: int) -> None:
        self.reasons.labels(reason.value).inc()

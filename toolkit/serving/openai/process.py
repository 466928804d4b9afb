"""`tk serve`'s process: load the artifact and start its batcher (`open_server`), bind the socket,
and serve the app with uvicorn, on the main thread until a stop signal (`run`, which drains the
requests in flight) or on a background thread (`in_thread`: tests, benchmarks). The routes are
the server module's.
"""

from __future__ import annotations

import dataclasses
import gc
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tk.models.spec.errors import UsageProblem
from tk.runtimes.cache_layouts import slots_problem
from tk.runtimes.serving.batching import Batcher, BatcherLimits
from tk.toolkit.serving.openai.edge import DEFAULT_BODY_LIMIT
from tk.toolkit.serving.openai.server import Server, require
from tk.toolkit.speculation import SpeculationOptions, open_speculation
from tk.toolkit.textgen import Tokenizer


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """How `tk serve` listens and what it takes: its address, the batcher's limits, the name clients
    send (None: the artifact folder's), the drain at shutdown, the API key (None: none) and the body limit."""

    host: str = "127.0.0.1"
    port: int = 8000
    limits: BatcherLimits = field(default_factory=BatcherLimits)
    model_name: str | None = None
    drain_s: float = 10.0
    api_key: str | None = None
    max_body: int = DEFAULT_BODY_LIMIT
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)  # off unless it names a proposer
    tool_parser: str | None = None  # the tool-call format (tools.PARSERS); None: the chat template's
    bare_tool_calls: bool | None = None  # auto reads bare JSON calls (bare_calls); None: the format's default
    reasoning_parser: str | None = None  # reasoning.PARSERS' name, or "none"; None: the chat template's


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


def open_server(artifact, backend: str, backend_options, options: ServeOptions = ServeOptions()):
    """Load the artifact on the backend, its tokenizer (transformers' too: no request waits for it),
    start its batcher and bind the socket: (Server, socket). Everything that can fail (a missing
    package, a dynamic-cache artifact, a busy port) fails here, before the server says it listens."""
    from tk.models.spec.manifest import Manifest
    from tk.toolkit.backends import open_runtime

    require()
    artifact = Path(artifact)
    manifest = Manifest.read(artifact)
    if problem := slots_problem(manifest.dims):
        raise UsageProblem(f"{artifact}: {problem}")
    tokenizer = Tokenizer(artifact)
    tokenizer.hf  # noqa: B018  (loaded now, not on the first chat request's event loop)
    # a batch is a MatMul of several rows, as a verify run is; torch keeps the static cache (the slots); no ONNX
    # Runtime arena: over a server's mix of shapes it only grows (the batcher gives freed memory back instead)
    runtime = open_runtime(artifact, backend, dataclasses.replace(backend_options.for_runs(backend), static_cache=True,
                                                                  arena=False))
    speculation = open_speculation(artifact, runtime, options.speculation, backend, backend_options)
    sock = bind(options.host, options.port)
    try:
        batcher = Batcher(runtime, limits=options.limits, eos_ids=manifest.eos_token_ids,
                          speculation=speculation).start()
    except BaseException:
        sock.close()
        raise
    name = options.model_name or artifact.resolve().name
    return Server(batcher, tokenizer, name, drain_s=options.drain_s, api_key=options.api_key,
                  max_body=options.max_body, tool_parser=options.tool_parser,
                  bare_tool_calls=options.bare_tool_calls, reasoning_parser=options.reasoning_parser), sock


class _Stopped(Exception):
    """A stop signal, once uvicorn has shut down."""


GRACE_S = 4.0  # past --drain, what the process gets to close its connections and exit before it is made to


def _uvicorn(server: Server, grace: float = 0.0):
    import uvicorn

    config = uvicorn.Config(server.app, log_level="warning", timeout_graceful_shutdown=server.drain_s + grace,
                            lifespan="on")
    return uvicorn.Server(config)


class Shutdown:
    """One stop signal's deadline, kept on a thread of its own from the signal on: at `drain_s` the
    batcher cancels what is still in flight (running and queued requests end CANCELLED, so their
    handlers answer 503 and their streams an error event, and their connections close), and if the
    process has not exited `GRACE_S` later, every thread's stack goes to stderr and it exits (status 1).
    So one SIGTERM ends `tk serve` within --drain + GRACE_S, whatever a connection, a handler or the
    event loop's own shutdown waits for (asyncio.run cancels and awaits every task left, and waits for
    its worker threads, without a limit of its own before Python 3.12)."""

    def __init__(self, server: Server):
        self.server, self.done, self.started = server, threading.Event(), None

    def begin(self) -> None:
        if self.started is None:
            self.started = time.monotonic()
            threading.Thread(target=self._watch, name="tk-shutdown", daemon=True).start()

    def left(self) -> float:
        return max(0.0, self.started + self.server.drain_s - time.monotonic()) if self.started else self.server.drain_s

    def _watch(self) -> None:
        if not self.done.wait(self.left()):
            self.server.batcher.close(timeout=0)
        if not self.done.wait(GRACE_S):
            import faulthandler
            import os
            import sys

            print(f"tk serve: shutdown did not end {self.server.drain_s + GRACE_S:.0f} s after the stop signal; "
                  "the threads' stacks follow, then the process exits", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)
            os._exit(1)


def run(server: Server, sock) -> None:
    """Serve on a bound socket until SIGINT/SIGTERM (main thread); in-flight requests get the
    server's `drain_s` to finish, then the rest are cancelled, and this returns (`Shutdown`: within
    drain_s + GRACE_S, or the process exits)."""
    def stopped(sig, frame):  # uvicorn shuts down gracefully, then re-raises the signal it caught
        raise _Stopped
    gc.collect()
    gc.freeze()  # the loaded heap (tokenizer, schemas, runtime) is never garbage: no GC pass walks it (vLLM's too)
    process, shutdown = _uvicorn(server, GRACE_S / 2), Shutdown(server)
    caught = process.handle_exit

    def handle_exit(sig, frame):  # (uvicorn installs this on the signals while it serves)
        shutdown.begin()
        caught(sig, frame)
    process.handle_exit = handle_exit
    handlers = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        process.run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        server.batcher.close(timeout=shutdown.left())
        shutdown.done.set()


@contextmanager
def in_thread(server: Server, host: str = "127.0.0.1", port: int = 0):
    """Serve on a background thread (tests, benchmarks) -> the base URL; stop on exit."""
    sock = bind(host, port)
    process = _uvicorn(server)
    thread = threading.Thread(target=process.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not process.started and thread.is_alive():
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        process.should_exit = True
        thread.join()
        sock.close()

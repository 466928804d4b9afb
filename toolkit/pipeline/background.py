"""Run one call beside the caller: on a thread (I/O that releases the GIL) or in a child process
(work that must not share the interpreter, or whose memory must go back to the OS when it ends).

`result()` waits and returns the call's value, or raises what it raised: the same exception from a
thread; from a child, a tk error as itself (a user's mistake stays one line) and anything else as
a RuntimeError carrying the child's traceback. `close()` (or leaving a `with` block) never leaves
anything running: a thread is joined (pass it a stop event to make that quick), a child is ended.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
import traceback

from tk.models.spec.errors import TkError


class Background:
    def __init__(self):
        self.seconds = 0.0  # how long the call itself ran
        self._done = False
        self._value = self._error = None

    @classmethod
    def thread(cls, fn, *args, **kwargs) -> "Background":
        self = cls()

        def run():
            start = time.perf_counter()
            try:
                self._value = fn(*args, **kwargs)
            except BaseException as e:  # handed to result()
                self._error = e
            self.seconds = time.perf_counter() - start

        self._thread, self._proc = threading.Thread(target=run, daemon=True), None
        self._thread.start()
        return self

    @classmethod
    def process(cls, fn, *args, env: dict[str, str] | None = None) -> "Background":
        """`fn` and `args` must pickle (a module-level function). The child is a fresh interpreter
        (`python -c`), not a fork (forking a process that runs torch's thread pools can deadlock)
        and not multiprocessing's spawn (which re-runs the caller's unguarded script); `env` adds to
        its environment."""
        self = cls()
        read, write = os.pipe()
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(write)], stdin=subprocess.PIPE,
                                      pass_fds=(write,), env={**os.environ, **(env or {})})
        os.close(write)
        self._proc.stdin.write(pickle.dumps(sys.path) + pickle.dumps((fn, args)))
        self._proc.stdin.close()
        self._received = b""

        def drain():  # read as it comes, so the child never waits on the pipe and exits when done
            with os.fdopen(read, "rb") as f:
                self._received = f.read()

        self._thread = None
        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()
        return self

    def result(self):
        if not self._done:
            self._wait()
            self._done = True
        if self._error is not None:
            raise self._error
        return self._value

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            return
        self._drain.join()
        code = self._proc.wait()
        if not self._received:
            self._error = RuntimeError(f"the child process running this call died (exit code {code})")
            return
        kind, payload, self.seconds = pickle.loads(self._received)
        if kind == "value":
            self._value = payload
        elif kind == "tk":
            self._error = payload
        else:
            self._error = RuntimeError(f"in a child process:\n{payload}")

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
        elif self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> "Background":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_CHILD = "import sys; from tk.toolkit.pipeline.background import _child; _child(int(sys.argv[1]))"


def _child(fd: int) -> None:
    """The child's side: sys.path, then (fn, args), from stdin; (kind, payload, seconds) to `fd`."""
    start = time.perf_counter()
    try:
        sys.path[:0] = [p for p in pickle.load(sys.stdin.buffer) if p not in sys.path]
        fn, args = pickle.load(sys.stdin.buffer)
        message = ("value", fn(*args))
    except TkError as e:
        message = ("tk", e)
    except BaseException:
        message = ("error", traceback.format_exc())
    with os.fdopen(fd, "wb") as out:
        try:
            data = pickle.dumps((*message, time.perf_counter() - start))
        except Exception:  # the value or the error does not pickle
            data = pickle.dumps(("error", traceback.format_exc(), time.perf_counter() - start))
        out.write(data)

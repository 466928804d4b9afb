"""A two-tool agent task against `tk serve` and llama.cpp's `llama-server --jinja` on one checkpoint:
did the agent finish, which calls did it make (in order, with their arguments), what did it answer,
in how many model turns and how many seconds.

    python examples/agent_tools.py --tk ARTIFACT --gguf FILE.gguf --llama-server PATH/llama-server \
        [--only tk|llama] [--clients openai,agents,agents-responses] [--modes auto,required-first] [--stream] \
        [--max-turns 6] [--max-tokens 256] [--threads 2] [--json OUT.json] [--log-dir DIR]

The task: two tools, `get_weather(city)` (a fixed report per city, the temperature in Celsius) and
`convert_temperature(celsius, to)` (to "F" or "K"), and the question "What is the weather in Paris?
Then convert its temperature to Fahrenheit." A right run calls get_weather(Paris), then
convert_temperature(18, F), and answers with 64.4 F.

Each server is started here, one after the other, as a subprocess on a free 127.0.0.1 port:
`tk serve ARTIFACT --host 127.0.0.1 --port P --slots 2 --threads T` and `llama-server -m GGUF --jinja
--host 127.0.0.1 --port P -t T -c 4096` (its folder on LD_LIBRARY_PATH). Once /health answers, one
short chat request warms it up; then two clients run the task, greedy (temperature 0), each turn
at most --max-tokens new tokens:
(i)  openai: the official `openai` package's tool-calling loop by hand: chat.completions.create with
     the tools, run each call, append the assistant message and one `role: tool` message per call,
     until a reply makes no call (finished) or --max-turns replies were made (not finished);
(ii) agents: the OpenAI Agents SDK (`pip install openai-agents`): an Agent with two @function_tool
     tools on `OpenAIChatCompletionsModel` over `AsyncOpenAI(base_url=...)`, tracing off, run with
     `Runner.run_sync(..., max_turns=--max-turns)`; finished where it returns a final output;
(iii) agents-responses (asked for by name): the same on the SDK's default model class,
     `OpenAIResponsesModel`, over tk serve's Responses API (llama-server has none: it is skipped there).
Each client runs in two modes: `auto`, tool_choice left out (OpenAI's default where tools are given:
the model decides, the server reads its calls out of the reply's text), and `required-first`, the
first turn under tool_choice "required" with parallel_tool_calls false, the turns after it auto
(what the Agents SDK does with tool_choice "required": its reset_tool_choice puts it back to auto
once a tool ran). tk serve runs a required turn under a grammar that admits only a well-formed call;
whether llama-server constrains it depends on its build and the template's chat format. The first
mode measures the model and the server's parser; the second makes a call come back (on tk), so that
the round trip of an assistant message's tool_calls and `role: tool` results is exercised. With
--stream both clients stream every reply (the openai loop assembles the deltas as OpenAI's clients
do; the SDK runs Runner.run_streamed). Then the server is stopped (terminate, then kill), whatever
happened. Both servers cache prompt prefixes, so each run after the first reuses the cache of the
system prompt and tools.

The table: `finished` (the last reply made no call within --max-turns, and nothing raised), `right`
(both calls made with the right arguments, in order, and 64.4 in the answer), `final` (text, or
call-as-text: the answer is a tool call the model wrote without its template's markers, bare JSON
or in a code fence, which neither server reads as a call), the model turns, the seconds from the
first request to the answer, and the calls the tools ran.

Nothing leaves 127.0.0.1: the API keys are dummies, the SDK's tracing (which would upload to
OpenAI) is disabled, no proxy is used for loopback, and the servers run with the Hugging Face hub
offline. --json writes everything: each client's exchanges (requests and responses as sent and
received), the server commands and logs' paths, and the versions. A small model may call tools
imperfectly; the table says what it did.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

from agent_clients import (CLIENTS, MODES, QUESTION, SYSTEM, TOOLS, _plain,  # noqa: E402
                           call_as_text)



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5) -> tuple[int, dict | None]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                   "Authorization": "Bearer sk-local-dummy"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """A server subprocess on 127.0.0.1 (its own process group), up from start() until stop()."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict | None = None):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log
        self.env = {**os.environ, **(env or {})}
        self.root = f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self, timeout: float = 900) -> float:
        """Starts it and waits for /health (200); the seconds that took."""
        print("$", " ".join(self.cmd), flush=True)
        t0 = time.perf_counter()
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if get(self.root + "/health")[0] == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; see {self.log_path}")

    def model(self) -> str:
        return get(self.root + "/v1/models")[1]["data"][0]["id"]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self.log.close()


def servers(args, logs: Path) -> dict[str, Server]:
    out = {}
    if args.only in (None, "tk"):
        tk = shutil.which("tk") or str(Path(sys.executable).with_name("tk"))
        port = free_port()
        out["tk"] = Server("tk serve", [tk, "serve", str(args.tk), "--host", "127.0.0.1", "--port", str(port),
                                        "--slots", "2", "--threads", str(args.threads)], port, logs / "tk-serve.log")
    if args.only in (None, "llama"):
        port = free_port()
        binary = Path(args.llama_server)
        libs = os.pathsep.join(p for p in (str(binary.resolve().parent), os.environ.get("LD_LIBRARY_PATH")) if p)
        out["llama"] = Server("llama-server", [str(binary), "-m", str(args.gguf), "--jinja", "--host", "127.0.0.1",
                                               "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads),
                                               "-c", "4096"], port, logs / "llama-server.log",
                              {"LD_LIBRARY_PATH": libs})
    return out


def versions(args) -> dict:
    out = {}
    for pkg in ("tk", "openai", "openai-agents"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    if args.only in (None, "llama"):
        libs = str(Path(args.llama_server).resolve().parent)
        try:
            got = subprocess.run([str(args.llama_server), "--version"], check=False, capture_output=True, text=True, timeout=30,
                                 env={**os.environ, "LD_LIBRARY_PATH": libs})
            out["llama-server"] = " ".join((got.stdout + got.stderr).split("\n")[-3:]).strip()
        except OSError as e:
            out["llama-server"] = repr(e)
    return out


def calls_text(calls: list[dict]) -> str:
    return "; ".join(f"{c['name']}({json.dumps(c['arguments'])})" for c in calls) or "-"


def table(results: dict) -> str:
    runs = [(server, client, mode, r) for server, by_client in results.items()
            for client, by_mode in by_client.items() for mode, r in by_mode.items()]
    rows = [("server", "client", "mode", "finished", "right", "final", "turns", "seconds", "calls")]
    for server, client, mode, r in runs:
        final = "error" if r["error"] else "call-as-text" if call_as_text(r["final"]) else "text"
        rows.append((server, client, mode, "yes" if r["finished"] else "no", "yes" if r["right"] else "no", final,
                     str(r["turns"]), f"{r['seconds']:.1f}", calls_text(r["calls"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    for server, client, mode, r in runs:
        lines.append(f"[{server} / {client} / {mode}] final: {r['final']!r}")
        if r["error"]:
            lines.append(f"[{server} / {client} / {mode}] error: {r['error']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tk", type=Path, metavar="ARTIFACT", help="a tk artifact with a static cache (tk serve)")
    ap.add_argument("--gguf", type=Path, metavar="FILE", help="the same checkpoint as a GGUF (llama-server)")
    ap.add_argument("--llama-server", default=shutil.which("llama-server"), metavar="PATH", help="llama.cpp's llama-server binary")
    ap.add_argument("--only", choices=["tk", "llama"], help="one server only (default: both, one after the other)")
    ap.add_argument("--clients", default="openai,agents", help="comma-separated: openai, agents, agents-responses "
                                                                "(the SDK's default model: the Responses API; tk only)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: auto, required-first")
    ap.add_argument("--stream", action="store_true", help="both clients stream the replies (stream: true)")
    ap.add_argument("--max-turns", type=int, default=6, help="model replies an agent may make (default 6)")
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens a reply may have (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each server (default 2)")
    ap.add_argument("--log-dir", type=Path, metavar="DIR", help="the servers' logs (default: a new folder under /tmp)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the results, each exchange and the versions here")
    args = ap.parse_args()
    if args.only in (None, "tk") and args.tk is None:
        ap.error("--tk ARTIFACT is needed (or --only llama)")
    if args.only in (None, "llama") and (args.gguf is None or not args.llama_server):
        ap.error("--gguf FILE and --llama-server PATH are needed (or --only tk)")
    clients = [c for c in args.clients.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    if unknown := (set(clients) - set(CLIENTS)) | (set(modes) - set(MODES)):
        ap.error(f"unknown clients or modes: {', '.join(sorted(unknown))}")
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="agent_tools-"))
    logs.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict] = {}
    report = {"question": QUESTION, "stream": args.stream, "system": SYSTEM, "tools": TOOLS, "max_turns": args.max_turns,
              "max_tokens": args.max_tokens, "versions": versions(args), "servers": {}, "results": results}
    for key, server in servers(args, logs).items():
        info = report["servers"][key] = {"command": " ".join(server.cmd), "log": str(server.log_path)}
        try:
            info["start_s"] = round(server.start(), 1)
            model = info["model"] = server.model()
            post(server.root + "/v1/chat/completions", {"model": model, "max_tokens": 1, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
            results[key] = {}
            for client, mode in ((c, m) for c in clients for m in modes):
                if client == "agents-responses" and key != "tk":
                    continue  # (llama-server serves no Responses API)
                print(f"{key} / {client} / {mode} ...", flush=True)
                load = os.getloadavg()[0]  # (the seconds are only as good as the machine was quiet)
                results[key].setdefault(client, {})[mode] = r = CLIENTS[client](
                    server.root + "/v1", model, args.max_turns, args.max_tokens, mode, args.stream)
                r["load_before_after"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                print(f"  finished={r['finished']} right={r['right']} turns={r['turns']} {r['seconds']:.1f} s "
                      f"calls: {calls_text(r['calls'])}" + (f"\n  error: {r['error']}" if r["error"] else ""),
                      flush=True)
        except Exception:  # noqa: BLE001 (the next server still runs; the report says what failed)
            info["error"] = traceback.format_exc()
            print(f"{key}: {info['error']}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    print("\n" + table(results))
    print(f"\nserver logs: {logs}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=_plain))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

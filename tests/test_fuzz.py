"""Issue 36's acceptance: schemathesis over every operation of tk serve's /openapi.json, every check
(`--checks all`: no 5xx, status codes, content types and bodies as documented, invalid bodies
refused, valid ones accepted, the API key enforced), TK_FUZZ_EXAMPLES examples an operation (300 by
default), on the tiny model with a chat template that renders tools, so that the tool-calling fields
(`tools`, `tool_choice`, `parallel_tool_calls`, messages with `tool_calls`, `tool_call_id`, role
`tool`) are fuzzed with the rest, and the Responses API (`POST /v1/responses` with its items, tools
and store; `GET /v1/responses/{id}`, whose unknown ids are documented 404s) too. Out of the default run (`pytest -m fuzz`: about five minutes on 2 cores).

The schemathesis CLI runs in a subprocess (the command people run by hand), against the server on
a thread here; it loads this module for its one hook (SCHEMATHESIS_HOOKS). That hook drops exactly
one kind of failure: a schema-valid body (positive data) refused with a 400 by a rule no JSON schema
can say, each one documented on its fields (schemas.RULES) and named here (EXCLUDED) by the error
the server answers. Every other rule between fields is in the document itself (`if`/`then`), so
the fuzzer only draws bodies that keep it.

`--checks all` also holds every response to 10 s (max_response_time). A generation is slow by design
(up to 72 choices of 511 tokens here: tens of seconds on 2 cores), so the three generation operations
get the request timeout instead, 120 s (CONFIG); the other operations keep the 10 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="structured outputs need llguidance: pip install -e '.[serve]'")
schemathesis = pytest.importorskip("schemathesis", reason="the fuzzer: pip install schemathesis")
pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("TK_FUZZ_EXAMPLES", "300"))
KEY = "sk-fuzz"
TIMEOUT_S = 120
CONFIG = f"""
[[operations]]
include-path-regex = "^/v1/((chat/)?completions|responses)$"
checks.max_response_time = {TIMEOUT_S}.0

# a stored response's id comes from POST /v1/responses: the ids the fuzzer makes up are its documented
# 404s, which schemathesis would otherwise warn about as missing test data
[[operations]]
include-path-regex = "^/v1/responses/"
warnings = false
"""

# The 400s a schema-valid body may get, by the rule (schemas.RULES) that no JSON schema can say: the
# server's error message, matched whole-start.
EXCLUDED = {
    # tokens, not characters: the prompt (as the chat template renders it) plus its budget beyond the context
    "context": r"a prompt of \d+ tokens plus \d+ new tokens exceeds the model's context of \d+;",
    # a product of two fields: prompts x n beyond the choices the server takes at once (each within it alone)
    "choices": r"this request asks for \d+ choices \(prompts x n\);",
    # one constraint per request, among nine fields (and a required or named tool_choice)
    "one constraint": r"[\w, ]+: give one constraint per request$|[\w.]+: a required or named tool call \(tool_choice\)",
    # a grammar, regex or JSON schema (and a tool's parameters, which a required call compiles) llguidance refuses
    "compiles": r"[\w.]+: not a valid (json|json object|regex|choice|grammar) constraint: ",
    # a named tool_choice is one of the tools; a function is named once
    "tool names": r"tool_choice: '[^']*' is not one of the tools |tools: two functions share a name;",
}


def excluded(status: int, text: str) -> str | None:
    """The EXCLUDED rule a response is refused by (None: a 400 no rule explains, or not a 400)."""
    if status != 400:
        return None
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return next((name for name, pattern in EXCLUDED.items() if re.match(pattern, message)), None)


if os.environ.get("SCHEMATHESIS_HOOKS") == __name__:  # loaded by the schemathesis CLI below
    @schemathesis.hook
    def filter_failure(context, failure, case, response) -> bool:
        """Keep every failure but a schema-valid body's 400 by an EXCLUDED rule (counted in a file)."""
        rule = excluded(response.status_code, response.text) if failure.code == "ST202" else None
        if rule is not None and (log := os.environ.get("TK_FUZZ_EXCLUDED")):
            with open(log, "a") as f:
                f.write(f"{rule}\n")
        return rule is None


def test_schemathesis_finds_no_failure_on_any_operation(tools_artifact, tmp_path):
    from tk.toolkit.backends import BackendOptions
    from tk.toolkit.serving.openai.process import ServeOptions, in_thread, open_server

    srv, sock = open_server(tools_artifact, "ort", BackendOptions(),
                            ServeOptions(port=0, model_name="tiny", api_key=KEY, drain_s=1.0))  # tk serve's limits
    sock.close()  # in_thread binds its own
    log, config = tmp_path / "excluded.txt", tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    env = {**os.environ, "SCHEMATHESIS_HOOKS": __name__, "TK_FUZZ_EXCLUDED": str(log),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    try:
        with in_thread(srv) as url:
            command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
                       f"{url}/openapi.json", "--checks", "all", "--max-examples", str(EXAMPLES),
                       "--header", f"Authorization: Bearer {KEY}", "--request-timeout", str(TIMEOUT_S),
                       "--workers", "2", "--generation-database", "none", "--no-color"]
            started = time.perf_counter()
            run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=3600)
            seconds = time.perf_counter() - started
    finally:
        srv.batcher.close()
    rules = log.read_text().splitlines() if log.is_file() else []
    print(f"schemathesis: {seconds:.0f} s, {EXAMPLES} examples an operation; excluded 400s by rule: "
          f"{ {r: rules.count(r) for r in sorted(set(rules))} }\n{run.stdout[-3000:]}")
    assert run.returncode == 0, run.stdout[-30000:] + run.stderr[-5000:]
    summary = run.stdout[run.stdout.rfind("SUMMARY"):]
    assert re.search(r"Tested: 10\b", summary) and "No issues found" in summary, summary

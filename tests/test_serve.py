"""tk serve: the OpenAI API over the batcher, driven by the official `openai` client on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tk.models.spec.manifest import Manifest
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.runtimes.serving.scheduler import BatcherLimits
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.cli.main import main
from tk.toolkit.textgen import Tokenizer, generate_text

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")
pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
pytestmark = pytest.mark.slow
WORDS = "the cat sat on a mat and then it ran far away into the dark wood where owls sing".split()


@pytest.fixture(scope="module")
def server(serve_artifact):
    from tk.toolkit.serving.openai.process import ServeOptions, in_thread, open_server

    srv, sock = open_server(serve_artifact, "ort", BackendOptions(),
                            ServeOptions(port=0, limits=BatcherLimits(slots=4), model_name="tiny", drain_s=1.0))
    sock.close()  # in_thread binds its own
    with in_thread(srv) as url:
        yield srv, url
    srv.batcher.close()


@pytest.fixture(scope="module")
def solo(serve_artifact):
    """Each request as `tk generate` runs it alone: (ids, text) of generate_text on its own runtime."""
    manifest, tok = Manifest.read(serve_artifact), Tokenizer(serve_artifact)
    runtime = open_runtime(serve_artifact, "ort", BackendOptions(static_cache=True))
    cache, lock = {}, threading.Lock()  # asked from the clients' threads: one at a time

    def run(prompt_ids, max_tokens, stops=(), sampling=SamplingConfig()):
        key = (tuple(prompt_ids), max_tokens, tuple(stops), sampling)
        with lock:
            if key not in cache:
                result, texts = generate_text(runtime, tok, [prompt_ids], max_tokens, sampling,
                                              manifest.eos_token_ids, stops)
                cache[key] = (result.rows[0].tokens, texts[0], result.rows[0].finish_reason)
            return cache[key]

    run.tokenizer = tok
    return run


def _prompt(rng) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12))))


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url, path, body: bytes | dict, timeout=30):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(url, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)} (\S+)$", text, re.M)]
    return values[0] if values else 0.0


def _one(url, solo, i: int, rng_seed: int):
    """Request i of the mix: completion or chat, streamed or not, greedy or seeded, maybe a stop."""
    rng = np.random.default_rng(rng_seed)
    c, text = _client(url), _prompt(rng)
    n, chat, stream = int(rng.integers(1, 40)), i % 3 == 1, i % 2 == 0
    sampled = i % 5 == 4
    stops = ["e"] if i % 7 == 6 else []
    kw = dict(model="tiny", max_tokens=n, temperature=0.8 if sampled else 0, stream=stream,
              extra_body={"return_token_ids": True, **({"top_k": 30} if sampled else {})})
    if sampled:
        kw["seed"] = i
    if stops:
        kw["stop"] = stops
    if chat:
        ids = solo.tokenizer.chat_messages([{"role": "user", "content": text}])
        resp = c.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
    else:
        ids = solo.tokenizer.encode(text)
        resp = c.completions.create(prompt=text, **kw)
    if stream:
        chunks = [ch for ch in resp if ch.choices]
        tokens = [t for ch in chunks for t in (ch.choices[0].model_extra.get("token_ids") or [])]
        got = "".join((ch.choices[0].delta.content or "") if chat else ch.choices[0].text for ch in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        choice = resp.choices[0]
        tokens, got, reason = choice.model_extra["token_ids"], choice.message.content if chat else choice.text, \
            choice.finish_reason
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(tokens)
    sampling = SamplingConfig(temperature=0.8, top_k=30, seed=i) if sampled else SamplingConfig()
    want_tokens, want_text, want_reason = solo(ids, n, stops, sampling)
    return (tokens, got, reason), (want_tokens, want_text, {"eos": "stop"}.get(want_reason, want_reason))


def test_sixteen_concurrent_clients_each_get_their_solo_tokens(server, solo):
    srv, url = server
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: _one(url, solo, i, 100 + i), range(16)))
    for i, (got, want) in enumerate(results):
        assert got == want, f"request {i}"
    assert srv.batcher.running == 0 and _metric(url, "tk_active_slots") == 0
    assert srv.batcher.runtime.prepack  # options that say nothing: a batch is a MatMul of several rows, packed
    assert _metric(url, "tk_generation_tokens_total") >= sum(len(w[0]) for _, w in results)
    assert _metric(url, "tk_time_to_first_token_seconds_count") >= 16 and _metric(url, "tk_inter_token_latency_seconds_count")


def test_models_health_and_a_chat_reply(server, solo):
    _, url = server
    assert [m.id for m in _client(url).models.list().data] == ["tiny"]
    assert json.loads(urllib.request.urlopen(url + "/health", timeout=10).read()) == {"status": "ok"}
    reply = _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    ids = solo.tokenizer.chat_messages([{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == solo(ids, 8)[1]
    chunks = list(_client(url).completions.create(model="tiny", prompt="the cat", max_tokens=6, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    ({"model": "tiny", "prompt": "the cat " * 200, "max_tokens": 4}, "prompt"),
    ({"model": "tiny", "prompt": "the cat", "max_tokens": 0}, "max_tokens"),
    ({"model": "gpt-9", "prompt": "the cat", "max_tokens": 4}, "model"),
    ({"model": "tiny", "prompt": "the cat", "n": 0}, "n"),
    ({"model": "tiny", "prompt": "the cat", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "tiny", "prompt": "the cat", "seed": False}, "seed"),  # strict: no boolean taken as a number
    ({"model": "tiny", "prompt": "the cat", "suffix": "!"}, "suffix"),  # not implemented: named, never ignored
    ({"model": "tiny", "prompt": "the cat", "tools": []}, "tools"),
    ({"model": "tiny", "prompt": "the cat", "logprobs": 21}, "logprobs"),
    ({"model": "tiny", "prompt": "the cat", "stop": ["x"] * 17}, "stop"),
    ({"model": "tiny", "prompt": ["the cat"] * 1025}, "prompt"),
    ({"model": "tiny", "prompt": "the cat", "logit_bias": {"999999": 5}}, "logit_bias"),
    ({"model": "tiny", "prompt": "the cat", "guided_regex": "[0-9"}, "guided_regex"),
    ({"model": "tiny", "prompt": "the cat", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"model": "tiny", "prompt": "the cat", "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "prompt": [1, 2, 999999]}, "prompt"),
    ({"model": "tiny", "prompt": "the cat", "seed": -1}, "seed"),
])
def test_a_bad_request_gets_a_400_naming_the_field(server, body, param):
    _, url = server
    status, reply = _post(url, "/v1/completions", body)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
    assert reply["error"]["param"] == param and reply["error"]["message"]
    assert _post(url, "/v1/chat/completions", {"model": "tiny", "messages": []})[1]["error"]["param"] == "messages"


def _stream_and_hang_up(url, max_tokens: int) -> None:
    """Start a streamed completion, read its first event, and close the connection."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "the cat", "max_tokens": max_tokens,
                                                        "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    resp.close()  # the socket closes with its last reference
    conn.close()


def test_two_hundred_requests_with_hangups_and_garbage_leak_no_slot(server, solo):
    srv, url = server
    cancelled = srv.batcher.finished["cancelled"]

    def job(i):
        if i % 10 == 3:
            return "bad", _post(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1})[0]
        if i % 10 == 7:
            _stream_and_hang_up(url, 120)
            return "hangup", None
        return "ok", _one(url, solo, i, 1000 + i)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(job, range(200)))
    assert all(r == 400 for kind, r in results if kind == "bad")
    for i, (kind, r) in enumerate(results):
        if kind == "ok":
            assert r[0] == r[1], f"request {i}"
    deadline = time.monotonic() + 30
    while srv.batcher.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(url, "tk_active_slots") == 0 and _metric(url, "tk_queue_depth") == 0
    assert srv.batcher.finished["cancelled"] - cancelled == 20  # every hang-up cancelled its request
    # a prompt again: its whole blocks come from the prefix cache, and the answer is the same
    prompt, hits = list(range(5, 45)), _metric(url, "tk_prefix_cache_hits_total")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    first, again = (_post(url, "/v1/completions", body)[1]["choices"][0]["token_ids"] for _ in range(2))
    assert first == again and _metric(url, "tk_prefix_cache_hits_total") - hits >= 32
    assert 0 < _metric(url, "tk_prefix_cache_hit_rate") < 1 and _metric(url, "tk_prefix_cache_bytes") > 0
    assert json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())["status"] == "ok"


def test_a_full_queue_gets_429(serve_artifact):
    from tk.toolkit.serving.openai.process import ServeOptions, in_thread, open_server

    srv, sock = open_server(serve_artifact, "ort", BackendOptions(),
                            ServeOptions(port=0, limits=BatcherLimits(slots=1, max_queue=0), model_name="tiny",
                                         drain_s=0.0))
    sock.close()
    with in_thread(srv) as url:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(5):  # the first request must still be decoding when the second arrives
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 120,
                                                                "stream": True, "ignore_eos": True}))
            resp = conn.getresponse()
            resp.readline()
            status, reply = _post(url, "/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 2})
            resp.read()
            conn.close()
            if status == 429:
                break
        assert status == 429 and reply["error"]["code"] == "rate_limit_exceeded", reply
    srv.batcher.close()


def test_tk_serve_starts_answers_and_shuts_down_on_sigterm(serve_artifact, tmp_path):
    tk = Path(sys.executable).parent / "tk"  # the console script, as users run it
    proc = subprocess.Popen([str(tk), "serve", str(serve_artifact), "--port", "0",
                             "--slots", "2", "--model-name", "tiny", "--drain", "1"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line).group(1)
        reply = _client(url).completions.create(model="tiny", prompt="the cat", max_tokens=5, temperature=0)
        assert reply.choices[0].text == solo_text(serve_artifact, "the cat", 5)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()


def test_one_sigterm_ends_tk_serve_within_its_drain_with_streams_in_flight_cancelled_and_stalled(serve_artifact):
    """One SIGTERM while streams decode, others wait for the one slot, one client has gone away
    mid-stream and one has stopped reading with its connection open: the process exits 0 within
    --drain + 5 s; what finished in the drain is whole, what did not ends with a 503 (a stream's error
    event), never a 500."""
    tk = Path(sys.executable).parent / "tk"
    drain, n = 0.3, 32
    proc = subprocess.Popen([str(tk), "serve", str(serve_artifact), "--port", "0", "--slots", "1", "--model-name",
                             "tiny", "--drain", str(drain)], stderr=subprocess.PIPE, text=True)
    url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", proc.stderr.readline()).group(1)
    host, port = url.removeprefix("http://").split(":")
    started, outcomes, answered = threading.Event(), [], threading.Semaphore(0)

    def stream(i: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": f"the cat {i}", "max_tokens": 120,
                                                            "stream": True, "ignore_eos": True}))
        resp, events = conn.getresponse(), []
        answered.release()  # its stream began (queued or decoding)
        for line in resp:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                started.set()
        outcomes.append((resp.status, events))
        conn.close()

    def stalled() -> None:  # reads one event, then stops reading with the connection open
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "a dog", "max_tokens": 120,
                                                            "stream": True, "ignore_eos": True}))
        conn.getresponse().readline()
        time.sleep(12)
        conn.close()

    _stream_and_hang_up(url, 120)  # (first: behind the others it would wait for the one slot until they end)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)] + [threading.Thread(target=stalled)]
    for t in threads:
        t.start()
    started.wait(30)
    for _ in range(n):  # every stream answered before the signal (a connection still in the listen backlog when
        assert answered.acquire(timeout=30)  # the server stops accepting is reset, as on any server)
    tick = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    took, log = time.monotonic() - tick, proc.stderr.read()
    for t in threads:
        t.join(30)
    assert code == 0 and took <= drain + 5, (took, log)
    assert "Traceback" not in log and " 500" not in log, log
    assert len(outcomes) == n and all(status == 200 for status, _ in outcomes)  # the streams had begun
    whole = [ev for _, ev in outcomes if ev and ev[-1].get("choices") and ev[-1]["choices"][0]["finish_reason"] == "length"]
    cut = [ev for _, ev in outcomes if ev and "error" in ev[-1]]
    assert len(whole) + len(cut) == n and cut, (len(whole), len(cut))  # some did not finish in the drain
    assert all("shutting down" in ev[-1]["error"]["message"] for ev in cut)


def solo_text(artifact, prompt: str, n: int) -> str:
    out = CliRunner().invoke(main, ["generate", str(artifact), "--prompt", prompt, "--max-new-tokens", str(n), "--json"])
    return json.loads(out.output)["rows"][0]["text"]


def test_tk_serve_refuses_what_it_cannot_serve(tiny_artifact, serve_artifact):
    out = CliRunner().invoke(main, ["serve", str(tiny_artifact), "--port", "0"])
    assert out.exit_code == 2 and "tk export MODEL -o OUT --for serve" in out.output and "Traceback" not in out.output
    out = CliRunner().invoke(main, ["serve", str(serve_artifact), "--slots", "0"])
    assert out.exit_code == 2 and "--slots" in out.output
    # a host other than loopback is warned about: the dynamic artifact is refused before anything binds, and
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is no interface of any machine, so nothing could bind to it anyway
    out = CliRunner().invoke(main, ["serve", str(tiny_artifact), "--host", "192.0.2.1", "--port", "0"])
    assert "reachable from other machines" in out.output and "no --api-key" in out.output and out.exit_code == 2
    out = CliRunner().invoke(main, ["serve", str(serve_artifact), "--max-body-bytes", "10"])
    assert out.exit_code == 2 and "--max-body-bytes" in out.output
    out = CliRunner().invoke(main, ["serve", str(serve_artifact), "--slots", "8", "--step-tokens", "4"])
    assert out.exit_code == 2 and "--step-tokens" in out.output and "at least 8" in out.output


def test_without_the_serving_stack_tk_serve_says_how_to_get_it(serve_artifact, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed: importing it raises ImportError
    out = CliRunner().invoke(main, ["serve", str(serve_artifact), "--port", "0"])
    assert out.exit_code == 2 and "pip install 'tk[serve]'" in out.output and "Traceback" not in out.output

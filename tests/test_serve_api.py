"""tk serve for the clients people bring (issue 23): log-probabilities and echo as lm-evaluation-harness
asks for them, prompt lists and n, vLLM's tokenizer endpoints, structured outputs under continuous
batching, and the edge (413, 401, capped lists, metrics by route, bodies in /openapi.json). Every
server and client on 127.0.0.1."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tk.models.spec.manifest import Manifest
from tk.runtimes.serving.scheduler import BatcherLimits
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.serving.frontend import Params
from tk.toolkit.serving.openai.process import ServeOptions, in_thread, open_server
from tk.toolkit.textgen import generate_text

pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="structured outputs need llguidance: pip install -e '.[serve]'")
jsonschema = pytest.importorskip("jsonschema", reason="a test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.slow
KEY = "sk-test"
TEXTS = ["the cat sat on the mat", "Numbers: 1 2 3 4 5 6", "def f(x): return x * 2"]


def _serve(artifact, backend: str, **options):
    srv, sock = open_server(artifact, backend, BackendOptions(),
                            ServeOptions(port=0, limits=BatcherLimits(slots=8, max_queue=128), model_name="tiny",
                                         drain_s=1.0, **options))
    sock.close()  # in_thread binds its own
    return srv


@pytest.fixture(scope="module")
def server(serve_artifact):
    srv = _serve(serve_artifact, "ort", api_key=KEY, max_body=64 * 1024)
    with in_thread(srv) as url:
        yield srv, url
    srv.batcher.close()


def _call(url, path, body=None, key=KEY, raw: bytes | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=120) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if r.headers["content-type"].startswith("application/json") else text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def reference(serve_artifact):
    """transformers' float32 log-softmax of the checkpoint, as lm-eval's `hf` backend computes it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Manifest.read(serve_artifact).source.path, dtype=torch.float32)

    def log_softmax(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    return log_softmax


@pytest.mark.parametrize("tokenized", [True, False])
def test_echo_logprobs_are_the_models_log_softmax_as_lm_eval_reads_them(server, reference, tokenized):
    """lm-eval's log-likelihood request: a batch of prompts, echo, logprobs 1, one new token, greedy;
    it sums token_logprobs[ctxlen:-1] and calls a continuation greedy when each token is its top."""
    srv, url = server
    ids = [srv.tokenizer.encode(t) for t in TEXTS]
    body = {"model": "tiny", "prompt": ids if tokenized else TEXTS, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234, "return_token_ids": True}
    status, reply = _call(url, "/v1/completions", body)
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert reply["usage"]["prompt_tokens"] == sum(map(len, ids))
    for c, prompt, text in zip(reply["choices"], ids, TEXTS):
        lp, (new,) = c["logprobs"], c["token_ids"]
        assert c["prompt_token_ids"] == prompt and c["text"].startswith(text)
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = reference(prompt + [new])
        expect = want[np.arange(len(prompt)), prompt[1:] + [new]]  # each prompt token's, then the new one's
        np.testing.assert_allclose(np.array(lp["token_logprobs"][1:]), expect, atol=1e-4)
        for row, top in zip(want, lp["top_logprobs"][1:]):
            assert max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)  # lm-eval's is_greedy reads this
        assert new == int(want[len(prompt) - 1].argmax())
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert [c["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]


def test_a_completion_ended_by_eos_scores_the_eos_too(server, reference):
    """A greedy continuation that ends at once by EOS still has one scored token after the prompt:
    lm-eval reads token_logprobs[ctxlen:-1], which would otherwise drop the prompt's last token."""
    srv, url = server
    prompt, eos = srv.tokenizer.encode(TEXTS[0]), 0
    body = {"prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            "logit_bias": {str(eos): 100}, "return_token_ids": True}
    _, reply = _call(url, "/v1/completions", body)
    c = reply["choices"][0]
    assert c["finish_reason"] == "stop" and c["token_ids"] == [] and len(c["logprobs"]["token_logprobs"]) == len(prompt) + 1
    assert c["logprobs"]["token_logprobs"][-1] == pytest.approx(float(reference(prompt)[-1, eos]), abs=1e-4)
    # min_tokens bans EOS until that many tokens were kept, then the same bias ends the row
    _, reply = _call(url, "/v1/completions", {**body, "echo": False, "max_tokens": 10, "min_tokens": 3})
    assert len(reply["choices"][0]["token_ids"]) == 3 and reply["choices"][0]["finish_reason"] == "stop"


def test_streamed_chat_logprobs_and_top_alternatives(server, reference):
    srv, url = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                                        {"type": "text", "text": "there"}]}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "stream": True, "return_token_ids": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    status, text = _call(url, "/v1/chat/completions", body)
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert text.rstrip().endswith("data: [DONE]") and events[-1]["usage"]["completion_tokens"] == 6
    tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    entries = [x for e in events for c in e["choices"] if c["logprobs"] for x in c["logprobs"]["content"]]
    prompt = srv.tokenizer.chat_messages([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}])
    want = reference(prompt + tokens)[len(prompt) - 1:-1]
    assert len(entries) == len(tokens) == 6
    for entry, token, row in zip(entries, tokens, want):
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=1e-4) and len(entry["top_logprobs"]) == 3
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(np.sort(row)[::-1][:3].tolist(), abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode())


def test_a_streamed_echo_with_logprobs_equals_the_whole_response(server):
    """Streamed, each choice's chunks (its prompt first, then its tokens) add up to the whole reply."""
    _, url = server
    body = {"prompt": TEXTS, "echo": True, "logprobs": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    _, whole = _call(url, "/v1/completions", body)
    _, text = _call(url, "/v1/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    for want in whole["choices"]:
        chunks = [c for e in events for c in e["choices"] if c["index"] == want["index"]]
        assert "".join(c["text"] for c in chunks) == want["text"]
        assert chunks[0]["prompt_token_ids"] == want["prompt_token_ids"]
        assert [t for c in chunks for t in c.get("token_ids", [])] == want["token_ids"]
        streamed = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]] for k in want["logprobs"]}
        assert streamed == want["logprobs"] and chunks[-1]["finish_reason"] == "length"


def test_n_choices_and_prompt_lists_each_equal_their_solo_run(server, serve_artifact):
    srv, url = server
    body = {"prompt": TEXTS[:2], "n": 3, "max_tokens": 12, "temperature": 0.9, "top_k": 20, "seed": 7,
            "ignore_eos": True, "return_token_ids": True}
    status, reply = _call(url, "/v1/completions", body)
    assert status == 200 and [c["index"] for c in reply["choices"]] == list(range(6))
    m, params = Manifest.read(serve_artifact), Params(max_tokens=12, temperature=0.9, top_k=20, seed=7)
    runtime = open_runtime(serve_artifact, "ort", BackendOptions(static_cache=True))
    for c in reply["choices"]:
        prompt, choice = srv.tokenizer.encode(TEXTS[c["index"] // 3]), c["index"] % 3
        result, texts = generate_text(runtime, srv.tokenizer, [prompt], 12, params.sampling(choice), m.eos_token_ids,
                                      ignore_eos=True)
        assert c["token_ids"] == result.rows[0].tokens and c["text"] == texts[0]
    assert params.sampling(0).seed == 7  # choice 0 is what `tk generate --seed 7` draws
    assert len({tuple(c["token_ids"]) for c in reply["choices"][:3]}) == 3  # each choice its own stream


def test_logit_bias_and_min_tokens_reach_the_sampler(server):
    _, url = server
    status, reply = _call(url, "/v1/completions", {"prompt": "the cat", "max_tokens": 5, "temperature": 0,
                                                   "logit_bias": {"42": 100}, "return_token_ids": True})
    assert status == 200 and reply["choices"][0]["token_ids"] == [42] * 5


def test_the_tokenizer_endpoints_in_vllms_shapes(server):
    srv, url = server
    status, out = _call(url, "/tokenize", {"prompt": TEXTS[0], "return_token_strs": True})
    assert status == 200 and out["tokens"] == srv.tokenizer.encode(TEXTS[0]) and out["count"] == len(out["tokens"])
    assert out["token_strs"] == srv.tokenizer.hf.convert_ids_to_tokens(out["tokens"])  # vLLM's: the raw tokens
    assert out["max_model_len"] == srv.batcher.runtime.max_context
    _, chat = _call(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == srv.tokenizer.chat_messages([{"role": "user", "content": "hi"}])
    assert _call(url, "/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": TEXTS[0]})
    status, info = _call(url, "/tokenizer_info")
    assert status == 200 and info["eos_token"] == "<|endoftext|>" and info["chat_template"]
    assert _call(url, "/detokenize", {"tokens": [10**6]})[0] == 400


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


def _schema(i: int) -> dict:
    """64 schemas: PERSON with its properties in a rotated order, some enums and bounds of their own."""
    props = list(PERSON["properties"].items())
    props = props[i % len(props):] + props[:i % len(props)]
    schema = json.loads(json.dumps({**PERSON, "properties": dict(props)}))
    schema["properties"]["role"]["enum"] = ["admin", "user", "guest", f"r{i}"][: 2 + i % 3]
    schema["properties"]["age"]["maximum"] = 10 + i
    return schema


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_structured_outputs_under_continuous_batching(serve_artifact, backend):
    """64 concurrent JSON-schema requests (chat and completions, greedy and sampled) all validate;
    a regex, a choice and json_object hold; unconstrained requests sharing their steps equal their
    solo runs token for token (a request's mask never touches another's row)."""
    srv = _serve(serve_artifact, backend)
    m = Manifest.read(serve_artifact)
    runtime = open_runtime(serve_artifact, "ort", BackendOptions(static_cache=True))
    try:
        with in_thread(srv) as url:
            def constrained(i):
                fmt = {"type": "json_schema", "json_schema": {"name": f"p{i}", "schema": _schema(i), "strict": True}}
                common = {"max_tokens": 100, "temperature": 0.8 if i % 2 else 0, "seed": i, "response_format": fmt}
                if i % 4 == 0:  # a chat prompt: about 25 tokens of the 128
                    return _call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": f"person {i}"}],
                                                               **common}, key=None)
                return _call(url, "/v1/completions", {"prompt": f"person {i}:", **common, "max_tokens": 120}, key=None)

            def free(i):
                return _call(url, "/v1/completions", {"prompt": TEXTS[i % 3], "max_tokens": 30, "temperature": 0.7,
                                                      "seed": i, "ignore_eos": True, "return_token_ids": True}, key=None)

            with ThreadPoolExecutor(24) as pool:
                jobs = [pool.submit(constrained, i) for i in range(64)] + [pool.submit(free, i) for i in range(8)]
                results = [j.result() for j in jobs]
            for i, (status, reply) in enumerate(results[:64]):
                assert status == 200 and reply["choices"][0]["finish_reason"] == "stop", (i, reply.get("choices", reply))
                c = reply["choices"][0]
                jsonschema.validate(json.loads(c["message"]["content"] if "message" in c else c["text"]), _schema(i))
            for i, (status, reply) in enumerate(results[64:]):
                sampling = Params(max_tokens=30, temperature=0.7, seed=i).sampling()
                solo, _ = generate_text(runtime, srv.tokenizer, [srv.tokenizer.encode(TEXTS[i % 3])], 30, sampling,
                                        m.eos_token_ids, ignore_eos=True)
                assert reply["choices"][0]["token_ids"] == solo.rows[0].tokens, i
            regex = r"[A-Z][a-z]{2,6} [0-9]{3}-[0-9]{4}"
            _, out = _call(url, "/v1/completions", {"prompt": "call", "max_tokens": 30, "guided_regex": regex}, key=None)
            assert re.fullmatch(regex, out["choices"][0]["text"]), out
            words = ["positive", "negative", "neutral"]
            _, out = _call(url, "/v1/completions", {"prompt": "mood:", "max_tokens": 30, "temperature": 1, "seed": 3,
                                                    "structured_outputs": {"choice": words}}, key=None)
            assert out["choices"][0]["text"] in words and out["choices"][0]["finish_reason"] == "stop"
            _, out = _call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "json"}], "max_tokens": 60,
                                                         "temperature": 0, "response_format": {"type": "json_object"}},
                           key=None)
            text = out["choices"][0]["message"]["content"]
            assert text.startswith("{") and (out["choices"][0]["finish_reason"] == "length"
                                             or isinstance(json.loads(text), dict))
    finally:
        srv.batcher.close()


def test_the_edge_refuses_with_413_401_and_400_and_stays_up(server):
    srv, url = server
    big = json.dumps({"prompt": "x" * (70 * 1024)}).encode()
    status, reply = _call(url, "/v1/completions", raw=big)
    assert status == 413 and "limit" in reply["error"]["message"]
    assert 'endpoint="unmatched",status="413"' in _call(url, "/metrics")[1]  # refused before routing, counted
    assert _call(url, "/v1/completions", {"prompt": "hi"}, key=None)[0] == 401
    assert _call(url, "/v1/completions", {"prompt": "hi"}, key="wrong")[0] == 401
    assert _call(url, "/v1/models", key=None)[0] == 401 and _call(url, "/v1/models")[0] == 200
    assert json.loads(urllib.request.urlopen(url + "/health", timeout=10).read()) == {"status": "ok"}  # open
    for path in ("/nowhere/1", "/nowhere/2", "/v1/completions/x"):
        assert _call(url, path, {"prompt": "x"})[0] == 404
    _, metrics = _call(url, "/metrics")
    endpoints = set(re.findall(r'tk_requests_total\{endpoint="([^"]+)"', metrics))
    assert "unmatched" in endpoints and not any(e.startswith("/nowhere") for e in endpoints)
    status, reply = _call(url, "/v1/completions", {"prompt": "hi", "messages": []})
    assert status == 400 and reply["error"]["param"] == "messages" and "does not implement" in reply["error"]["message"]
    assert _call(url, "/v1/completions", {"prompt": "the cat", "max_tokens": 2})[0] == 200


def test_openapi_documents_every_body_and_the_key(server):
    _, url = server
    doc = json.loads(urllib.request.urlopen(url + "/openapi.json", timeout=10).read())
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["required"] and "401" in op["responses"] and "400" in op["responses"], path
        assert "422" not in op["responses"], path  # FastAPI's, which tk answers with OpenAI's 400
        assert op["security"]
    completion = doc["components"]["schemas"]["Completion"]
    assert completion["additionalProperties"] is False and "logprobs" in completion["properties"]
    assert "security" not in doc["paths"]["/health"]["get"]


def test_tokenizing_runs_off_the_event_loop_with_the_tokenizer_loaded_at_start(server):
    srv, _ = server
    assert srv.tokenizer._hf is not None  # open_server loaded transformers' tokenizer: no request waits for it


def test_a_backend_that_cannot_score_prompts_refuses_echo_with_logprobs_in_one_line(server, monkeypatch):
    srv, url = server
    kind = type(srv.batcher.runtime)  # as TensorRT is, or ORT on CUDA: no row slices, last-position logits only
    monkeypatch.setattr(kind, "row_slices", False)
    monkeypatch.setattr(kind, "all_prefill_logits", False)
    status, reply = _call(url, "/v1/completions", {"prompt": "the cat", "echo": True, "logprobs": 1, "max_tokens": 1})
    assert status == 400 and reply["error"]["param"] == "echo" and "--prefill-logits all" in reply["error"]["message"]
    assert _call(url, "/v1/completions", {"prompt": "the cat", "logprobs": 1, "max_tokens": 1})[0] == 200


OUT_OF_BOUNDS = [  # (field, its value as JSON text): each a 400 naming the field (bounds as vLLM's and OpenAI's)
    ("temperature", "-0.5"), ("temperature", "2.5"), ("temperature", "NaN"), ("temperature", "1e400"),
    ("top_p", "0"), ("top_p", "1.5"), ("top_p", "NaN"), ("top_k", "-2"), ("repetition_penalty", "0"),
    ("repetition_penalty", "-1"), ("repetition_penalty", "11"), ("repetition_penalty", "Infinity"),
    ("presence_penalty", "-2.5"), ("presence_penalty", "-Infinity"), ("frequency_penalty", "2.5"),
    ("logit_bias", '{"5": 101}'), ("logit_bias", '{"5": -101}'), ("logit_bias", '{"5": NaN}'),
    ("seed", str(2**63)), ("seed", "-1"), ("max_tokens", "0"), ("max_tokens", "1000000"), ("min_tokens", "-1"),
    ("min_tokens", str(10**30)), ("n", "0"), ("n", "129"), ("logprobs", "21"), ("logprobs", "-1"),
    ("top_logprobs", "21"),
]
HANDLED = [  # values within the bounds that once broke a row, each a 200 (issue 36's fuzz run found the first)
    {"repetition_penalty": 5e-324, "guided_choice": ["0"]},
    {"repetition_penalty": 5e-324, "guided_choice": ["0"], "temperature": 0},
    {"repetition_penalty": 5e-324, "temperature": 2}, {"repetition_penalty": 10, "top_p": 5e-324, "seed": 2**63 - 1},
    {"temperature": 1e-300}, {"top_k": 10**30}, {"presence_penalty": -2, "frequency_penalty": 2, "min_tokens": 100},
    {"logit_bias": {"5": -100, "6": 100}, "guided_choice": ["0", "1"]},
]


@pytest.mark.parametrize("field, value", OUT_OF_BOUNDS, ids=[f"{f}={v}" for f, v in OUT_OF_BOUNDS])
def test_every_number_out_of_its_bounds_is_a_400_naming_it_and_the_bounds_are_documented(server, field, value):
    _, url = server
    chat = field == "top_logprobs"
    body = '{"%s": %s, "max_tokens": 2, %s: %s}' % ("messages" if chat else "prompt", json.dumps(
        [{"role": "user", "content": "hi"}] if chat else "the cat"), json.dumps(field), value)
    if chat:
        body = body.replace('"max_tokens"', '"logprobs": true, "max_tokens"')
    if field == "max_tokens":
        body = body.replace('"max_tokens": 2, ', "")
    status, reply = _call(url, "/v1/chat/completions" if chat else "/v1/completions", raw=body.encode())
    assert status == 400 and reply["error"]["param"] == field, reply
    doc = json.loads(urllib.request.urlopen(url + "/openapi.json", timeout=10).read())["components"]["schemas"]
    schema = json.dumps(doc["Chat" if chat else "Completion"]["properties"][field])
    assert "minimum" in schema or "exclusiveMinimum" in schema, schema
    assert _call(url, "/v1/completions", {"prompt": "the cat", "max_tokens": 2})[0] == 200  # still up


@pytest.mark.parametrize("extra", HANDLED, ids=[str(i) for i in range(len(HANDLED))])
def test_a_number_within_bounds_never_breaks_a_row(server, extra):
    """A denormal repetition penalty turns the row to infinities and NaN: the sampler still draws
    within the grammar's mask, and the request ends with a 200, never the batcher's 500."""
    _, url = server
    for path, prompt in (("/v1/completions", {"prompt": "0"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "0"}]})):
        status, reply = _call(url, path, {**prompt, "max_tokens": 8, **extra})
        assert status == 200, reply
        c = reply["choices"][0]
        text = c["message"]["content"] if "message" in c else c["text"]
        assert c["finish_reason"] in ("stop", "length") and (text in extra.get("guided_choice", [text])), reply
    assert _call(url, "/v1/completions", {"prompt": "the cat", "max_tokens": 2})[0] == 200  # still up


def _validator(url, name: str):
    """The JSON-schema validator of body `name` as /openapi.json documents it (OpenAPI 3.1: JSON Schema 2020-12)."""
    doc = json.loads(urllib.request.urlopen(url + "/openapi.json", timeout=10).read())
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
AGREE = [  # (path, a body the document admitted and the server refused, its fix): both refuse it, accept the fixed one
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, {"stream": True}),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, {"logprobs": True}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}},
     {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "text", "json_schema": {"schema": {}}}},
     {"response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "18C"}]},
     {"messages": [{"role": "tool", "content": "18C", "tool_call_id": "call_1"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]}, CHAT),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, CHAT),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": []}]}, {"messages": [CALLED]}),
    ("/v1/chat/completions", {"messages": [{**CALLED, "role": "user", "content": "hi"}]}, CHAT),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, {"logit_bias": {"5": 1}}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"512": 1}}, {"logit_bias": {"511": 1}}),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, {"seed": 2**63 - 1}),
]


@pytest.mark.parametrize("path, bad, fix", AGREE, ids=[str(i) for i in range(len(AGREE))])
def test_the_document_refuses_what_the_server_refuses(server, path, bad, fix):
    """Issue 36's fuzz run (schemathesis) found bodies /openapi.json admits and the server refuses:
    rules between fields (now `if`/`then` in the document), logit_bias keys beyond the vocabulary
    (pydantic's patternProperties admitted any other key), and the seed's bound (FastAPI writes
    bounds as floats: 2**63 - 1 read as 9223372036854776000)."""
    srv, url = server
    validator = _validator(url, "Completion" if path == "/v1/completions" else "Chat")
    body = {"max_tokens": 2, **bad}
    assert not validator.is_valid(body), body
    status, reply = _call(url, path, body)
    assert status == 400, reply
    body = {**body, **fix}
    assert validator.is_valid(body), list(validator.iter_errors(body))
    assert _call(url, path, body)[0] == 200


def test_the_document_writes_whole_bounds_as_integers_and_n_as_the_server_takes_it(server):
    srv, url = server
    text = urllib.request.urlopen(url + "/openapi.json", timeout=10).read().decode()
    assert '"exclusiveMaximum":9223372036854775808' in text.replace(" ", "") and "e+18" not in text
    n = json.loads(text)["components"]["schemas"]["Completion"]["properties"]["n"]
    limits = srv.batcher.limits
    assert n["maximum"] == min(128, 512, limits.slots + limits.max_queue) and isinstance(n["maximum"], int)


def test_prompts_and_n_are_bounded_by_the_choices_the_server_takes():
    """A server of 8 slots and a queue of 64 takes 72 choices a request: n and the prompt lists say so."""
    from tk.toolkit.serving.openai.schemas import schemas

    completion = schemas("tiny", 512, 128, max_choices=72).Completion
    assert completion.model_json_schema()["properties"]["n"]["maximum"] == 72
    completion.model_validate({"prompt": ["a"] * 72, "n": 72})
    for body in ({"prompt": "a", "n": 73}, {"prompt": ["a"] * 73}, {"prompt": [[1]] * 73}):
        with pytest.raises(ValueError):
            completion.model_validate(body)


def test_a_tokenize_error_names_the_field_not_the_union_member(server):
    _, url = server
    status, reply = _call(url, "/tokenize", {"messages": [{"role": "tool", "content": "x"}]})
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert "TokenizeChat" not in reply["error"]["message"] and "tool_call_id" in reply["error"]["message"]

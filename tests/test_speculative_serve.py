"""Speculative decoding behind tk serve: each of eight concurrent clients gets its solo, plain tokens
from a server that speculates with prompt lookup or a draft (its own file, so that the suite's
workers share the speculative tests)."""

from __future__ import annotations

import pytest

from tk.toolkit.backends import BackendOptions, open_runtime

pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
def test_tk_serve_speculating_gives_each_of_eight_clients_its_solo_tokens(serve_artifact, proposer):
    """Eight concurrent requests (greedy and seeded, streamed or not, one opted out) on a server that
    speculates with prompt lookup, or with the artifact as its own draft, get exactly their solo,
    non-speculative tokens and finish reasons; /metrics counts the guesses."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import _client, _metric
    from tk.models.spec.manifest import Manifest
    from tk.runtimes.decoding.sampling import SamplingConfig
    from tk.runtimes.serving.batching import BatcherLimits
    from tk.runtimes.serving.spec_rule import Guess
    from tk.toolkit.serving.openai.process import ServeOptions, in_thread, open_server
    from tk.toolkit.speculation import SpeculationOptions
    from tk.toolkit.textgen import Tokenizer, generate_text

    tok, manifest = Tokenizer(serve_artifact), Manifest.read(serve_artifact)
    solo_rt = open_runtime(serve_artifact, "ort", BackendOptions(static_cache=True))
    options = ServeOptions(port=0, limits=BatcherLimits(slots=8), model_name="tiny", drain_s=1.0,
                           speculation=SpeculationOptions(lookup=True, lookup_min=1, k=5) if proposer == "lookup"
                           else SpeculationOptions(draft=serve_artifact, k=3, draft_p_min=0))
    srv, sock = open_server(serve_artifact, "ort", BackendOptions(), options)
    sock.close()
    # every request with guesses verifies them, within the step's budget (this tests what guessing gives, not
    # when it pays: tests/test_scheduler.py tests the rule; on this graph each verify is a run of its own, and
    # the rule would guess only once few requests decode)
    spec = srv.batcher.speculating

    def every(decoding, spare=None):
        out = []
        for s in decoding:
            if s.room > 0 and (spare is None or sum(g.k for g in out) + s.room <= spare):
                out.append(Guess(s, s.room))
        return out

    spec.rule.plan = every
    words = "the cat sat on the mat and the dog sat on the log".split()

    def one(url, i):
        text = " ".join(words[i % 5:] + words[: i % 5]) * 2
        sampled = i % 3 == 2
        kw = dict(model="tiny", prompt=text, max_tokens=80, temperature=0.9 if sampled else 0, stream=i % 2 == 0,
                  seed=i, extra_body={"return_token_ids": True, "ignore_eos": True, "speculate": i != 5})
        resp = _client(url).completions.create(**kw)
        chunks = [ch for ch in resp if ch.choices] if kw["stream"] else [resp]
        tokens = [t for ch in chunks for t in (ch.choices[0].model_extra.get("token_ids") or [])]
        sampling = SamplingConfig(temperature=0.9, seed=i) if sampled else SamplingConfig()
        with solo_lock:
            result, _ = generate_text(solo_rt, tok, [tok.encode(text)], 80, sampling, manifest.eos_token_ids,
                                      ignore_eos=True)
        return tokens, chunks[-1].choices[0].finish_reason, result.rows[0].tokens

    import threading

    solo_lock = threading.Lock()
    try:
        with in_thread(srv) as url:
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda i: one(url, i), range(8)))
            proposed, accepted = _metric(url, "tk_spec_decode_draft_tokens_total"), _metric(
                url, "tk_spec_decode_accepted_tokens_total")
    finally:
        srv.batcher.close()
    for i, (got, reason, want) in enumerate(results):
        # a sampled request's draft samples too: its tokens keep the distribution (tests/test_speculative_rule.py),
        # not its solo run's draws
        assert (got == want or (proposer == "draft" and i % 3 == 2 and i != 5)) and len(got) == 80, f"request {i}"
        assert reason == "length", f"request {i}"
    assert proposed == spec.proposed > 0 and 0 < accepted == spec.accepted <= proposed
    if proposer == "draft":  # the target as its own draft: greedy requests keep every guess
        assert accepted > proposed / 2

"""The continuous batcher (runtimes/serving/batching.py): requests join and leave a running batch of slots
at different lengths, and each one's tokens equal `tk generate` of its prompt alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tk.models.spec.manifest import Manifest
from tk.runtimes.backends.ort import OrtRuntime
from tk.runtimes.base import InputError
from tk.runtimes.cache_runs import GROUP_TOKENS
from tk.runtimes.serving.batching import Batcher, BatcherClosed, BatcherLimits, QueueFull, Request, wait_all
from tk.runtimes.decoding.generate import generate
from tk.runtimes.slots import Slots
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.toolkit.backends import BackendOptions, open_runtime

pytestmark = pytest.mark.slow
SLOTS = BackendOptions(static_cache=True)


def _mix(vocab: int, n: int, seed: int = 0, head: int = 0):
    """Prompts of 1..40 tokens (every other one after a shared `head` of that many: a system
    prompt), budgets of 1..40, every third request sampled (own seed and knobs)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, size=head).tolist()
    prompts = [(shared if i % 2 else []) + rng.integers(3, vocab, size=int(rng.integers(1, 41))).tolist()
               for i in range(n)]
    budgets = [int(rng.integers(1, 41)) for _ in range(n)]
    sampling = [SamplingConfig(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=i) if i % 3 == 0
                else SamplingConfig() for i in range(n)]
    return prompts, budgets, sampling


def _solo(artifact, backend, prompts, budgets, sampling, eos):
    with open_runtime(artifact, backend, SLOTS) as rt:
        return [generate(rt, [p], n, s, eos).rows[0] for p, n, s in zip(prompts, budgets, sampling)]


@pytest.fixture(scope="module")
def fast_artifact(serve_artifact, tmp_path_factory):
    """The fastest ONNX Runtime variant: GroupQueryAttention reads each row's own length."""
    from tk.toolkit.pipeline.export import export_artifact

    out = tmp_path_factory.mktemp("fast") / "artifact"
    export_artifact(Manifest.read(serve_artifact).source.path, out, target="ort", kv_cache="static",
                    max_seq_len=128, prefill_logits="last")
    return out


@pytest.mark.parametrize("backend,variant", [("ort", "portable"), ("torch", "portable"), ("ort", "fast")])
def test_each_request_equals_its_solo_run_whatever_shares_its_steps(serve_artifact, backend, variant, request):
    """Also with prompts in chunks (8 tokens a step, the 4 slots' decode tokens first) and from cached
    prefixes (every other prompt starts with the same 40 tokens)."""
    artifact = request.getfixturevalue("fast_artifact") if variant == "fast" else serve_artifact
    m = Manifest.read(artifact)
    prompts, budgets, sampling = _mix(m.dims.vocab_size, 14, head=40)
    solo = _solo(artifact, backend, prompts, budgets, sampling, m.eos_token_ids)
    with Batcher(open_runtime(artifact, backend, SLOTS), limits=BatcherLimits(slots=4, max_queue=16, step_tokens=8),
                 eos_ids=m.eos_token_ids) as batcher:
        requests = []
        for i, (p, n, s) in enumerate(zip(prompts, budgets, sampling)):
            requests.append(batcher.submit(Request(p, n, s)))
            if i % 4 == 3:  # later ones arrive while earlier ones decode
                requests[-2].done.wait(5)
        assert wait_all(requests, 120)
        assert batcher.running == 0 and batcher.waiting == 0
    for i, (r, s) in enumerate(zip(requests, solo)):
        assert r.tokens == s.tokens, f"request {i}: {r.tokens} != solo {s.tokens}"
        assert r.finish_reason == s.finish_reason
    assert max(budgets) < batcher.steps < sum(budgets)  # they shared steps
    assert batcher.chunked and batcher.prefix.hits >= 5 and batcher.prefix.reused >= 5 * 32
    assert batcher.prefill_tokens == sum(map(len, prompts)) - batcher.prefix.reused


def test_a_cancelled_request_leaves_at_once_and_frees_its_slot(serve_artifact):
    m = Manifest.read(serve_artifact)
    prompts, budgets, sampling = _mix(m.dims.vocab_size, 3, seed=1)
    solo = _solo(serve_artifact, "ort", prompts, [60] * 3, [SamplingConfig()] * 3, ())
    seen = threading.Event()
    with Batcher(open_runtime(serve_artifact, "ort", SLOTS), limits=BatcherLimits(slots=2, max_queue=4)) as batcher:
        def on_event(event):
            if event.token is not None and len(long.tokens) == 5:
                seen.set()

        long = Request(prompts[0], 60, ignore_eos=True, on_event=on_event)
        batcher.submit(long)
        others = [batcher.submit(Request(p, 60, ignore_eos=True)) for p in prompts[1:]]  # the second waits
        assert seen.wait(30)
        batcher.cancel(long)
        assert wait_all([long, *others], 60)
        assert long.finish_reason == "cancelled" and 5 <= len(long.tokens) < 60
        assert long.tokens == solo[0].tokens[: len(long.tokens)]
        assert [r.tokens for r in others] == [s.tokens for s in solo[1:]]  # the waiting one took the freed slot
        assert batcher.running == 0 and batcher.finished["cancelled"] == 1


def test_limits_are_refusals_not_crashes(serve_artifact):
    m = Manifest.read(serve_artifact)
    batcher = Batcher(open_runtime(serve_artifact, "ort", SLOTS), limits=BatcherLimits(slots=1, max_queue=1),
                      eos_ids=m.eos_token_ids)
    with pytest.raises(BatcherClosed):  # not started
        batcher.submit(Request([5], 4))
    with batcher:
        with pytest.raises(InputError, match="exceeds the model's context of 128"):
            batcher.submit(Request([5] * 100, 29))
        with pytest.raises(InputError, match="positive"):
            batcher.submit(Request([5], 0))
        first = batcher.submit(Request([5, 6], 100, ignore_eos=True))
        queued = batcher.submit(Request([7, 8], 4, ignore_eos=True))
        with pytest.raises(QueueFull, match="retry later"):
            batcher.submit(Request([9], 4))
        batcher.cancel(queued)  # a waiting request leaves the queue at once
        assert queued.done.is_set() and queued.finish_reason == "cancelled" and not queued.tokens
        batcher.cancel(first)
        assert wait_all([first], 30) and first.finish_reason == "cancelled"
    with pytest.raises(BatcherClosed):
        batcher.submit(Request([5], 4))
    with pytest.raises(RuntimeError, match="a batcher starts once"):
        batcher.start()


def test_close_lets_requests_finish_then_cancels_the_rest(serve_artifact):
    batcher = Batcher(open_runtime(serve_artifact, "ort", SLOTS), limits=BatcherLimits(slots=2, max_queue=4)).start()
    short = batcher.submit(Request([5, 6, 7], 3, ignore_eos=True))
    endless = batcher.submit(Request([8, 9], 125, ignore_eos=True))
    short.done.wait(30)
    batcher.close(timeout=0)  # the endless one (125 positions) is still decoding
    assert short.finish_reason == "length" and len(short.tokens) == 3
    assert endless.finish_reason == "cancelled" and endless.done.is_set()
    assert not batcher.alive


def test_slots_compute_only_up_to_the_last_busy_one(serve_artifact):
    with open_runtime(serve_artifact, "ort", SLOTS) as rt, Slots(rt, 6) as slots:
        slots.admit(0, [4, 5, 6])
        slots.admit(2, [7])
        out = slots.step(np.array([11, 0, 12]), [0, 2])
        assert out.logits.shape[0] == 3
        assert slots.session.static.write.tolist() == [4, 0, 2, 0, 0, 0]  # each slot at its own length; empty ones stay


def _verify_runs(serve_artifact, monkeypatch, verify_many=Slots.verify_many) -> list:
    """Three requests through a batcher whose slots 0 and 2 guess their last token twice every step
    and slot 1 never -> the events: ("run", slots, width) as a batched verify run is asked for (of
    `verify_many`), ("add", tokens) as the loop records a run in its cost fit."""
    from tk.runtimes.decoding.speculative import PromptLookup, Speculation
    from tk.runtimes.serving.run_cost import Costs
    from tk.runtimes.serving.spec_rule import Guess

    events, add = [], Costs.add
    monkeypatch.setattr(Slots, "verify_many", lambda self, slots, tokens: events.append(
        ("run", list(slots), tokens.shape[1])) or verify_many(self, slots, tokens))
    monkeypatch.setattr(Costs, "add", lambda self, tokens, seconds, prompt=False, decode=False: events.append(
        ("add", tokens)) or add(self, tokens, seconds, prompt, decode))

    class Repeat(PromptLookup):  # every row guesses its last token twice, every step
        def lookup(self, text, k):
            return [int(text[-1])] * min(k, 2)

    runtime = open_runtime(serve_artifact, "ort", BackendOptions(static_cache=True, prepack=True))
    with Batcher(runtime, limits=BatcherLimits(slots=3, max_queue=4), speculation=Speculation(Repeat(), 4)) as batcher:
        assert batcher.speculating.rule.leading and batcher.speculating.rule.batched
        # slots 0 and 2 verify their guesses, slot 1 never (whether guessing pays: tests/test_scheduler.py)
        batcher.speculating.rule.plan = lambda decoding, spare=None: [Guess(s, s.room) for s in decoding
                                                                      if s.room and s.slot != 1]
        requests = [batcher.submit(Request(p, 12, ignore_eos=True)) for p in ([5, 6, 7], [11, 12, 13, 14], [8, 9])]
        assert wait_all(requests, timeout=120)
    assert all(len(r.tokens) == 12 for r in requests)
    assert any(e[0] == "run" and e[1] == [0, 2] for e in events), events  # slots 0 and 2 verified together
    return events


def test_the_loop_records_a_verify_run_as_the_leading_rows_it_computes(serve_artifact, monkeypatch):
    """Slots 0 and 2 verify their guesses in one run while slot 1 decodes plainly: the run computes rows
    0-2 (slot 1 sits it out), so the loop's cost fit hears 3 x its width, the rows the speculation rule
    costs it by (`SpeculationRule.leading`), not the guessing rows' 2 x width."""
    events = _verify_runs(serve_artifact, monkeypatch)
    for i, e in enumerate(events):
        if e[0] == "run":
            recorded = next(a[1] for a in events[i + 1:] if a[0] == "add")
            assert recorded == (max(e[1]) + 1) * e[2], (e, recorded)


def test_a_verify_run_that_cannot_go_as_one_is_no_point_of_the_cost_fit(serve_artifact, monkeypatch):
    """Where the slots' batched run cannot go (`verify_many` answers None: a row with no room), each
    slot verifies in a run of its own: the fit hears those runs (each its guesses and last token, at
    most the batch's width), not a near-zero-second point of the run that never ran (3 rows x the width,
    which would make verifying look free)."""
    events = _verify_runs(serve_artifact, monkeypatch, verify_many=lambda self, slots, tokens: None)
    for i, e in enumerate(events):
        if e[0] == "run":
            slots, n = e[1], e[2]
            then = [a[1] for a in events[i + 1:i + 1 + len(slots)]]  # one run a slot, each at most the width
            assert len(then) == len(slots) and all(t <= n for t in then), events[i:i + 4]


def test_a_dynamic_cache_artifact_is_refused_with_the_export_profile(tiny_artifact):
    with open_runtime(tiny_artifact, "ort") as rt, pytest.raises(InputError, match=r"--for serve \(or --for ort-cpu\)"):
        Slots(rt, 2)


def test_a_failing_request_fails_alone_and_the_batcher_goes_on(serve_artifact):
    def stop(tokens):  # a front end's bug, at the third token
        if len(tokens) == 3:
            raise ZeroDivisionError("division by zero")
        return False

    with Batcher(open_runtime(serve_artifact, "ort", SLOTS), limits=BatcherLimits(slots=2, max_queue=4)) as batcher:
        bad = batcher.submit(Request([5, 6], 10, ignore_eos=True, stop=stop))
        good = batcher.submit(Request([7, 8, 9], 6, ignore_eos=True))
        assert wait_all([bad, good], 30)
        assert bad.finish_reason == "error" and "ZeroDivisionError" in bad.error and len(bad.tokens) == 3
        assert good.finish_reason == "length" and len(good.tokens) == 6
        after = batcher.submit(Request([7, 8, 9], 6, ignore_eos=True))
        assert wait_all([after], 30) and after.tokens == good.tokens and batcher.running == 0


def test_the_backends_batch_and_prompt_limits_are_refusals(serve_artifact):
    runtime = open_runtime(serve_artifact, "ort", SLOTS)
    runtime.max_batch, runtime.max_prompt = 2, 8  # what TensorRT's profiles set
    with pytest.raises(InputError, match="--slots 2"):
        Batcher(runtime, limits=BatcherLimits(slots=4)).start()
    runtime.deactivate()
    with (Batcher(runtime, limits=BatcherLimits(slots=2)) as batcher,
          pytest.raises(InputError, match="longer than the ort backend's 8")):
        batcher.submit(Request(list(range(5, 14)), 4))


def test_an_idle_batcher_waits_for_the_requests_arriving_with_its_first(serve_artifact):
    """A burst: while a front end is still reading requests (`arriving`), and for a tenth of a decode step
    after the last came, an idle loop's first step waits for them (up to gather_s), so their prompts go
    in one step and none decodes alone while the others prefill."""
    with Batcher(open_runtime(serve_artifact, "ort", SLOTS), limits=BatcherLimits(slots=4, gather_s=30)) as batcher:
        with batcher.arriving():  # the second request, being read
            first = batcher.submit(Request([5, 6, 7], 2, ignore_eos=True))
            time.sleep(0.3)  # the loop would have run the first alone by now
            assert not first.done.is_set()
            second = batcher.submit(Request([8, 9], 2, ignore_eos=True))
        assert wait_all([first, second], 30)
        assert batcher.steps == 1  # both prompts came in together, then one decode step for both
        alone = batcher.submit(Request([5, 6, 7], 2, ignore_eos=True))
        assert wait_all([alone], 10) and batcher.steps == 2  # (not the 30 s of gathering)
        assert alone.tokens == first.tokens
        # and it lingers a tenth of a decode step (LINGER) for the next of a burst: here a step of 10 s
        batcher.costs.decode = 10.0
        first = batcher.submit(Request([5, 6, 7], 2, ignore_eos=True))
        time.sleep(0.3)
        second = batcher.submit(Request([8, 9], 2, ignore_eos=True))
        assert wait_all([first, second], 30) and batcher.steps == 3


@pytest.mark.parametrize("backend,variant", [("ort", "portable"), ("torch", "portable"), ("ort", "fast")])
def test_log_probabilities_of_prompt_and_tokens_equal_the_reference(serve_artifact, backend, variant, request):
    """A request's prompt and token log-probabilities are the log-softmax of the reference's logits,
    also where the prefill returns only the last position's (the fast variant: the prompt then goes
    through the decode graph one token per step), and with processors changing what it samples."""
    from tk.runtimes.decoding.logits import log_softmax, logit_bias

    artifact = request.getfixturevalue("fast_artifact") if variant == "fast" else serve_artifact
    m = Manifest.read(artifact)
    prompt = np.random.default_rng(5).integers(3, m.dims.vocab_size, size=23).tolist()
    with Batcher(open_runtime(artifact, backend, SLOTS), limits=BatcherLimits(slots=2),
                 eos_ids=m.eos_token_ids) as batcher:
        heard = []
        r = Request(prompt, 6, SamplingConfig(), ignore_eos=True, on_event=heard.append,
                    processors=[logit_bias({7: 50.0}, m.dims.vocab_size)], logprobs=3, prompt_logprobs=2)
        assert wait_all([batcher.submit(r)], 60)
    assert r.tokens == [7] * 6  # the bias decided the tokens; the log-probabilities stay the model's own
    with open_runtime(serve_artifact, "torch", SLOTS) as ref:
        ids = np.array([prompt + r.tokens])
        want = log_softmax(ref.start(ids, np.ones_like(ids))[0].logits[0])
    assert r.prompt_scores[0] is None and len(r.prompt_scores) == len(prompt)
    scores = [s for s in r.prompt_scores[1:]] + [e.logprob for e in heard if e.token is not None]
    tokens = prompt[1:] + r.tokens
    np.testing.assert_allclose([s.logprob for s in scores], want[np.arange(len(tokens)), tokens], atol=1e-4)
    for s, row in zip(scores, want):
        assert [t for t, _ in s.top] == np.argsort(-row, kind="stable")[:len(s.top)].tolist()
    assert {len(s.top) for s in scores} == {2, 3}  # the prompt's top 2, the new tokens' top 3


def test_a_step_attends_over_what_the_rows_hold_not_the_whole_cache(serve_artifact):
    """A portable static export's decode graph takes a narrow mask (contract.inputs' narrow_mask):
    the prompt's run and each step feed the positions the rows hold, rounded up to 64, and compute what
    the full width computes (the dynamic cache's step of the same tokens)."""
    prompt = np.random.default_rng(2).integers(3, 300, size=20).tolist()
    widths = []
    with open_runtime(serve_artifact, "ort", SLOTS) as rt, Slots(rt, 2) as slots:
        assert rt.dims.narrow_mask and rt.dims.kv_capacity == 128
        run = rt.run
        rt.run = lambda graph, feeds, *a, **k: (widths.append((graph, feeds["attention_mask"].shape)),
                                                 run(graph, feeds, *a, **k))[1]
        slots.admit(1, prompt)
        narrow = [slots.step(np.array([0, t]), [1]).logits[1] for t in (7, 8)]
    assert widths == [("decode", (1, 64)), ("decode", (2, 64)), ("decode", (2, 64))]  # (prompts too: pad_queries)
    with open_runtime(serve_artifact, "torch") as ref:
        ids = np.array([prompt])
        _, session = ref.start(ids, np.ones_like(ids))
        full = [ref.step(session, [t]).logits[0] for t in (7, 8)]
    np.testing.assert_allclose(np.concatenate(narrow), np.concatenate(full), atol=1e-4)


@pytest.mark.parametrize("variant", ["portable", "prefill-graph", "fast"])
def test_prompts_first_chunks_in_one_run_compute_what_each_alone_does(serve_artifact, variant, request):
    """Several prompts' first chunks go in one run (StaticLayout.first_groups, prefill_first): through the
    decode graph (adjacent slots, right-padded: a mask as wide as the run; the fused one's GroupQueryAttention
    takes them as its first prompt), or left-padded through the prefill graph (any slots: a runtime told to
    prefill there, or an export before pad_queries). Each slot's logits, and the decode step after, are what
    its prompt alone gives; through the portable decode graph, bit for bit (Variant.pad_queries)."""
    artifact = request.getfixturevalue("fast_artifact") if variant == "fast" else serve_artifact
    rng = np.random.default_rng(7)
    vocab = Manifest.read(artifact).dims.vocab_size
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in (7, 9, 9, 8)]
    opened = OrtRuntime(artifact, prefill_via="prefill") if variant == "prefill-graph" else \
        open_runtime(artifact, "ort", SLOTS.for_runs("ort"))  # (prepacked, as a server's runs are)
    with opened as rt:
        layout = rt.layout
        assert layout.first_groups(rt, [0, 1, 2, 3], [7, 9, 9, 8]) == [[0, 1, 2, 3]]
        assert layout.first_groups(rt, [0, 1, 2, 3], [2, 9, 9, 9]) == [[1, 2, 3]]  # (a quarter padded at most)
        n = GROUP_TOKENS // 3  # (GROUP_TOKENS a run at most)
        assert layout.first_groups(rt, [0, 1, 2, 3, 4], [n] * 5) == [[0, 1, 2], [3, 4]]
        assert layout.first_groups(rt, [0, 2], [9, 9]) == ([[0, 2]] if variant == "prefill-graph" else [])  # (one view)
        with Slots(rt, 4) as alone:
            solo = np.stack([alone.admit(i, p).logits[0, -1] for i, p in enumerate(prompts)])
            after = alone.step(np.array([5, 6, 7, 8]), [0, 1, 2, 3]).logits[:, -1]
        with Slots(rt, 4) as slots:
            ids = [slots.begin(i, p) for i, p in enumerate(prompts)]
            together = slots.prefill_first([0, 1, 2, 3], ids, [len(p) for p in prompts])
            assert [slots.written(i) for i in range(4)] == [7, 9, 9, 8]
            then = slots.step(np.array([5, 6, 7, 8]), [0, 1, 2, 3]).logits[:, -1]
    scale = float(np.abs(solo).max())
    assert scale > 3  # logits that are not flat
    np.testing.assert_allclose(together, solo, atol=1e-4 * scale, rtol=0)
    np.testing.assert_allclose(then, after, atol=1e-4 * scale, rtol=0)
    assert (together.argmax(-1) == solo.argmax(-1)).all()
    if variant == "portable":
        assert np.array_equal(together, solo) and np.array_equal(then, after)


HEAP_PROBE = """
import ctypes, ctypes.util, sys
from tk.runtimes.serving.heap import fix_mmap_threshold

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Info, ctypes.c_void_p, [ctypes.c_void_p]
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
libc.free(libc.malloc(8 << 20))  # a large block freed: glibc's own rule raises its threshold to that size
before = libc.mallinfo2().hblkhd
block = libc.malloc(1 << 20)
print(libc.mallinfo2().hblkhd - before)  # bytes mapped for a 1 MiB block: 0 where it went on the heap
libc.free(block)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc's malloc (its mmap threshold, mallinfo2); this C library is not glibc")
def test_a_servers_large_blocks_stay_mapped_on_their_own_after_a_larger_one_was_freed(serve_artifact, monkeypatch):
    """runtimes/serving/heap.py: after a large block is freed, glibc puts the next megabyte on the heap (its
    mmap threshold rises to the freed block's size), where a live neighbour keeps its pages after it is
    freed; a batcher's process keeps the threshold at 128 KiB, so such blocks are mapped and unmapped
    whole. (The soak of the real 0.5B, int4 with --lookup: RSS +5.8% over minute 10's at its worst without,
    flat with; README, "Memory".)"""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_")}
    mapped = {how: int(subprocess.run([sys.executable, "-c", HEAP_PROBE, how], capture_output=True, text=True,
                                      check=True, env=env).stdout) for how in ("glibc", "fixed")}
    assert mapped["glibc"] == 0 and mapped["fixed"] >= 1 << 20
    from tk.runtimes.serving import batching, heap

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4194304")
    assert not heap.fix_mmap_threshold()  # a threshold the user set stands

    fixed = []
    monkeypatch.setattr(batching, "fix_mmap_threshold", lambda: fixed.append(True))
    with Batcher(open_runtime(serve_artifact, "ort", SLOTS), limits=BatcherLimits(slots=1)):
        assert fixed == [True]

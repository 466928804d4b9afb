"""One row policy (runtimes/decoding/rows.py) for `tk generate` and the batcher, checked without an artifact:
the policy alone, then the real static layout, slots, batcher and generation loop over a numpy
stand-in for a static-cache export whose logits depend on every visible cache position."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from tk.models.spec import contract
from tk.runtimes.base import InputError, Runtime, StepOutput
from tk.runtimes.serving.batching import Batcher, BatcherLimits, Request, wait_all
from tk.runtimes.decoding.generate import Generation, generate
from tk.runtimes.decoding.rows import FinishReason, RowPolicy, seen_matrix
from tk.runtimes.decoding.sampling import SamplingConfig

V, CAPACITY = 64, 48


def test_eos_is_not_kept_and_ignore_eos_keeps_it():
    row = RowPolicy([1, 2], 5, eos_ids=[7])
    assert row.add(3) and row.finished() is None
    assert not row.add(7) and row.finish_reason == FinishReason.EOS and row.tokens == [3]
    kept = RowPolicy([1, 2], 5, eos_ids=[7], ignore_eos=True)
    assert kept.add(7) and kept.finished() is None and kept.tokens == [7]


def test_budget_and_stop_end_a_row_after_its_token_stop_first():
    row = RowPolicy([1], 2)
    assert row.add(4) and row.finished() is None
    assert row.add(5) and row.finished() == FinishReason.LENGTH and row.tokens == [4, 5]
    asked = RowPolicy([1], 2)
    asked.add(4)
    asked.add(5)
    asked.stop()  # what its consumer asked while it heard the budget's last token
    assert asked.finished() == FinishReason.STOP
    hooked = RowPolicy([1], 10, stop_when=lambda tokens: tokens[-1] == 9)
    assert hooked.add(9) and hooked.finished() == FinishReason.STOP


def test_seen_marks_the_prompt_and_kept_tokens_in_its_line_of_a_shared_matrix():
    assert seen_matrix(SamplingConfig(), V, 2) is None  # no repetition penalty: nothing to track
    seen = seen_matrix(SamplingConfig(repetition_penalty=1.3), V, 2)
    a, b = RowPolicy([1, 2], 4, seen=seen[0:1]), RowPolicy([3], 4, eos_ids=[9], seen=seen[1:2])
    a.add(5)
    b.add(9)  # EOS: not seen
    assert np.flatnonzero(seen[0]).tolist() == [1, 2, 5] and np.flatnonzero(seen[1]).tolist() == [3]


@pytest.mark.parametrize("length, budget, message", [
    (0, 4, "empty prompt: give at least one token per prompt"),
    (3, 0, "max new tokens must be positive, got 0"),
    (40, 9, "a prompt of 40 tokens plus 9 new tokens exceeds the model's context of 48; shorten the prompt"),
])
def test_check_refuses_what_no_row_can_run(length, budget, message):
    with pytest.raises(InputError, match=message):
        RowPolicy.check(length, budget, CAPACITY)
    RowPolicy.check(40, 8, CAPACITY)  # exactly the context: fine


def test_finish_reasons_are_strings():
    assert FinishReason.EOS == "eos" and {"eos": 1}[FinishReason.EOS] == 1
    assert str(FinishReason.LENGTH) == f"{FinishReason.LENGTH}" == "length"
    assert json.dumps({"r": FinishReason.STOP}) == '{"r": "stop"}'
    assert [r.value for r in FinishReason if r.completed] == ["eos", "stop", "length"]


class ToyStatic(Runtime):
    """A static-cache export in numpy: the key cache holds tokens, the value cache positions, and a
    position's logits hash the visible positions' (token, position) pairs, in integers (exact), so
    a cache row, mask or position that is wrong changes the tokens."""

    name = "toy"

    def __init__(self):
        super().__init__(contract.GraphDims(1, 1, 1, V, "float32", kv_capacity=CAPACITY), CAPACITY)
        self.runs = 0

    def _load(self):
        pass

    @staticmethod
    def _logits(h: np.ndarray) -> np.ndarray:  # (B, S) int64 -> (B, S, V) float32
        return (((h[..., None] * 2654435761 + np.arange(V) * 40503) % 997) / 997.0).astype(np.float32)

    def run(self, graph, feeds, past, session, in_place=False):
        self.runs += 1
        ids, mask, pos = feeds["input_ids"], feeds["attention_mask"], feeds["position_ids"]
        if graph == contract.PREFILL:
            h = np.cumsum((ids * 31 + pos * 7 + 1) * mask, axis=1)
            kv = [ids[:, None, :, None].astype(np.float32), pos[:, None, :, None].astype(np.float32)]
            return StepOutput(self._logits(h)), kv
        for b, w in enumerate(feeds["write_indices"].tolist()):
            past[0][b, 0, w, 0], past[1][b, 0, w, 0] = ids[b, 0], pos[b, 0]
        k, v = (p[:, 0, :, 0].astype(np.int64) for p in past)
        return StepOutput(self._logits(((k * 31 + v * 7 + 1) * mask).sum(-1)[:, None])), past


def _requests(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(1, V, size=int(rng.integers(1, 12))).tolist()
        sampled = SamplingConfig(temperature=0.8, top_k=20, repetition_penalty=1.4, seed=i)
        sampling = sampled if i % 2 else SamplingConfig()
        out.append((prompt, int(rng.integers(1, 20)), sampling))
    return out


def test_each_request_equals_its_solo_run_by_construction():
    eos = [5, 6]
    mix = _requests(12)
    with ToyStatic() as rt:
        solo = [generate(rt, [p], n, s, eos).rows[0] for p, n, s in mix]
    assert {r.finish_reason for r in solo} >= {FinishReason.EOS, FinishReason.LENGTH}  # the mix finishes both ways
    stopped = threading.Event()
    with Batcher(ToyStatic(), limits=BatcherLimits(slots=3, max_queue=16), eos_ids=eos) as batcher:
        requests = [batcher.submit(Request(p, n, s)) for p, n, s in mix]
        cut = batcher.submit(Request(mix[0][0], 10, ignore_eos=True, stop=lambda toks: len(toks) == 2,
                                     on_event=lambda e: e.finish_reason and stopped.set()))
        assert wait_all(requests + [cut], 30) and stopped.is_set()
        assert batcher.running == 0 and batcher.finished[FinishReason.STOP] == 1
        assert max(n for _, n, _ in mix) < batcher.steps < sum(n for _, n, _ in mix)  # they shared steps
    for i, (r, s) in enumerate(zip(requests, solo)):
        assert (r.tokens, r.finish_reason) == (s.tokens, s.finish_reason), f"request {i}"
    free = Generation(ToyStatic().activate(), [mix[0][0]], 10, ignore_eos=True)
    for event in free:
        if event.token is not None and len(free.result.rows[0].tokens) == 2:
            free.stop(event.row)
    assert cut.tokens == free.result.rows[0].tokens and cut.finish_reason == free.result.rows[0].finish_reason


def test_a_waiting_request_cancelled_leaves_and_its_callback_runs_outside_the_lock():
    gate, heard = threading.Event(), []
    with Batcher(ToyStatic(), limits=BatcherLimits(slots=1, max_queue=2)) as batcher:
        first = batcher.submit(Request([1, 2], 40, ignore_eos=True, stop=lambda toks: gate.wait(10) and False))
        waiting = Request([3], 4, on_event=lambda e: heard.append(batcher._cv._is_owned()))
        batcher.submit(waiting)
        batcher.cancel(waiting)  # still queued: the first holds the only slot (its stop hook waits)
        gate.set()
        batcher.cancel(first)
        assert wait_all([first, waiting], 10)
    assert waiting.finish_reason == FinishReason.CANCELLED and heard == [False]


def _shared_prefix_mix(n: int, system: int = 20, seed: int = 3):
    """Prompts that start with one system prompt (a prefix cache block is 16 tokens), each its own tail."""
    rng = np.random.default_rng(seed)
    head = rng.integers(1, V, size=system).tolist()
    return [(head + rng.integers(1, V, size=int(rng.integers(1, 8))).tolist(), int(rng.integers(1, 12)),
             SamplingConfig(temperature=0.8, top_k=20, seed=i) if i % 2 else SamplingConfig()) for i in range(n)]


@pytest.mark.parametrize("cache_bytes", [1 << 20, 0])
def test_prompts_in_chunks_and_from_cached_prefixes_equal_their_solo_runs(cache_bytes):
    eos = [5, 6]
    mix = _shared_prefix_mix(10)
    with ToyStatic() as rt:
        solo = [generate(rt, [p], n, s, eos).rows[0] for p, n, s in mix]
    # 3 slots, 4 tokens a step: every prompt comes in chunks, beside the others' decode steps
    with Batcher(ToyStatic(), limits=BatcherLimits(slots=3, max_queue=16, step_tokens=4,
                                                 prefix_cache_bytes=cache_bytes), eos_ids=eos) as batcher:
        first = batcher.submit(Request(*mix[0]))
        assert wait_all([first], 10)  # its prompt's blocks are cached now
        requests = [first] + [batcher.submit(Request(p, n, s)) for p, n, s in mix[1:]]
        assert wait_all(requests, 30)
        # the next turn of the first conversation: its prompt extends the first one's and its answer
        turn = [*mix[0][0], *first.tokens, 9]
        again = batcher.submit(Request(turn, 3))
        assert wait_all([again], 10)
    for i, (r, s) in enumerate(zip(requests, solo)):
        assert (r.tokens, r.finish_reason) == (s.tokens, s.finish_reason), f"request {i}"
    with ToyStatic() as rt:
        assert again.tokens == generate(rt, [turn], 3).rows[0].tokens
    computed = sum(len(p) for p, _, _ in mix) + len(turn)
    if cache_bytes:
        assert batcher.prefix.hits >= 9 and batcher.prefix.reused >= 9 * 16  # every later one reused the block
        assert batcher.prefix.bytes == len(batcher.prefix) * 16 * ToyStatic().dims.kv_bytes_per_token()
        assert batcher.prefill_tokens == computed - batcher.prefix.reused
    else:
        assert batcher.prefix is None and batcher.prefill_tokens == computed

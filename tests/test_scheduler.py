"""Serving's scheduler (runtimes/serving/scheduler.py) and prefix cache (runtimes/serving/prefix_cache.py), driven
alone: no model, no artifact, no thread (vLLM's tests/v1/core/test_scheduler.py style). The loop's
part is played by hand: `advance` each planned chunk, `finish` a request that ended."""

from __future__ import annotations

import dataclasses

import pytest

from tk.runtimes.serving.prefix_cache import PrefixCache
from tk.runtimes.base import InputError
from tk.runtimes.serving.scheduler import STALL, BatcherLimits, QueueFull, Scheduler, Seq, State
from tk.runtimes.serving.run_cost import PRIOR, WINDOW, CostFit, Costs, RunCost
from tk.runtimes.serving.spec_rule import BATCH_GUESSES, SpeculationRule


def _limits(**limits) -> BatcherLimits:
    """Limits without an idle budget of their own: a step where nobody decodes takes `step_tokens`
    (or `chunk_tokens`) too, as these plans assume."""
    return BatcherLimits(**{"idle_tokens": 0, **limits})


def _ran(sched: Scheduler, plan) -> None:
    """What the loop does after running a plan: every chunk's tokens are in."""
    for chunk in plan.prefill:
        sched.advance(chunk)


def _chunks(plan) -> list[tuple[int, int, int]]:
    return [(c.seq.slot, c.start, c.end) for c in plan.prefill]


def test_admission_takes_the_lowest_free_slots_in_arrival_order_and_the_rest_wait():
    sched = Scheduler(_limits(slots=2, max_queue=4, step_tokens=64))
    a, b, c = Seq([1, 2, 3]), Seq([4, 5]), Seq([6])
    for seq in (a, b, c):
        sched.add(seq)
    plan = sched.schedule()
    assert plan.admitted == [a, b] and _chunks(plan) == [(0, 0, 3), (1, 0, 2)] and plan.decode == []
    assert [s.state for s in (a, b, c)] == [State.PREFILL, State.PREFILL, State.WAITING]
    _ran(sched, plan)
    assert a.state is State.DECODE and b.state is State.DECODE
    plan = sched.schedule()
    assert plan.decode == [a, b] and not plan.admitted and not plan.prefill  # c waits for a slot
    sched.finish(a)  # a ends (EOS, say): its slot is the lowest free one
    plan = sched.schedule()
    assert plan.admitted == [c] and c.slot == 0 and plan.decode == [b]


def test_a_step_decodes_every_running_request_first_and_prefills_a_long_prompt_in_chunks_of_what_is_left():
    sched = Scheduler(_limits(slots=4, max_queue=4, step_tokens=8))
    short = [Seq([1]), Seq([2])]
    for seq in short:
        sched.add(seq)
    _ran(sched, sched.schedule())
    long = Seq(list(range(20)))
    sched.add(long)
    seen = []
    while long.state is not State.DECODE:
        plan = sched.schedule()
        assert plan.decode == short and plan.tokens <= 8  # the budget holds every step
        seen += _chunks(plan)
        _ran(sched, plan)
    assert seen == [(2, 0, 6), (2, 6, 12), (2, 12, 18), (2, 18, 20)]  # 8 - 2 decode tokens per step
    assert sched.schedule().decode == [*short, long]


def test_prompts_already_in_slots_go_before_new_admissions_and_admissions_stop_when_the_budget_is_spent():
    sched = Scheduler(_limits(slots=4, max_queue=4, step_tokens=10))
    first, second, third = Seq(list(range(14))), Seq(list(range(7))), Seq([1, 2])
    sched.add(first)
    plan = sched.schedule()
    assert _chunks(plan) == [(0, 0, 10)]
    _ran(sched, plan)
    sched.add(second)
    sched.add(third)
    plan = sched.schedule()
    assert _chunks(plan) == [(0, 10, 14), (1, 0, 6)] and plan.admitted == [second]  # third: no budget left
    _ran(sched, plan)
    plan = sched.schedule()
    assert plan.decode == [first] and _chunks(plan) == [(1, 6, 7), (2, 0, 2)]


def test_without_chunks_a_prompt_comes_whole_even_over_the_budget_one_admission_per_spent_budget():
    sched = Scheduler(_limits(slots=3, max_queue=4, step_tokens=4), chunked=False)
    a, b = Seq(list(range(9))), Seq([1, 2])
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert _chunks(plan) == [(0, 0, 9)] and b.state is State.WAITING
    _ran(sched, plan)
    assert _chunks(sched.schedule()) == [(1, 0, 2)]


def test_the_queue_refuses_beyond_the_slots_and_its_length_and_takes_again_once_one_leaves():
    sched = Scheduler(_limits(slots=1, max_queue=1, step_tokens=4))
    a, b = Seq([1]), Seq([2])
    sched.add(a)
    sched.add(b)
    with pytest.raises(QueueFull, match="retry later"):
        sched.add(Seq([3]))
    _ran(sched, sched.schedule())
    sched.finish(a)
    sched.add(Seq([3]))  # a left: room again


def test_cancellation_at_every_state():
    sched = Scheduler(_limits(slots=2, max_queue=4, step_tokens=4))
    prefilling, decoding, waiting = Seq(list(range(10))), Seq([1]), Seq([2])
    sched.add(decoding)
    _ran(sched, sched.schedule())
    sched.add(prefilling)
    sched.add(waiting)
    _ran(sched, sched.schedule())
    assert (decoding.state, prefilling.state, waiting.state) == (State.DECODE, State.PREFILL, State.WAITING)
    assert sched.abort(waiting) is True and waiting.state is State.DONE and not sched.waiting  # gone at once
    assert sched.abort(prefilling) is False and sched.abort(decoding) is False  # they leave in the next plan
    plan = sched.schedule()
    assert plan.left == [decoding, prefilling] and not plan.prefill and not plan.decode
    assert not sched.running and not sched.has_work
    assert sched.abort(decoding) is False and decoding.state is State.DONE  # ended already: nothing happens
    late = Seq([5])
    sched.add(late)
    assert sched.schedule().admitted == [late] and late.slot == 0  # the freed slots are free


def test_abort_all_empties_the_queue_now_and_the_slots_at_the_next_plan():
    sched = Scheduler(_limits(slots=1, max_queue=2, step_tokens=4))
    running, queued = Seq([1, 2]), Seq([3])
    sched.add(running)
    sched.add(queued)
    _ran(sched, sched.schedule())
    assert sched.abort_all() == [queued]
    assert sched.schedule().left == [running] and not sched.has_work


def test_a_budget_below_one_decode_token_per_slot_is_refused():
    with pytest.raises(InputError, match="at least 4"):
        BatcherLimits(slots=4, max_queue=0, step_tokens=3)


def test_an_admitted_prompt_starts_from_its_longest_cached_prefix_and_computes_at_least_its_last_token():
    cache = PrefixCache("model-a", block=4)
    system = list(range(100, 112))  # three blocks
    names = cache.names(system)
    for i, name in enumerate(names):
        cache.put(name, names[i - 1] if i else None, f"kv{i}", 10)
    sched = Scheduler(_limits(slots=3, max_queue=4, step_tokens=64), prefix=cache)
    turn, same, logprobs = Seq(system + [7, 8]), Seq(system), Seq(system + [9], reuse=False)
    for seq in (turn, same, logprobs):
        sched.add(seq)
    plan = sched.schedule()
    assert turn.cached == ["kv0", "kv1", "kv2"] and turn.reused == 12 and (0, 12, 14) in _chunks(plan)
    assert same.cached == ["kv0", "kv1"] and (1, 8, 12) in _chunks(plan)  # its last token is computed: logits
    assert logprobs.cached == [] and (2, 0, 13) in _chunks(plan)  # it needs every position's logits
    assert cache.reused == 20 and cache.queried == 14 + 12 and cache.hits == 2


def test_prefix_names_chain_every_block_before_them_and_never_match_under_another_root():
    a, b = PrefixCache("model-a", block=2), PrefixCache("model-b", block=2)
    assert a.names([1, 2, 3, 4, 5]) == a.names([1, 2, 3, 4])  # whole blocks only
    assert a.names([1, 2, 3, 4])[1] != a.names([9, 9, 3, 4])[1]  # the same block after another prefix
    assert a.names([1, 2]) != b.names([1, 2])
    a.put(a.names([1, 2])[0], None, "x", 1)
    assert a.match([1, 2, 3], 2) == ["x"] and b.match([1, 2, 3], 2) == []


def test_the_least_recently_used_chain_end_goes_first_and_a_cached_blocks_parent_stays():
    cache = PrefixCache("m", block=1, max_bytes=4)
    old, new = cache.names([1, 2, 3]), cache.names([7, 8])
    for names in (old, new):
        for i, name in enumerate(names):
            assert cache.put(name, names[i - 1] if i else None, name, 1) or i == 2
    # the fifth block did not fit without evicting: the oldest leaf went (old's third), never a parent
    assert cache.bytes == 4 and cache.evicted == 1 and old[2] not in cache and old[1] in cache and new[1] in cache
    assert cache.match([1, 2, 3, 4], 3) == old[:2]  # touched: now new's chain is the older
    cache.put(cache.names([1, 2, 5])[2], old[1], "z", 1)
    assert new[1] not in cache and new[0] in cache
    assert not cache.put(cache.names([4, 4])[1], cache.names([4, 4])[0], "orphan", 1)  # its parent is not kept
    assert not cache.put(b"big", None, "big", 5)  # alone over the limit


def test_a_step_where_nobody_decodes_takes_the_idle_budget():
    sched = Scheduler(_limits(slots=2, max_queue=2, step_tokens=4, idle_tokens=16))
    a, b = Seq(list(range(20))), Seq([1, 2])
    sched.add(a)
    plan = sched.schedule()
    assert _chunks(plan) == [(0, 0, 16)]  # nobody decodes: nobody waits on this step
    _ran(sched, plan)
    plan = sched.schedule()
    assert _chunks(plan) == [(0, 16, 20)]
    _ran(sched, plan)
    sched.add(b)
    assert _chunks(sched.schedule()) == [(1, 0, 2)]
    assert Scheduler(_limits(slots=2, max_queue=0, step_tokens=4, idle_tokens=1)).idle_tokens == 4


def test_a_prompt_waits_for_the_one_prefilling_its_first_block_then_takes_what_it_cached():
    cache = PrefixCache("m", block=4)
    system = list(range(100, 112))
    sched = Scheduler(_limits(slots=3, max_queue=4, step_tokens=8), prefix=cache)
    first, second, other = Seq(system + [1, 2]), Seq(system + [3]), Seq([7] * 6)
    for seq in (first, second, other):
        sched.add(seq)
    plan = sched.schedule()
    assert plan.admitted == [first] and _chunks(plan) == [(0, 0, 8)]  # second (and the queue behind it) waits
    _ran(sched, plan)
    names = cache.names(first.prompt)
    for i, name in enumerate(names[:2]):  # what the loop stores after first's chunk: its 2 whole blocks
        cache.put(name, names[i - 1] if i else None, f"kv{i}", 1)
    plan = sched.schedule()  # the first block is cached now: second takes what is there
    assert plan.admitted == [second] and second.reused == 8 and _chunks(plan) == [(0, 8, 14), (1, 8, 10)]
    no_cache = Scheduler(_limits(slots=3, max_queue=4, step_tokens=64))
    for seq in (Seq(system + [1]), Seq(system + [2])):
        no_cache.add(seq)
    assert len(no_cache.schedule().admitted) == 2  # without a prefix cache nothing is worth waiting for


def test_the_default_budget_gives_each_prompt_coming_in_a_chunk_of_prompt_oldest_first():
    sched = Scheduler(_limits(slots=4, max_queue=4, chunk_tokens=4))
    running = Seq([1])
    sched.add(running)
    _ran(sched, sched.schedule())
    long, short = Seq(list(range(30))), Seq([5, 6, 7])
    sched.add(long)
    plan = sched.schedule()
    assert plan.decode == [running] and _chunks(plan) == [(1, 0, 4)]  # one prompt coming in: one chunk
    _ran(sched, plan)
    sched.add(short)
    plan = sched.schedule()
    assert _chunks(plan) == [(1, 4, 12)] and short.state is State.WAITING  # two: 8 tokens, the oldest's first


def test_a_burst_of_prompts_beside_fewer_streams_takes_the_idle_budget():
    """More prompts coming in than requests decoding (a burst that arrived over a few steps), or nobody
    decoding: the step takes the idle budget for each prompt coming in, so their first chunks go in
    together rather than a chunk a step each."""
    sched = Scheduler(BatcherLimits(slots=8, max_queue=8, chunk_tokens=4, idle_tokens=64))
    running = Seq([1])
    sched.add(running)
    _ran(sched, sched.schedule())
    burst = [Seq(list(range(10))) for _ in range(3)]
    for seq in burst:
        sched.add(seq)
    plan = sched.schedule()
    assert plan.decode == [running] and _chunks(plan) == [(1, 0, 10), (2, 0, 10), (3, 0, 10)]
    _ran(sched, plan)
    sched.add(Seq(list(range(30))))  # one prompt beside four streams: a chunk of chunk_tokens
    assert _chunks(sched.schedule()) == [(4, 0, 4)]
    idle = Scheduler(BatcherLimits(slots=8, max_queue=8, chunk_tokens=4, idle_tokens=64))
    for seq in [Seq(list(range(60))) for _ in range(3)]:  # nobody decodes: the idle budget for each prompt
        idle.add(seq)
    assert _chunks(idle.schedule()) == [(0, 0, 60), (1, 0, 60), (2, 0, 60)]
    fixed = Scheduler(BatcherLimits(slots=8, max_queue=8, step_tokens=8, idle_tokens=64))  # a fixed budget is kept
    fixed.add(Seq([1]))
    _ran(fixed, fixed.schedule())
    for seq in [Seq(list(range(10))) for _ in range(3)]:
        fixed.add(seq)
    assert _chunks(fixed.schedule()) == [(1, 0, 7)]


# --- speculation in the plan (runtimes/serving/spec_rule.py) ---

def _decoding(sched: Scheduler, n: int, room: int, accepted: int = 0, planned: int = 0) -> list[Seq]:
    """n requests admitted, prefilled and decoding, each allowed `room` guesses and with a history."""
    seqs = [Seq([1, 2]) for _ in range(n)]
    for seq in seqs:
        sched.add(seq)
    _ran(sched, sched.schedule())
    for seq in seqs:
        seq.room, seq.accepted, seq.planned = room, accepted, planned
    return seqs


# a 135M-parameter model's runs on 2 cores, as the loop fits them (CostFit): a run reads the weights once
# (~20 ms), each token adds ~2 ms of compute
CPU = RunCost(fixed=20e-3, per_token=2e-3)


def test_verify_runs_are_charged_k_plus_1_within_the_step_budget_with_the_decode_tokens():
    rule = SpeculationRule(CPU)
    sched = Scheduler(_limits(slots=4, max_queue=4, step_tokens=20), speculation=rule)
    seqs = _decoding(sched, 2, room=8, accepted=90, planned=100)
    plan = sched.schedule()
    assert [(g.seq, g.k) for g in plan.verify] == [(seqs[0], 8), (seqs[1], 8)] and plan.decode == []
    assert plan.tokens == 18 <= 20
    sched.limits = _limits(slots=4, max_queue=4, step_tokens=12)  # room for one request's guesses only
    plan = sched.schedule()
    assert len(plan.verify) == 1 and plan.decode == [seqs[1]] and plan.tokens == 10 <= 12
    for seq in seqs:
        seq.room = 0  # out of room (its budget or the cache's): it decodes plainly
    plan = sched.schedule()
    assert plan.verify == [] and plan.decode == seqs


def test_a_prompt_coming_in_keeps_its_chunk_and_the_guesses_take_what_is_left():
    rule = SpeculationRule(CPU)
    sched = Scheduler(_limits(slots=4, max_queue=4, step_tokens=24, chunk_tokens=8), speculation=rule)
    seqs = _decoding(sched, 2, room=8, accepted=90, planned=100)
    long = Seq(list(range(100)))
    sched.add(long)
    for _ in range(5):
        plan = sched.schedule()
        assert plan.tokens <= 24 and sum(c.end - c.start for c in plan.prefill) >= 8  # the prompt keeps coming in
        assert len(plan.verify) == 1  # 2 decode + 8 + 9 <= 24: one request's guesses fit beside the chunk
        _ran(sched, plan)
    assert seqs[0].state is State.DECODE


def test_a_busy_step_stops_guessing_where_the_measured_costs_say_it_costs_more_than_it_saves():
    """Each guessing request verifies in a run of its own (the fused graph): with few rows the weights read
    dominates and guessing pays; with many the extra runs cost more than the tokens they add."""
    rule = SpeculationRule(CPU)
    for rows, guessing in ((1, 1), (2, 2), (4, 4), (8, 0), (16, 0)):
        sched = Scheduler(_limits(slots=16, max_queue=0), speculation=rule)
        _decoding(sched, rows, room=8, accepted=90, planned=100)  # a copying workload: 90% accepted
        assert len(sched.schedule().verify) == guessing, rows
    # rows whose guesses miss are not worth a run even alone
    sched = Scheduler(_limits(slots=16, max_queue=0), speculation=rule)
    _decoding(sched, 1, room=8, accepted=2, planned=100)
    assert sched.schedule().verify == []
    # verify runs batched into one run (a graph that takes several rows' runs): guessing pays at 8 rows too
    batched = SpeculationRule(CPU, batched=True)
    sched = Scheduler(_limits(slots=16, max_queue=0), speculation=batched)
    _decoding(sched, 8, room=8, accepted=90, planned=100)
    assert len(sched.schedule().verify) == 8
    # a cap on the decoding requests (vLLM's disable_by_batch_size) wins over the costs
    capped = SpeculationRule(CPU, max_rows=1)
    sched = Scheduler(_limits(slots=16, max_queue=0), speculation=capped)
    _decoding(sched, 2, room=8, accepted=90, planned=100)
    assert sched.schedule().verify == []


def test_a_prompt_beside_streams_takes_a_run_that_costs_stall_times_the_steps_runs_where_they_are_measured():
    """With the loop's costs measured (`costs`), a prompt coming in beside decoding requests takes the
    tokens whose run (the prompt chunks' own fit) costs STALL times the step's decode and verify runs
    (the steps' fit), at least chunk_tokens: a stream's gap at most doubles, and a prompt comes in
    faster beside a costly step (verify runs); in whole chunk_tokens, so the runs' shapes stay few."""
    def prompt_tokens(costs, spec=None, rows=3):
        sched = Scheduler(BatcherLimits(slots=8, max_queue=8, chunk_tokens=16, idle_tokens=64), costs=costs,
                          speculation=spec)
        _decoding(sched, rows, room=8, accepted=90, planned=100)
        sched.add(Seq(list(range(1000))))
        plan = sched.schedule()
        assert len(plan.decode) + len(plan.verify) == rows
        return sum(c.end - c.start for c in plan.prefill), plan

    def costs(steps: RunCost, prompts: RunCost = CPU) -> Costs:
        c = Costs()
        c.steps, c.prompts = CostFit(steps), CostFit(prompts)  # (their priors until runs are measured)
        return c

    assert prompt_tokens(None)[0] == 16  # not measured: chunk_tokens
    # 3 rows' decode run (26 ms) beside a chunk that reads the weights too (20 ms + 2 ms a token): 16
    assert prompt_tokens(costs(CPU))[0] == 16
    heavy = RunCost(fixed=100e-3, per_token=2e-3)  # a costly step: the chunk takes (106 - 20) / 2 = 43 tokens
    assert prompt_tokens(costs(heavy))[0] == int((STALL * 106e-3 - 20e-3) / 2e-3) // 16 * 16 == 32
    # three requests guessing, a verify run each (38 ms): (114 - 20) / 2 = 47 tokens, 32 in whole chunks
    n, plan = prompt_tokens(costs(CPU), SpeculationRule(CPU, accepted=90, planned=100))
    assert len(plan.verify) == 3 and n == 32
    assert prompt_tokens(costs(RunCost(fixed=1.0, per_token=1e-3)))[0] == 64  # never over the idle budget
    # a plain step's decode costs what the last one measured (a fit of rows misses what the rows' width adds)
    wide = costs(CPU)
    wide.decode = 0.106
    assert prompt_tokens(wide)[0] == 32
    # the rule's costs are the steps' fit, not the prompts'
    measured = costs(CPU)
    for tokens in (1, 9, 16, 64):
        measured.add(tokens, 0.050 + 0.004 * tokens)
        measured.add(tokens * 8, 0.5, prompt=True)
    spec = SpeculationRule(CPU, accepted=90, planned=100)
    prompt_tokens(measured, spec)
    assert spec.cost.fixed == pytest.approx(0.050) and spec.cost.per_token == pytest.approx(0.004)


def test_the_cost_fit_recovers_what_runs_cost_and_keeps_its_priors_shape_until_it_has_two_sizes():
    fit = CostFit(RunCost(1.0, 1.0))
    fit.add(4, 0.5)  # the first run pays what a process pays once: not counted
    assert fit.cost == RunCost(1.0, 1.0, widest=0)
    for _ in range(3):
        fit.add(4, 0.028)
    # one size: no slope to fit; the prior's shape at what they cost (1 + 4 tokens' 1 a token: 0.028)
    assert fit.cost.fixed == pytest.approx(0.028 / 5) and fit.cost.per_token == pytest.approx(0.028 / 5)
    two = CostFit(RunCost(1.0, 1.0))
    two.add(64, 0.5)
    two.add(4, 0.028)
    two.add(16, 0.052)
    assert two.cost.fixed == pytest.approx(0.020) and two.cost.per_token == pytest.approx(0.002)  # two runs suffice
    for tokens in (1, 2, 9, 16, 64, 3, 9):
        fit.add(tokens, 0.020 + 0.002 * tokens)
    assert fit.cost.fixed == pytest.approx(0.020) and fit.cost.per_token == pytest.approx(0.002)


def test_rows_verified_in_one_run_guess_at_most_batch_guesses_each_and_a_lone_row_its_whole_room():
    """A lone row's verify run reads the weights for its guesses (a long copy pays); rows verified
    together pay each guess's compute, so each verifies at most BATCH_GUESSES (and is charged that)."""
    batched = SpeculationRule(CPU, batched=True)
    sched = Scheduler(_limits(slots=16, max_queue=0), speculation=batched)
    seqs = _decoding(sched, 4, room=16, accepted=95, planned=100)
    plan = sched.schedule()
    assert [g.k for g in plan.verify] == [BATCH_GUESSES] * 4 and plan.tokens == 4 * (BATCH_GUESSES + 1)
    for seq in seqs[1:]:
        seq.room = 0  # the others have no guesses: the one that has verifies them all
    assert [(g.seq, g.k) for g in sched.schedule().verify] == [(seqs[0], 16)]
    alone = SpeculationRule(CPU)  # each row's run its own (the fused graph): no cap
    sched = Scheduler(_limits(slots=16, max_queue=0), speculation=alone)
    _decoding(sched, 2, room=16, accepted=95, planned=100)
    assert [g.k for g in sched.schedule().verify] == [16, 16]


def test_rows_verified_in_one_run_are_costed_as_the_rectangle_the_run_computes():
    """A batched verify run pads every row to the longest (runtimes/serving/stepping.py records what it computes):
    8 guesses beside 1 cost 2 x 9 tokens, not 9 + 2; runs of their own cost each its own. Where runs take the
    cache's leading rows (`leading`: a CPU), a slot below the highest that sits a run out is computed too."""
    batched, alone = SpeculationRule(CPU, batched=True), SpeculationRule(CPU)
    assert batched.width([0, 1], [8, 1]) == 18 and alone.width([0, 1], [8, 1]) == 9 and batched.width([], []) == 0
    assert batched.seconds([2], [0, 1], [8, 1]) == pytest.approx(CPU.run(1) + CPU.run(18))
    assert alone.seconds([2], [0, 1], [8, 1]) == pytest.approx(CPU.run(1) + CPU.run(9) + CPU.run(2))
    leading = SpeculationRule(CPU, batched=True, leading=True)  # slots 1 and 5 verify, 0, 2, 3, 4, 6, 7 decode
    assert leading.rows([0, 2, 3, 4, 6, 7]) == 8 and leading.width([1, 5], [8, 8]) == 6 * 9
    assert leading.seconds([0, 2, 3, 4, 6, 7], [1, 5], [8, 8]) == pytest.approx(CPU.run(8) + CPU.run(54))
    # a fresh row's one guess beside eight, a third row decoding: 10.8 tokens in 64 ms ragged (11 tokens) would
    # beat 10.3 in 62 without it; as the rectangle the run computes (18 tokens, 78 ms) it does not
    sched = Scheduler(_limits(slots=16, max_queue=0), speculation=batched)
    long, short, plain = _decoding(sched, 3, room=8, accepted=95, planned=100)
    short.room, short.accepted, short.planned, plain.room = 1, 0, 0, 0
    assert [(g.seq, g.k) for g in sched.schedule().verify] == [(long, 8)]


def test_guessing_slots_above_rows_that_sit_their_run_out_pay_for_them():
    """Eight slots decoding on a CPU (`leading`), two copying (95% of their guesses kept) and the others not
    guessing. In slots 0 and 1 their verify run is 2 rows x 9 positions (56 ms) beside the others' decode
    run (36 ms: slots 2-7 take rows 0-7): 22.7 tokens in 92 ms beat 8 in 36. In slots 6 and 7 their run
    computes all eight leading rows x 9 (164 ms) beside 6 rows (32 ms): 22.7 tokens in 196 ms do not. A rule
    that counted the guessing rows alone (18 positions) would guess there too. One guessing row runs alone
    (its own row's view): 9 positions wherever its slot."""
    def guesses(rule, copying):
        sched = Scheduler(_limits(slots=8, max_queue=0), speculation=rule)
        seqs = _decoding(sched, 8, room=0)
        for slot in copying:
            seqs[slot].room, seqs[slot].accepted, seqs[slot].planned = 8, 95, 100
        return len(sched.schedule().verify)

    leading = SpeculationRule(CPU, batched=True, leading=True)
    assert guesses(leading, [0, 1]) == 2 and guesses(leading, [6, 7]) == 0
    assert guesses(SpeculationRule(CPU, batched=True), [6, 7]) == 2
    assert leading.width([7], [8]) == 9 == leading.width([0], [8])


def test_a_verify_run_wider_than_the_fit_measured_is_tried_once_and_then_judged_by_its_cost():
    """A fit of decode steps alone (1 and 8 rows: 75 ms + 9.5 ms a token) overprices a verify run of
    72 tokens, which costs 98 ms + 4.7 a token measured (the real 0.5B, `--for serve`): fresh requests
    (half their guesses assumed kept) would never guess, so their verify run would never be measured.
    Wider than its widest run of late, the fit is not trusted: the step verifies, once."""
    steps = CostFit(PRIOR)
    for rows in [1] * 4 + [8] * 12:
        steps.add(rows, 0.075 + 0.0095 * rows)
    assert steps.cost.widest == 8 and steps.cost.per_token == pytest.approx(0.0095)
    for batched, trying in ((True, 8), (False, 1)):  # runs of their own: one row's run measures them
        rule = SpeculationRule(steps.cost, batched=batched)
        sched = Scheduler(_limits(slots=16, max_queue=0), speculation=rule)
        seqs = _decoding(sched, 8, room=8)
        assert len(sched.schedule().verify) == trying
        rule.cost = dataclasses.replace(steps.cost, widest=None)  # (measured at any size: the line decides)
        assert sched.schedule().verify == []
        for seq in seqs[2:]:
            seq.planned = 8  # six missed every guess: only two are worth trying
        rule.cost = steps.cost
        assert len(sched.schedule().verify) == min(trying, 2)
    for _ in range(3):
        steps.add(72, 0.098 + 0.0047 * 72)  # measured: the line bends, and guessing pays
    rule = SpeculationRule(steps.cost, batched=True)
    assert steps.cost.widest == 72 and steps.cost.per_token < 0.0075
    sched = Scheduler(_limits(slots=16, max_queue=0), speculation=rule)
    _decoding(sched, 8, room=8)
    assert len(sched.schedule().verify) == 8
    for _ in range(WINDOW):
        steps.add(8, 0.151)  # forgotten after WINDOW runs that were narrower
    assert steps.cost.widest == 8


def test_a_request_that_has_not_guessed_yet_tries_whatever_the_others_missed():
    """Whether guesses land is each request's own (a copying answer's do, a free one's not): after the
    batcher's first requests missed every guess, a new one still tries (EXPLORE), and then its own
    record decides."""
    rule = SpeculationRule(CPU, batched=True, accepted=0, planned=8)
    sched = Scheduler(_limits(slots=16, max_queue=0), speculation=rule)
    fresh = _decoding(sched, 4, room=8)
    assert len(sched.schedule().verify) == 4
    for seq in fresh:
        seq.planned = 8  # each missed its own 8 guesses: no more
    assert sched.schedule().verify == []
    for seq in fresh:
        seq.accepted = 8  # each kept them all: on
    assert len(sched.schedule().verify) == 4

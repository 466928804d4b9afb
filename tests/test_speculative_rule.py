"""Speculative decoding's acceptance step (`Row.take_verified`: the one `tk generate`, `tk bench` and the
batcher use, so the server's sampled drafts too) and `PromptLookup`: pure numpy, no model.

The sampled tests draw one guess N times and check the token kept at its position with a chi-square
goodness-of-fit test at level 0.001 (critical values CHI2_999). Its power: the statistic is about
noncentral chi-square with lambda = N * chi2(r || p) >= 4 N TV(r, p)^2 (Cauchy-Schwarz), and
P(chi2_dof(lambda) > CHI2_999[dof]) >= 0.99 once lambda >= 32, 35.5, 38, 40.5, 42.5 for 1 .. 5 dof
(numpy's noncentral_chisquare, 4e5 draws). So any output distribution r with
TV(r, p) >= sqrt(42.5 / (4 N)) is rejected with probability >= 0.99: TV 0.023 for N = 20000
(temperature 1, draft), 0.033 for N = 10000 (temperature 1, fixed guess), 0.060 for N = 3000 (top-k,
top-p); 0.03 for the ~12300 bonus tokens of the first case. The wrong rules of the negative controls
(WRONG) are off by TV 0.14 .. 0.38 and are rejected at the same N.
"""

from typing import NamedTuple

import numpy as np
import pytest

from tk.models.spec.errors import UsageProblem
from tk.runtimes.decoding.row import Row, drain
from tk.runtimes.decoding.sampling import NO_TOKEN, Sampler, SamplingConfig
from tk.runtimes.decoding.speculative import PromptLookup, Proposal

V = 6
LOGITS = np.random.default_rng(0).normal(0, 1, (2, V)).astype(np.float32)  # row 0: the guess's; row 1: bonus
Q = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])  # the draft's distribution: TV 0.38 .. 0.55 from p
GUESS = 2  # the deterministic proposer's guess (the argmax of row 0)
# 0.999 quantiles of chi-square with 1 .. 5 degrees of freedom (standard tables; scipy is not in the venv)
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
CASES = {  # id: (sampling config at temperature 1, guess drawn from Q (else GUESS), N)
    "t1-draft": ({}, True, 20_000), "t1-fixed": ({}, False, 10_000),
    "top_k4-draft": ({"top_k": 4}, True, 3_000), "top_k4-fixed": ({"top_k": 4}, False, 3_000),
    "top_p0.8-draft": ({"top_p": 0.8}, True, 3_000), "top_p0.8-fixed": ({"top_p": 0.8}, False, 3_000)}


class Verdict(NamedTuple):
    kept: list[int]  # the accepted guesses, then the target's own token (NO_TOKEN: none was possible)
    accepted: int


def judge(sampler: Sampler, logits: np.ndarray, guess: Proposal, seen: np.ndarray | None, rng=None) -> Verdict:
    """One verify run's verdict through `Row.take_verified`: a row over `sampler` (its generator goes on
    across calls) whose prompt is the `seen` tokens, EOS ignored, room for every guess."""
    prompt = [] if seen is None else np.flatnonzero(seen[0]).tolist()
    row = Row(prompt, len(guess.tokens) + 1, sampler.config, vocab_size=logits.shape[-1], ignore_eos=True)
    row.sampler = sampler
    ended = []
    accepted = drain(row.take_verified(logits, guess.tokens, guess.probs),
                     lambda e: e.token is None and ended.append(e.finish_reason))
    nothing = [NO_TOKEN] if ended and len(row.tokens) < len(guess.tokens) + 1 and ended[0] == "stop" else []
    return Verdict(row.tokens + nothing, accepted)


def target(config: dict) -> tuple[Sampler, np.ndarray]:
    """The row's sampler and the distributions (2, V) it makes of LOGITS (its own top-k / top-p)."""
    sampler = Sampler(SamplingConfig(temperature=1.0, **config))
    p = sampler.probs(sampler.scaled(LOGITS)).astype(np.float64)
    return sampler, p / p.sum(-1, keepdims=True)


def fits(tokens: np.ndarray, p: np.ndarray) -> bool:
    """Chi-square goodness of fit of `tokens` to `p` at level 0.001 (a token p excludes fails it)."""
    counts, support = np.bincount(tokens, minlength=len(p)), p > 0
    if counts[~support].any():
        return False
    expected = len(tokens) * p[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()) < CHI2_999[int(support.sum()) - 1]


def run(rule, sampler: Sampler, draft: bool, n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """n verdicts of `rule` on one guess (drawn from Q when `draft`, else GUESS with probs None):
    the first kept token of each, and the bonus token of each that accepted its guess."""
    rng = np.random.default_rng(seed)
    guesses = rng.choice(V, n, p=Q) if draft else np.full(n, GUESS)
    first, bonus = np.empty(n, np.int64), []
    for i, x in enumerate(guesses):
        verdict = rule(sampler, LOGITS, Proposal([int(x)], Q[None] if draft else None), None, rng)
        first[i] = verdict.kept[0]
        if verdict.accepted:
            bonus.append(verdict.kept[1])
    return first, np.array(bonus, np.int64)


def accept_always(sampler, logits, guess, seen, rng) -> Verdict:
    """Wrong: keeps every guess, so the output is the proposer's distribution."""
    return Verdict([*guess.tokens, 0], len(guess.tokens))


def residual_is_p(sampler, logits, guess, seen, rng) -> Verdict:
    """Wrong: accepts as it should but on a rejection draws from p, not norm(max(0, p - q)).
    (p of row 0 at temperature 1 is P0, worked out once: the control costs little time.)"""
    x = guess.tokens[0]
    qx = 1.0 if guess.probs is None else float(guess.probs[0, x])
    if rng.random() * qx < P0[x]:
        return Verdict([x, 0], 1)
    return Verdict([int(np.searchsorted(P0.cumsum(), rng.random() * P0.sum(), side="right"))], 0)


P0 = target({})[1][0]
WRONG = {  # id: (rule, guess drawn from Q, N as its case above), and the TV from p of what it outputs
    "accept_always-draft": (accept_always, True, 20_000),  # TV 0.38
    "residual_is_p-draft": (residual_is_p, True, 20_000),  # TV 0.14
    "residual_is_p-fixed": (residual_is_p, False, 10_000)}  # TV 0.20 (p(x) (1 - p(x)))


@pytest.mark.parametrize("case", CASES)
def test_sampled_tokens_keep_target_distribution(case):
    """The token judge keeps at the guess's position is distributed as p (the sampler's own, top-k /
    top-p included) whatever the proposer, and the bonus after an accepted guess as p at row 1."""
    config, draft, n = CASES[case]
    sampler, p = target(config)
    first, bonus = run(judge, sampler, draft, n)
    assert fits(first, p[0])
    assert len(bonus) > 0.2 * n and fits(bonus, p[1])


@pytest.mark.parametrize("name", WRONG)
def test_chi_square_rejects_wrong_rules(name):
    """Negative control: the same test at the same N rejects a rule that does not keep p."""
    rule, draft, n = WRONG[name]
    sampler, p = target({})
    first, _ = run(rule, sampler, draft, n)
    assert not fits(first, p[0])


def test_greedy_keeps_guesses_while_argmax():
    """Greedy keeps guesses while each is its row's argmax, then the argmax; all kept: the bonus."""
    logits = np.zeros((4, V), np.float32)
    logits[[0, 1, 2, 3], [3, 1, 4, 2]] = 5.0  # argmaxes 3, 1, 4, 2
    sampler, rng = Sampler(SamplingConfig()), np.random.default_rng(0)
    assert judge(sampler, logits, Proposal([3, 1, 0]), None, rng) == Verdict([3, 1, 4], 2)
    assert judge(sampler, logits, Proposal([5, 1, 4]), None, rng) == Verdict([3], 0)
    assert judge(sampler, logits, Proposal([3, 1, 4]), None, rng) == Verdict([3, 1, 4, 2], 3)
    assert judge(sampler, logits[:1], Proposal([]), None, rng) == Verdict([3], 0)


def test_greedy_penalty_sees_earlier_guesses():
    """With a repetition penalty, position j's argmax is taken with `seen` plus the guesses before j
    marked; the caller's `seen` is left as it was."""
    logits = np.zeros((3, V), np.float32)
    logits[0, [1, 2]] = 4.0, 3.0  # 1 is seen: 4 / 2 < 3, so the argmax is 2
    logits[1, [2, 5]] = 3.0, 2.0  # 2 is guessed at position 0: 3 / 2 < 2, so the argmax is 5
    logits[2, 4] = 1.0
    sampler, rng = Sampler(SamplingConfig(repetition_penalty=2.0)), np.random.default_rng(0)
    seen = np.zeros((1, V), bool)
    seen[0, 1] = True
    before = seen.copy()
    assert judge(sampler, logits, Proposal([2, 2]), seen, rng) == Verdict([2, 5], 1)
    assert np.array_equal(seen, before)
    assert judge(sampler, logits, Proposal([2, 5]), seen, rng) == Verdict([2, 5, 4], 2)
    # without the penalty neither the seen token nor the guess is pushed down
    assert judge(Sampler(SamplingConfig()), logits, Proposal([2, 2]), seen, rng).kept[0] == 1
    assert judge(Sampler(SamplingConfig()), logits, Proposal([1, 2]), seen, rng) == Verdict([1, 2, 4], 2)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_impossible_row_gives_no_token(temperature):
    """A row where every logit is -inf yields NO_TOKEN, at a guess's position or at the bonus."""
    sampler, rng = Sampler(SamplingConfig(temperature=temperature)), np.random.default_rng(0)
    dead = np.full((2, V), -np.inf, np.float32)
    for probs in (None, np.full((1, V), 1 / V)):
        assert judge(sampler, dead, Proposal([2], probs), None, rng) == Verdict([NO_TOKEN], 0)
    assert judge(sampler, dead[:1], Proposal([]), None, rng) == Verdict([NO_TOKEN], 0)
    sure = dead.copy()
    sure[0, 2] = 0.0  # the guess is the only possible token, then nothing is
    assert judge(sampler, sure, Proposal([2]), None, rng) == Verdict([2, NO_TOKEN], 1)


def test_prompt_lookup_longest_then_latest_match():
    """The longest suffix n-gram (max_n down to min_n) wins, then its latest earlier occurrence;
    at most k of the tokens that followed it are proposed."""
    text = [7, 1, 2, 3, 8, 6, 1, 2, 3, 9, 7, 1, 2, 3]
    assert PromptLookup(2, 4).lookup(np.array(text), 3) == [8, 6, 1]  # [7 1 2 3] at 0 beats [1 2 3] at 6
    assert PromptLookup(2, 3).lookup(np.array(text), 3) == [9, 7, 1]  # [1 2 3]: the latest, at 6
    twice = [7, 1, 2, 3, 8, 7, 1, 2, 3, 9, 7, 1, 2, 3]
    assert PromptLookup(2, 4).lookup(np.array(twice), 2) == [9, 7]
    assert PromptLookup(2, 4).lookup(np.array([1, 2, 1, 2]), 5) == [1, 2]  # fewer than k remain
    proposals = PromptLookup(1, 2).propose([0, 1], [[5, 9, 1, 5], [4, 4]], [3, 3])
    assert [(g.tokens, g.probs) for g in proposals] == [([9, 1, 5], None), ([4], None)]


def test_prompt_lookup_guesses_more_while_its_guesses_are_kept_and_fewer_when_not():
    """A row's span (transformers' heuristic schedule): it starts at `start`, grows by two after the
    target kept every guess (a short match's too), shrinks by one after it did not (at least one),
    stays within the loop's k, and is the row's own; a new prompt in the row starts over."""
    copied = list(range(3, 43))
    text = copied + copied[:4]  # a copy: after [3 4 5 6] the lookup has the 36 tokens that followed
    lookup, greedy = PromptLookup(2, 4, start=4), SamplingConfig()
    for row in (0, 1):
        lookup.begin(row, text, greedy)

    def guess(row, k=16):
        return len(lookup.propose([row], [text], [k])[0].tokens)

    spans = []
    for kept in ("all", "all", "all", "all", 3, 0, 0, 0, 0, 0, 0, 0, 0, "all"):
        n = guess(0, k=9)
        spans.append(n)
        lookup.accept(0, n if kept == "all" else kept)
    assert spans == [4, 6, 8, 9, 9, 8, 7, 6, 5, 4, 3, 2, 1, 1]  # (k = 9 caps it)
    assert guess(1) == 4  # the other row's own
    short = [1, 7, 8, 7, 8]  # [7 8] recurs with two tokens after it
    assert lookup.propose([1], [short], [16])[0].tokens == [7, 8]
    lookup.accept(1, 2)
    assert guess(1) == 6
    lookup.begin(0, text, greedy)
    assert guess(0) == 4
    assert PromptLookup().propose([0], [text], [16])[0].tokens == copied[4:12]  # SPAN_START, unbegun


def test_prompt_lookup_nothing_and_usage():
    """No match (or a match shorter than min_n), k = 0 and too short a text propose nothing;
    min_n > max_n or min_n < 1 is a usage problem."""
    lookup = PromptLookup(2, 4)
    assert lookup.lookup(np.array([1, 2, 3, 4]), 3) == []
    assert lookup.lookup(np.array([5, 9, 1, 5]), 3) == []  # only the 1-gram [5] recurs
    assert lookup.lookup(np.array([7, 1, 2, 3, 8, 7, 1, 2, 3]), 0) == []
    assert lookup.lookup(np.array([1]), 3) == [] and lookup.lookup(np.array([], np.int64), 3) == []
    for min_n, max_n in ((3, 2), (0, 2)):
        with pytest.raises(UsageProblem):
            PromptLookup(min_n, max_n)

"""Logits processors and log-probabilities (runtimes/decoding/logits.py): pure numpy, each against its definition."""

from __future__ import annotations

import numpy as np
import pytest

from tk.runtimes.decoding.logits import Penalties, log_softmax, logit_bias, min_tokens, token_logprobs


def _logits(seed=0, v=50):
    return (np.random.default_rng(seed).standard_normal((1, v)) * 8).astype(np.float32)  # far from flat


def test_log_probabilities_are_the_log_softmax_with_the_top_alternatives():
    x = np.concatenate([_logits(s) for s in range(70)])  # over one chunk of positions
    want = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(log_softmax(x), want, atol=1e-5)
    tokens = np.random.default_rng(1).integers(0, 50, 70).tolist()
    scored = token_logprobs(x, tokens, top=4)
    for row, token, s in zip(want, tokens, scored):
        assert s.token == token and abs(s.logprob - row[token]) < 1e-5
        assert [t for t, _ in s.top] == np.argsort(-row)[:4].tolist()
    assert token_logprobs(x[:1], [3])[0].top == ()


def test_bias_min_tokens_and_penalties_change_what_they_say():
    x = _logits()
    biased = logit_bias({3: 100.0, 4: -100.0}, 50)(x, [])
    np.testing.assert_allclose(biased[0, 3:6] - x[0, 3:6], [100, -100, 0], atol=1e-4)
    assert (biased[0, 5:] == x[0, 5:]).all() and biased.dtype == np.float32
    early = min_tokens(2, [0, 1])
    assert np.isneginf(early(x, [7])[0, :2]).all() and (early(x, [7, 8]) == x).all()
    assert (x == _logits()).all()  # nothing changed its input: the raw logits stay for log-probabilities
    pen = Penalties(presence=0.5, frequency=0.25, vocab_size=50)
    out = pen(x, [9, 9, 10])
    np.testing.assert_allclose((x - out)[0, 9:12], [0.5 + 0.5, 0.5 + 0.25, 0], atol=1e-6)
    assert out.dtype == np.float32
    out = pen(x, [9, 9, 10, 9])  # counts only the tokens it has not seen
    np.testing.assert_allclose((x - out)[0, 9], 0.5 + 0.75, atol=1e-6)


def test_the_sampler_never_draws_a_banned_token_and_a_tiny_temperature_is_greedy():
    from tk.runtimes.decoding.sampling import Sampler, SamplingConfig

    x = np.full((1, 50), -np.inf, dtype=np.float32)
    x[0, [3, 49]] = [0.0, -30.0]  # the last token: a mass far below float32's epsilon of the total
    draws = {int(Sampler(SamplingConfig(temperature=1.0, seed=s))(x)[0]) for s in range(2000)}
    assert draws <= {3, 49}
    x = _logits()
    assert Sampler(SamplingConfig(temperature=1e-300, seed=1))(x)[0] == x.argmax()  # not NaN, not token 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_still_draw_within_the_mask_and_no_possible_token_ends_the_row(temperature):
    """A processor's NaN or +inf (or a denormal repetition penalty's overflow) is caught at the row:
    the draw stays among the tokens the mask allows; a row with none possible draws NO_TOKEN, a stop."""
    from tk.runtimes.decoding.rows import FinishReason, RowPolicy
    from tk.runtimes.decoding.sampling import NO_TOKEN, Sampler, SamplingConfig

    allowed = np.zeros((1, 50), dtype=bool)
    allowed[0, [7, 20, 31]] = True
    mask = lambda logits, tokens: np.where(allowed, logits, np.float32(-np.inf))  # a grammar's, last
    weird = {"nan": lambda x, t: np.full_like(x, np.nan), "+inf": lambda x, t: np.where(x > 0, np.inf, x),
             "-inf here": lambda x, t: np.where(np.arange(50) == 7, -np.inf, x), "mixed": lambda x, t: x * np.where(
                 np.arange(50) % 2, np.inf, np.nan).astype(np.float32)}
    seen = np.ones((1, 50), dtype=bool)
    for name, process in weird.items():
        for seed in range(200 if temperature else 1):
            for penalty in (1.0, 5e-324):
                config = SamplingConfig(temperature=temperature, repetition_penalty=penalty, seed=seed)
                logits = mask(process(_logits(seed), []), [])
                token = int(Sampler(config)(logits, seen if penalty != 1.0 else None)[0])
                assert token == NO_TOKEN or allowed[0, token], (name, seed, penalty, token)
                possible = np.isfinite(logits) | np.isposinf(logits)  # what the row allowed, before the penalty
                assert (token == NO_TOKEN) == (not possible.any()), (name, seed, penalty)
    top = mask(_logits(), [])
    assert Sampler(SamplingConfig(temperature=1.0, top_p=5e-324))(top)[0] == top.argmax()  # the top token only
    for config in (SamplingConfig(temperature=temperature),
                   SamplingConfig(temperature=temperature, top_k=3, top_p=0.5)):
        assert Sampler(config)(np.full((2, 50), -np.inf, dtype=np.float32)).tolist() == [NO_TOKEN] * 2
    policy = RowPolicy([1, 2], 10, eos_ids=[0], ignore_eos=True)
    assert not policy.add(NO_TOKEN) and policy.finish_reason == FinishReason.STOP and policy.tokens == []
    with pytest.raises(Exception, match="finite"):
        SamplingConfig(repetition_penalty=float("inf"))


def test_a_backend_that_cannot_score_a_prompt_says_how_to_export_one():
    from types import SimpleNamespace

    from tk.runtimes.slots import Slots

    trt = SimpleNamespace(name="trt", all_prefill_logits=False, row_slices=False)
    assert "--prefill-logits all" in Slots.prompt_logits_problem(trt)
    assert Slots.prompt_logits_problem(SimpleNamespace(name="ort", all_prefill_logits=False, row_slices=True)) is None

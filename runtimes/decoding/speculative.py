"""Speculative decoding: a proposer guesses up to k tokens per row, the target checks them all in one
decode run (`Runtime.verify`), and each row keeps its longest accepted prefix plus one token of the
target's own, so one run of the target's weights yields 1 .. k + 1 tokens.

Acceptance is the standard rule (Leviathan et al. 2023; Chen et al. 2023), applied to what the
row's own `Sampler` makes of the target's logits at every verified position (its penalty seeing the
guesses before that position): greedy keeps a guess while it is the argmax, so the output is the
plain greedy output token for token; sampling keeps guess x with probability min(1, p(x) / q(x))
and on a rejection draws from norm(max(0, p - q)) (a deterministic guess has q one-hot at x), so
the tokens keep the target's distribution whatever the proposer.

A `Proposer` is one small interface: `start` with the prompts, `propose` for the rows still
running (their whole text so far), `accepted` (how many of its guesses each row kept), `keep`
(rows leaving, as `Session.keep`), `close`. Two are here: `PromptLookup` (n-gram match over the
row's own text, vLLM's `prompt_lookup_min/max`) and `DraftModel` (another runtime of the same
vocabulary, its static cache kept in step with the target's by `Runtime.rewind`). A proposer of
heads on the target (EAGLE, MTP) fits the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tk.models.spec.errors import UsageProblem
from tk.runtimes.base import InputError, Runtime
from tk.runtimes.decoding.rows import left_pad
from tk.runtimes.decoding.sampling import NO_TOKEN, Sampler, SamplingConfig


@dataclass
class Proposal:
    tokens: list[int]  # the guesses, in order
    probs: np.ndarray | None = None  # (len(tokens), V): the distribution each was drawn from; None: deterministic


class Proposer(ABC):
    """Guesses the next tokens of the rows a target runs."""

    name = "proposer"

    def start(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> None:
        """A new batch of rows (0 .. B - 1) with these prompts, sampled with `sampling`."""

    @abstractmethod
    def propose(self, texts: list[list[int]], ks: list[int]) -> list[Proposal]:
        """For each row still running (in the order of the last `keep`), at most ks[i] guesses
        following texts[i] (its prompt and every token kept so far)."""

    def accepted(self, counts: list[int]) -> None:
        """How many of each row's last guesses the target kept."""

    def keep(self, rows: list[int]) -> None:
        """Only these rows (indices into the rows still running) go on."""

    def close(self) -> None:
        """Release what the proposer holds."""


class PromptLookup(Proposer):
    """The tokens that followed the latest earlier occurrence of the row's last n tokens (n from
    `max_n` down to `min_n`) in the row's own text: what a code edit, a summary or a RAG answer
    copies from its prompt (vLLM's ngram method; llama.cpp's lookup)."""

    name = "lookup"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise UsageProblem(f"prompt lookup needs 1 <= min n-gram <= max n-gram, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, texts, ks):
        return [Proposal(self.lookup(np.asarray(t, dtype=np.int64), k)) for t, k in zip(texts, ks)]

    def lookup(self, text: np.ndarray, k: int) -> list[int]:
        L = len(text)
        if k <= 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows of n tokens that start at 0 .. L - 1 - n: each is followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(text[:-1], n)
            hits = np.flatnonzero((windows == text[-n:]).all(-1))
            if len(hits):
                at = int(hits[-1]) + n
                return text[at:at + k].tolist()
        return []


# a draft's guess needs this much of its own probability (llama.cpp's --spec-draft-p-min, which defaults to 0
# there: tk's default spends no draft step or verified position on a guess its draft is unsure of)
P_MIN = 0.75


def confidence(logits: np.ndarray) -> np.ndarray:
    """(B, V) logits -> (B,) the top token's probability."""
    peak = logits.max(-1, keepdims=True)
    return 1.0 / np.exp(logits - peak).sum(-1)


class DraftModel(Proposer):
    """A smaller model of the same vocabulary (a tk artifact whose decode graph verifies runs) that
    drafts k tokens a row, one decode step each, from its own static cache. Before drafting, the
    cache catches up on the tokens it has not run (the target's token, and a guess it drafted
    without running), in one run; after the target's verdict it rewinds to what the row kept. A row
    stops guessing at the first token the draft gives less than `p_min` of its probability (llama.cpp's
    --spec-draft-p-min): an unsure draft's guesses cost a draft step and a verified position each."""

    name = "draft"

    def __init__(self, runtime: Runtime, vocab_size: int, p_min: float = P_MIN):
        problem = runtime.verify_problem
        if problem:
            raise InputError(f"the draft: {problem}")
        self.runtime, self.vocab_size, self.p_min = runtime, vocab_size, p_min
        self.session = self.sampler = None
        self.held: list[int] = []  # per row, the positions of its cache that are its true text
        self.drafted: list[int] = []  # per row, the guesses of the last proposal

    def start(self, prompts, sampling):
        self.close()
        self.runtime.activate()  # its owner deactivates it (a draft stays loaded across generations)
        self.sampler = Sampler(SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k,
                                              top_p=sampling.top_p, seed=sampling.seed + 1))
        _, self.session = self.runtime.start(*left_pad(prompts), room=0)
        self.held = [len(p) for p in prompts]
        self.drafted = [0] * len(prompts)

    def _pick(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The draft's logits (B, V_draft) -> its guesses (B,) and their distributions (B, V) (None: greedy)."""
        V = self.vocab_size
        if logits.shape[-1] != V:  # the target's vocabulary: ids the draft has not are never guessed
            pad = np.full((logits.shape[0], V), -np.inf, np.float32)
            pad[:, :min(V, logits.shape[-1])] = logits[:, :V]
            logits = pad
        scaled = self.sampler.scaled(logits)
        if self.sampler.config.greedy:
            return self.sampler.greedy_pick(scaled), None
        probs = self.sampler.probs(scaled)
        return self.sampler.draw(probs, self.sampler.rng.random(len(probs))), probs

    def propose(self, texts, ks):
        rt, s = self.runtime, self.session
        lengths = [len(t) for t in texts]
        if max(lengths) + 1 >= rt.max_context:  # the draft's cache is full: the target goes on alone
            self.drafted = [0] * len(texts)
            return [Proposal([]) for _ in texts]
        behind = max(L - h for L, h in zip(lengths, self.held))  # >= 1: the target's last token at least
        # each row runs its last `behind` tokens (a row less behind runs a known one again: the same values)
        rt.rewind(s, [L - behind for L in lengths])
        logits = rt.verify(s, np.array([t[-behind:] for t in texts], dtype=np.int64))[:, -1]
        rt.rewind(s, lengths)
        k = min(max(ks), rt.max_context - max(lengths) - 1)
        guesses, dists, sure = [], [], np.zeros(len(texts), dtype=np.int64)  # sure: each row's guesses before an unsure one
        for i in range(max(k, 0)):
            token, probs = self._pick(logits)
            sure += (sure == i) & (confidence(logits) >= self.p_min)
            if not (sure > i).any():
                break
            token = np.where(token == NO_TOKEN, 0, token)  # a draft with no possible token guesses anything
            guesses.append(token)
            dists.append(probs)
            if i + 1 < k:
                logits = rt.step(s, token).logits[:, -1]
        self.held = lengths
        self.drafted = [min(kb, int(n)) for kb, n in zip(ks, sure)]
        out = []
        for b, n in enumerate(self.drafted):
            probs = None if not n or dists[0] is None else np.stack([d[b] for d in dists[:n]])
            out.append(Proposal([int(g[b]) for g in guesses[:n]], probs))
        return out

    def accepted(self, counts):
        # the cache ran every guess but the last: what the row kept of those is its text
        self.held = [h + min(c, max(d - 1, 0)) for h, c, d in zip(self.held, counts, self.drafted)]

    def keep(self, rows):
        self.session.keep(rows)
        self.held = [self.held[i] for i in rows]
        self.drafted = [self.drafted[i] for i in rows]

    def close(self):
        if self.session is not None:
            self.session.close()
            self.session = None


@dataclass
class Verdict:
    kept: list[int]  # the accepted guesses, then the target's own token (NO_TOKEN: none was possible)
    accepted: int  # how many guesses were kept


def judge(sampler: Sampler, logits: np.ndarray, guess: Proposal, seen: np.ndarray | None,
          rng: np.random.Generator) -> Verdict:
    """One row's verdict: `logits` (n, V) the target's at the row's last kept token and at each guess
    (n = len(guess.tokens) + 1), read through the row's `sampler` (its `seen` line (1, V) marked with
    each guess before the positions after it)."""
    tokens, greedy = guess.tokens, sampler.config.greedy
    seen = None if seen is None else seen.copy()
    for j in range(len(tokens) + 1):
        scaled = sampler.scaled(logits[j:j + 1], seen)
        if greedy:
            best = int(sampler.greedy_pick(scaled)[0])
            if j == len(tokens) or best != tokens[j]:
                return Verdict([*tokens[:j], best], j)
        else:
            p = sampler.probs(scaled)[0]
            if j == len(tokens):
                return Verdict([*tokens, int(sampler.draw(p[None], rng.random(1))[0])], j)
            x = tokens[j]
            q = None if guess.probs is None else guess.probs[j]
            qx = 1.0 if q is None else float(q[x])
            if qx > 0 and rng.random() * qx < p[x]:  # accepted with probability min(1, p(x) / q(x))
                if seen is not None:
                    seen[0, x] = True
                continue
            residual = p.copy()
            if q is None:
                residual[x] = 0
            else:
                residual = np.maximum(residual - q, 0)
            if residual.sum() <= 0:  # p <= q everywhere: p itself (it only happens where p == q)
                residual = p
            return Verdict([*tokens[:j], int(sampler.draw(residual[None], rng.random(1))[0])], j)
        if seen is not None:
            seen[0, tokens[j]] = True
    raise AssertionError("unreachable")


@dataclass
class Speculation:
    """What `Generation` speculates with: a proposer and at most k guesses a row a step."""

    proposer: Proposer
    k: int = 8
    max_rows: int | None = None  # serving: speculate while at most this many requests decode (vLLM's disable_by_batch_size)

    def room(self, target: Runtime, written: int, left: int) -> int:
        """The most guesses a row may take: k, its `left` token budget after the target's own token,
        the static cache's room past its `written` positions, and one verify run."""
        return min(self.k, left - 1, target.max_context - written - 1, target.max_verify - 1)

    def check(self, target: Runtime) -> None:
        """Refuse a target that cannot verify, and a k beyond what its decode graph takes in one run."""
        problem = target.verify_problem
        if problem:
            raise InputError(problem)
        if not 1 <= self.k < target.max_verify:
            raise UsageProblem(f"--speculate {self.k}: the target's decode graph verifies at most "
                             f"{target.max_verify - 1} guesses a run (and at least 1)")


@dataclass
class SpeculationStats:
    """What a speculative generation counted: target runs, guesses proposed and accepted."""

    steps: int = 0  # decode runs of the target (plain steps and verify runs)
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens the decode runs produced (accepted guesses and the target's own)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else float("nan")

    def to_dict(self) -> dict:
        return {"target_steps": self.steps, "proposed": self.proposed, "accepted": self.accepted,  # (JSON: no NaN)
                "acceptance": self.acceptance if self.proposed else None, "tokens_per_step": self.tokens_per_step}

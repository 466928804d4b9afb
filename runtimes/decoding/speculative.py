"""Speculative decoding: a proposer guesses up to k tokens per row, the target checks them all in one
decode run (`Runtime.verify`), and each row keeps its longest accepted prefix plus one token of the
target's own, so one run of the target's weights yields 1 .. k + 1 tokens. The acceptance step is
the row's (`Row.take_verified`, runtimes/decoding/row.py), the same in `tk generate`, `tk bench` and
the batcher.

A `Proposer` is keyed by row, as llama.cpp's common_speculative is by sequence: `open(rows)` for a
loop's rows (a batch's, or a server's slots), `begin(row, prompt, sampling)` when a prompt takes a
row, `propose(rows, texts, ks)` for the rows that guess this step (their whole text so far),
`accept(row, kept)` with how many of its guesses the target kept, `close()`. Two are here:
`PromptLookup` (n-gram match over the row's own text, vLLM's `prompt_lookup_min/max`) and
`DraftModel` (another runtime of the same vocabulary over `Slots` of its own: each row's cache
catches up on what it has not run, then every guessing row drafts in one batched decode step per
guess; greedy where the row is greedy, else sampled with the row's temperature, top-k and top-p,
its guesses carrying the distributions they were drawn from). A proposer of heads on the target
(EAGLE, MTP) fits the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tk.models.spec.errors import UsageProblem
from tk.runtimes.base import InputError, Runtime
from tk.runtimes.decoding.sampling import NO_TOKEN, Sampler, SamplingConfig
from tk.runtimes.slots import Slots


@dataclass
class Proposal:
    tokens: list[int]  # the guesses, in order
    probs: np.ndarray | None = None  # (len(tokens), V): the distribution each was drawn from; None: deterministic

    def first(self, k: int) -> "Proposal":
        """The first k guesses (all where there are no more)."""
        if k >= len(self.tokens):
            return self
        return Proposal(self.tokens[:k], None if self.probs is None else self.probs[:k])


class Proposer(ABC):
    """Guesses the next tokens of the rows a target runs, each row by its index."""

    name = "proposer"

    def open(self, rows: int) -> None:
        """Rows 0 .. rows - 1 will guess (load what the proposer needs)."""

    def begin(self, row: int, prompt: Sequence[int], sampling: SamplingConfig) -> None:
        """A prompt takes `row`, sampled with `sampling` (the row's own stream)."""

    @abstractmethod
    def propose(self, rows: list[int], texts: list[list[int]], ks: list[int]) -> list[Proposal]:
        """For each of `rows`, at most ks[i] guesses following texts[i] (its prompt and every token kept so far)."""

    def accept(self, row: int, kept: int) -> None:
        """How many of the row's last guesses the target kept."""

    def close(self) -> None:
        """Release what `open` took (a draft's runtime stays loaded: its owner deactivates it)."""


# a row's first lookup guesses at most this many; the row's span then follows what the target keeps
SPAN_START = 8


class PromptLookup(Proposer):
    """The tokens that followed the latest earlier occurrence of the row's last n tokens (n from
    `max_n` down to `min_n`) in the row's own text: what a code edit, a summary or a RAG answer
    copies from its prompt (vLLM's ngram method; llama.cpp's lookup). How many a row guesses follows
    its copying (transformers' "heuristic" schedule of assistant tokens): it starts at `start`, takes
    two more after the target kept all its guesses and one fewer after it did not (at least one), and
    never more than the loop's k. A copying row's runs grow long (the real 0.5B copying code alone:
    12.7 tokens a run up to k = 16 against 8.5 at a fixed 8); a row whose guesses miss keeps its runs short."""

    name = "lookup"

    def __init__(self, min_n: int = 2, max_n: int = 4, start: int = SPAN_START):
        if not 1 <= min_n <= max_n:
            raise UsageProblem(f"prompt lookup needs 1 <= min n-gram <= max n-gram, got {min_n} and {max_n}")
        self.min_n, self.max_n, self.start = min_n, max_n, start
        self.span: dict[int, int] = {}  # per row: the most it guesses next
        self.guessed: dict[int, int] = {}  # per row: how many its last proposal guessed

    def begin(self, row, prompt, sampling):
        self.span[row], self.guessed[row] = self.start, 0

    def propose(self, rows, texts, ks):
        out = []
        for row, text, k in zip(rows, texts, ks):
            self.span[row] = min(self.span.get(row, self.start), k)
            out.append(Proposal(self.lookup(np.asarray(text, dtype=np.int64), self.span[row])))
            self.guessed[row] = len(out[-1].tokens)
        return out

    def accept(self, row, kept):
        if self.guessed.get(row):
            self.span[row] = self.span[row] + 2 if kept >= self.guessed[row] else max(1, self.span[row] - 1)

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
# there: tk's default spends no draft step or verified position on a guess its draft is unsure of). The one
# default: the CLI's --draft-p-min and SpeculationOptions read it.
P_MIN = 0.75


def confidence(logits: np.ndarray) -> np.ndarray:
    """(B, V) logits -> (B,) the top token's probability."""
    peak = logits.max(-1, keepdims=True)
    return 1.0 / np.exp(logits - peak).sum(-1)


class DraftModel(Proposer):
    """A smaller model of the same vocabulary (a tk artifact whose decode graph verifies runs) that
    drafts up to k tokens a row from `Slots` of its own (row i in slot i). Before drafting, a row's
    cache catches up on the tokens it has not run (the target's token, and a guess it drafted without
    running), in one run; then every guessing row drafts together, one batched decode step per guess.
    A row stops guessing at the first token the draft gives less than `p_min` of its probability
    (llama.cpp's --spec-draft-p-min): an unsure draft's guesses cost a draft step and a verified
    position each. The cache ran every guess but the last: what the row kept of those is its text."""

    name = "draft"

    def __init__(self, runtime: Runtime, vocab_size: int, p_min: float = P_MIN):
        if problem := runtime.verify_problem:
            raise InputError(f"the draft: {problem}")
        self.runtime, self.vocab_size, self.p_min = runtime, vocab_size, p_min
        self.slots: Slots | None = None
        self.held: list[int] = []  # per row, the positions of its cache that are its true text
        self.drafted: list[int] = []  # per row, the guesses of its last proposal
        self.samplers: list[Sampler | None] = []  # per row, how it drafts (None: greedy)

    def open(self, rows):
        self.close()
        self.runtime.activate()
        self.slots = Slots(self.runtime, rows)
        self.held, self.drafted, self.samplers = [0] * rows, [0] * rows, [None] * rows

    def begin(self, row, prompt, sampling):
        self.held[row] = self.drafted[row] = 0
        self.samplers[row] = None if sampling.greedy else Sampler(SamplingConfig(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed + 1))

    def close(self):
        if self.slots is not None:
            self.slots.close()
            self.slots = None

    def _pick(self, row: int, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
        """The draft's logits (V_draft,) -> its guess among the target's vocabulary (ids the draft has
        not are never guessed), and the distribution it was drawn from (None: greedy)."""
        V = self.vocab_size
        if logits.shape[-1] != V:
            pad = np.full(V, -np.inf, np.float32)
            pad[:min(V, logits.shape[-1])] = logits[:V]
            logits = pad
        sampler = self.samplers[row]
        if sampler is None:
            return int(np.argmax(logits)), None
        probs = sampler.probs(sampler.scaled(logits[None]))
        token = int(sampler.draw(probs, sampler.rng.random(1))[0])
        return (0 if token == NO_TOKEN else token), probs[0]  # a draft with no possible token guesses anything

    def propose(self, rows, texts, ks):
        slots, capacity = self.slots, self.runtime.layout.capacity
        out, logits = [Proposal([]) for _ in rows], {}
        for i, (b, text, k) in enumerate(zip(rows, texts, ks)):
            self.drafted[b] = 0
            if k > 0 and len(text) + k < capacity:  # (else the target goes on alone: the draft's cache is full)
                at = min(self.held[b], len(text) - 1)  # the text's last token runs at least: its logits guess
                logits[i] = slots.extend(b, text[at:], at).logits[0, -1]
                self.held[b] = len(text)
        guessing, dists = sorted(logits), {i: [] for i in logits}
        tokens = np.zeros(max(rows, default=0) + 1, np.int64)
        while guessing:
            sure = [i for i in guessing if confidence(logits[i][None])[0] >= self.p_min]
            for i in sure:
                token, q = self._pick(rows[i], logits[i])
                out[i].tokens.append(token)
                dists[i].append(q)
                tokens[rows[i]] = token
            guessing = [i for i in sure if len(out[i].tokens) < ks[i]]
            if guessing:  # one batched step of every row still guessing
                active = [rows[i] for i in guessing]
                step = slots.step(tokens[:max(active) + 1], active).logits
                logits.update({i: step[rows[i], -1] for i in guessing})
        for i, (b, proposal) in enumerate(zip(rows, out)):
            self.drafted[b] = len(proposal.tokens)
            if proposal.tokens and dists[i][0] is not None:
                proposal.probs = np.stack(dists[i])
        return out

    def accept(self, row, kept):
        self.held[row] += min(kept, max(self.drafted[row] - 1, 0))


@dataclass
class Speculation:
    """What a loop (`Generation`, the batcher) speculates with: a proposer and at most k guesses a row a
    step; serving guesses while at most `max_rows` requests decode (vLLM's disable_by_batch_size; None:
    wherever its scheduler's cost rule says a step gains by it)."""

    proposer: Proposer
    k: int = 8
    max_rows: int | None = None

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

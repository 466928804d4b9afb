"""One row of generation, written once for `tk generate`, `tk bench` and the batcher: a prompt's
sampler (its own seed stream, temperature, top-k/p, repetition penalty, so its tokens do not depend
on what else shares its steps), its logits processors in order (logit bias, penalties, a grammar's
mask), its `RowPolicy` (what ends it) and the raw logits' log-probabilities where they were asked
for, of each new token and of its prompt.

A row hears logits and gives events: `take(logits)` samples one token; `take_verified(logits,
guesses)` takes the tokens of a verify run (the target's logits at the row's last token and at each
guess), one position at a time through the same sampler, processors and policy, while each equals the
guess there. For a deterministic guess (prompt lookup, a greedy draft) that is speculative sampling's
rule itself, and the row's tokens are what they would be without the guesses, sampled ones too; for a
sampled draft's guess x (drawn from q) it keeps x with probability min(1, p(x) / q(x)) and on a
rejection draws from norm(max(0, p - q)) (Leviathan et al. 2023; Chen et al. 2023), so the tokens keep
the target's distribution. Both are generators of `TokenEvent`s: the consumer hears each token before
the row asks its stop hook (a stop string ends the row right after the token that completes it), and
stops iterating when the row has ended. What to do with an event (yield it, tell a front end, free a
slot) is the caller's.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from tk.runtimes.decoding.logits import Processor, TokenLogprob, token_logprobs
from tk.runtimes.decoding.rows import RowPolicy, TokenEvent, seen_matrix
from tk.runtimes.decoding.sampling import NO_TOKEN, Sampler, SamplingConfig


class Row:
    """One prompt's generation state: `policy.tokens` are its kept tokens; `index` names it in its
    events (a batch's row; the batcher's requests are rows 0 alone)."""

    __slots__ = ("index", "prompt", "sampler", "processors", "policy", "logprobs", "prompt_logprobs", "prompt_logits")

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), *,
                 vocab_size: int, eos_ids: Sequence[int] = (), ignore_eos: bool = False,
                 processors: Sequence[Processor] = (), logprobs: int | None = None,
                 prompt_logprobs: int | None = None, stop=None, index: int = 0):
        self.index, self.prompt, self.sampler, self.processors = index, prompt, Sampler(sampling), list(processors)
        self.policy = RowPolicy(prompt, max_new_tokens, eos_ids, ignore_eos, seen_matrix(sampling, vocab_size, 1), stop)
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs
        self.prompt_logits: list[np.ndarray] = []

    @property
    def tokens(self) -> list[int]:
        return self.policy.tokens

    def _processed(self, logits: np.ndarray) -> np.ndarray:
        for process in self.processors:
            logits = process(logits, self.policy.tokens)
        return logits

    def _scored(self, raw: np.ndarray, token: int) -> TokenLogprob | None:
        """The raw logits' log-probability of the token (None where not asked for, or for NO_TOKEN)."""
        if self.logprobs is None or token == NO_TOKEN:
            return None
        return token_logprobs(raw, [token], self.logprobs)[0]

    def sample(self, logits: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next token from its logits (1, V), after the processors, and the raw logits'
        log-probability of it (None where not asked for, or the sampler's NO_TOKEN: the processors
        left no token possible, and the row ends)."""
        token = int(self.sampler(self._processed(logits), self.policy.seen, [0], 1)[0])
        return token, self._scored(logits, token)

    def judge(self, logits: np.ndarray, guess: int, q: np.ndarray) -> int:
        """Speculative sampling at one position for a guess drawn from `q` (V,): the guess, kept with
        probability min(1, p(x) / q(x)), else a draw from norm(max(0, p - q)); p is what the row's
        processors and sampler make of `logits` (1, V), drawn with the row's own generator."""
        sampler = self.sampler
        p = sampler.probs(sampler.scaled(self._processed(logits), self.policy.seen))[0]
        qx = float(q[guess])
        if qx > 0 and sampler.rng.random() * qx < p[guess]:
            return guess
        residual = np.maximum(p - q, 0)
        if residual.sum() <= 0:  # p <= q everywhere: p itself (it only happens where p == q)
            residual = p
        return int(sampler.draw(residual[None], sampler.rng.random(1))[0])

    def take(self, logits: np.ndarray) -> Iterator[TokenEvent]:
        """Sample the next token from `logits` (1, V): its event, then the finish's where the row
        ends (EOS, which is not kept but scored; a stop; its budget). Returns whether it goes on."""
        token, scored = self.sample(logits)
        return (yield from self._keep(token, scored))

    def take_verified(self, logits: np.ndarray, guesses: Sequence[int],
                      probs: np.ndarray | None = None) -> Iterator[TokenEvent]:
        """The tokens of a verify run: `logits` (n, V) at the row's last token and at each of the n - 1
        `guesses` (`probs` (n - 1, V): the distributions a sampled draft drew them from; None: they are
        deterministic). Takes a token at each position while the last one equals the guess there and
        the row goes on -> returns how many guesses were accepted."""
        judged = probs is not None and not self.sampler.config.greedy
        for j in range(len(guesses) + 1):
            if judged and j < len(guesses):
                token = self.judge(logits[j:j + 1], int(guesses[j]), probs[j])
                scored = self._scored(logits[j:j + 1], token)
            else:
                token, scored = self.sample(logits[j:j + 1])
            alive = yield from self._keep(token, scored)
            hit = j < len(guesses) and token == guesses[j]
            if not (alive and hit):
                return j + hit
        return len(guesses)

    def _keep(self, token: int, scored: TokenLogprob | None) -> Iterator[TokenEvent]:
        policy = self.policy
        if not policy.add(token):  # EOS or NO_TOKEN: not kept, the EOS's log-probability told with the finish
            yield TokenEvent(self.index, None, policy.finish_reason, scored)
            return False
        yield TokenEvent(self.index, token, None, scored)  # its consumer may stop the row here
        if policy.finished():
            yield TokenEvent(self.index, None, policy.finish_reason)
            return False
        return True

    def score_prompt(self, logits: np.ndarray, last: bool) -> list[TokenLogprob | None] | None:
        """A prefilled chunk's every position's logits (T, V); after the prompt's last chunk, the
        prompt's scores (position i's logits score prompt token i + 1; the first has none)."""
        self.prompt_logits.append(logits)
        if not last:
            return None
        every, self.prompt_logits = np.concatenate(self.prompt_logits), []
        return [None, *token_logprobs(every[:-1], self.prompt[1:], self.prompt_logprobs)]


def drain(events: Iterator[TokenEvent], tell) -> object:
    """Hand each event of a row's `take` or `take_verified` to `tell(event)` -> what it returned."""
    while True:
        try:
            tell(next(events))
        except StopIteration as done:
            return done.value

"""A request in its slot, and its sampling step: the logits processors in order, its own `Sampler`
(its seed, temperature, top-k/p, repetition penalty, so its tokens do not depend on what else
shares its steps), and the raw logits' log-probabilities where it asked for them, of each new token
and of its prompt. Its tokens end by the same `RowPolicy` as its solo run (runtimes/decoding/rows.py).
What to do with a token (tell the front end, leave the slot) is the batcher's.
"""

from __future__ import annotations

import numpy as np

from tk.runtimes.decoding.logits import TokenLogprob, token_logprobs
from tk.runtimes.decoding.rows import RowPolicy, seen_matrix
from tk.runtimes.decoding.sampling import NO_TOKEN, Sampler
from tk.runtimes.serving.scheduler import Seq


class Running:
    """A request in its slot: its sampler and its row's policy (whose tokens are the request's), its
    prompt's ids, its prompt positions' logits so far (where it asked for their log-probabilities)
    and how many of its blocks the prefix cache holds."""

    __slots__ = ("request", "seq", "sampler", "policy", "ids", "prompt_logits", "stored")

    def __init__(self, seq: Seq, eos_ids: frozenset, vocab_size: int):
        request = seq.request
        self.request, self.seq, self.sampler = request, seq, Sampler(request.sampling)
        self.policy = RowPolicy(request.prompt, request.max_new_tokens, eos_ids, request.ignore_eos,
                                seen_matrix(request.sampling, vocab_size, 1), request.stop)
        request.tokens = self.policy.tokens
        self.ids: np.ndarray | None = None
        self.prompt_logits: list[np.ndarray] = []
        self.stored = 0

    def sample(self, logits: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next token from its logits (1, V), after the request's processors, and the raw
        logits' log-probability of it (None where the request did not ask, or the sampler's NO_TOKEN:
        the processors left no token possible, and the row ends)."""
        request, raw = self.request, logits
        for process in request.processors:
            logits = process(logits, self.policy.tokens)
        token = int(self.sampler(logits, self.policy.seen, [0], 1)[0])
        if request.logprobs is None or token == NO_TOKEN:
            return token, None
        return token, token_logprobs(raw, [token], request.logprobs)[0]

    def score_prompt(self, logits: np.ndarray, last: bool) -> None:
        """A prefilled chunk's every position's logits (T, V); after the prompt's last chunk, the
        request's `prompt_scores` (position i's logits score prompt token i + 1; the first has none)."""
        self.prompt_logits.append(logits)
        if last:
            request = self.request
            every = np.concatenate(self.prompt_logits)
            request.prompt_scores = [None, *token_logprobs(every[:-1], request.prompt[1:], request.prompt_logprobs)]

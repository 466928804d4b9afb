"""What a run of the serving loop costs here, measured: every run it makes is a point (tokens,
seconds), and `CostFit` fits seconds = fixed + per_token * tokens over the recent ones (least
squares, older runs decaying). On a CPU `fixed` is reading the weights once and `per_token` the
compute each token adds. `Costs` keeps two fits: the steps' runs (decode steps of R rows, verify
runs), which the speculation rule weighs guesses by (runtimes/serving/spec_rule.py), and the prompt
chunks' runs, which cost more a token (a chunk deep in a long prompt attends over every position
before it) and by which the scheduler sizes a step's chunks (runtimes/serving/scheduler.py). Pure.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 64  # a fit knows how wide a run it measured over its last this many runs (RunCost.widest)


@dataclass(frozen=True)
class RunCost:
    """A run's seconds: fixed + per_token * tokens; `draft` a draft model's batched step (0: none);
    `widest` the most tokens of a run among the fit's last WINDOW (None: measured at every size). Past
    it the line is a guess: a decode step's rows and a verify run's tokens cost differently (a row
    reads a cache of its own), so a fit of decode steps alone overprices a wide verify run (the real
    0.5B on `--for serve`: 75 ms + 9.5 ms a token from steps of 1 and 8 rows, 98 + 4.7 once runs of 72
    tokens were measured)."""

    fixed: float
    per_token: float
    draft: float = 0.0
    widest: int | None = None

    def run(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens if tokens > 0 else 0.0


class CostFit:
    """Least squares of seconds on tokens over the loop's runs, each older one weighing `decay` less;
    until runs of two sizes were seen, `prior`'s shape scaled to what the runs of one size cost (none:
    the prior). Its first run is not counted: it also pays what a process pays once (the weights' pages
    read in from disk, the thread pool started, the first memory plans), several times a later run's
    cost on a small model, which would tilt the fit for its first hundred runs. A draft's steps are
    averaged apart."""

    def __init__(self, prior: RunCost, decay: float = 0.99):
        self.prior, self.decay = prior, decay
        self.n = self.t = self.s = self.tt = self.ts = 0.0  # decayed sums: weight, tokens, seconds, t^2, t*s
        self.draft, self.first = prior.draft, True
        self.recent: deque[int] = deque(maxlen=WINDOW)  # the tokens of the last runs counted

    def add(self, tokens: int, seconds: float) -> None:
        if self.first:
            self.first = False
            return
        d = self.decay
        self.recent.append(tokens)
        self.n, self.t, self.s = d * self.n + 1, d * self.t + tokens, d * self.s + seconds
        self.tt, self.ts = d * self.tt + tokens * tokens, d * self.ts + tokens * seconds

    def add_draft(self, steps: int, seconds: float) -> None:
        if steps > 0:
            self.draft = 0.8 * self.draft + 0.2 * seconds / steps

    @property
    def cost(self) -> RunCost:
        var, widest = self.n * self.tt - self.t * self.t, max(self.recent, default=0)
        if var <= 1e-9 * max(self.n * self.tt, 1.0):  # (two runs weigh 1.99: the decay)
            k = self.s / self.n / self.prior.run(self.t / self.n) if self.n and self.t else 1.0
            return RunCost(k * self.prior.fixed, k * self.prior.per_token, self.draft, widest)
        per_token = max((self.n * self.ts - self.t * self.s) / var, 0.0)
        fixed = max((self.s - per_token * self.t) / self.n, 0.0)
        return RunCost(fixed, per_token, self.draft, widest)


# before the loop has timed runs of two sizes: a run's fixed cost as 8 tokens' compute (a 135M model's
# decode step on 2 cores reads its weights in about what 8 tokens compute; the fit replaces it within steps)
PRIOR = RunCost(fixed=8e-3, per_token=1e-3)


class Costs:
    """The loop's two fits: `steps` (decode and verify runs, and a draft's steps) and `prompts` (prompt
    chunks' runs: a prompt's first run with others, or a chunk alone); and `decode`, the seconds of
    its last plain decode run as measured (0: none yet). A fit of rows alone misses what a decode step
    also costs by its rows' width (a narrow mask's step attends over the longest row's positions: 8
    streams and one row of 1,500 positions cost 200 ms a step on the 0.5B against 127 without it), so
    what the next step's decode costs is read from the last one."""

    def __init__(self, prior: RunCost = PRIOR):
        self.steps, self.prompts = CostFit(prior), CostFit(prior)
        self.decode = 0.0

    def add(self, tokens: int, seconds: float, prompt: bool = False, decode: bool = False) -> None:
        """A run: a prompt chunk's, or a step's (`decode`: a plain decode run, which is also the last one)."""
        (self.prompts if prompt else self.steps).add(tokens, seconds)
        if decode:
            self.decode = seconds

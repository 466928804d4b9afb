"""What `tk generate`, `tk bench` and `tk serve` speculate with: the options (a proposer and how many
guesses a step) and the `Speculation` they open over a target runtime, with a draft artifact's
checks (its tokenizer is the target's; its decode graph verifies runs). The loop and the
acceptance rule are runtimes/decoding/speculative.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tk.models.spec.errors import UsageProblem
from tk.models.spec.manifest import ArtifactError
from tk.runtimes.decoding.speculative import P_MIN

WORKLOADS = ("code-edit", "summary", "free")  # tk bench --workloads (toolkit/tools/bench_speculative.py)
# the most guesses a step: a row's lookup starts at 8 and grows to 16 while the target keeps them (PromptLookup;
# llama.cpp's --spec-draft-n-max is 16 too); a draft model pays for few
DEFAULT_K = {"lookup": 16, "draft": 4}


@dataclass(frozen=True)
class SpeculationOptions:
    lookup: bool = False  # prompt lookup (n-gram match over the row's own text)
    draft: Path | None = None  # a draft artifact
    k: int | None = None  # guesses a step (None: DEFAULT_K of the proposer)
    lookup_min: int = 2  # the shortest n-gram prompt lookup matches (vLLM's prompt_lookup_min)
    lookup_max: int = 4  # the longest (prompt_lookup_max)
    draft_p_min: float = P_MIN  # a draft's guess needs this much of its probability
    max_rows: int | None = None  # serving: guess while at most this many requests decode (None: the cost rule alone)

    def __post_init__(self):
        if self.lookup and self.draft is not None:
            raise UsageProblem("--lookup and --draft are two proposers; choose one")
        if not 0 <= self.draft_p_min <= 1:
            raise UsageProblem(f"--draft-p-min must be in [0, 1], got {self.draft_p_min}")
        if self.k is not None and not self.proposer:
            raise UsageProblem("--speculate K needs a proposer: add --lookup or --draft ARTIFACT")
        if self.max_rows is not None and self.max_rows < 1:
            raise UsageProblem(f"--speculate-max-rows must be at least 1, got {self.max_rows}")

    @property
    def proposer(self) -> str | None:
        return "lookup" if self.lookup else "draft" if self.draft is not None else None

    @property
    def guesses(self) -> int:
        return self.k if self.k is not None else DEFAULT_K.get(self.proposer, 0)

    def describe(self) -> str:
        if self.proposer == "lookup":
            return f"prompt lookup (n-grams {self.lookup_min}..{self.lookup_max}), up to {self.guesses} guesses a step"
        return f"draft {self.draft}, {self.guesses} guesses a step" if self.draft else "off"


def check_draft(target: Path, draft: Path) -> None:
    """Refuse a draft artifact whose tokenizer is not the target's (one line: what differs)."""
    from tk.models.spec.manifest import Manifest
    from tk.toolkit.textgen import Tokenizer

    drafted = Manifest.read(draft)  # (a folder that is no artifact: its one line)
    mine, theirs = Tokenizer.find(target), Tokenizer.find(draft)
    if mine is None and theirs is None:  # token ids alone (no tokenizer files): the vocabularies' sizes must agree
        sizes = Manifest.read(target).config.vocab_size, drafted.config.vocab_size
        if sizes[0] != sizes[1]:
            raise ArtifactError(f"the draft {draft} has a vocabulary of {sizes[1]} tokens and the target {sizes[0]}; "
                                "a draft must share the target's tokenizer")
        return
    if mine is None or theirs is None:
        raise ArtifactError(f"a draft must share the target's tokenizer, and {target if mine is None else draft} "
                            "has no tokenizer files to compare")
    a, b = mine.vocab(), theirs.vocab()
    if a != b:
        differ = len(set(a.items()) ^ set(b.items()))
        raise ArtifactError(f"the draft {draft} has another tokenizer than the target ({len(b)} tokens against "
                            f"{len(a)}, {differ} token/id pairs differ); a draft must share the target's tokenizer")


def open_speculation(target: Path, runtime, so: SpeculationOptions, backend: str = "ort", options=None):
    """The one opener: the `Speculation` of these options over the target `runtime` (None where they
    ask for none), for `tk generate`, `tk bench` and `tk serve` alike; a draft artifact opens on the
    target's backend with the options of runs (`BackendOptions.for_runs`: its catch-up runs take
    several tokens), activated when a loop opens it."""
    from tk.runtimes.decoding.speculative import DraftModel, PromptLookup, Speculation

    if so.proposer is None:
        return None
    if so.proposer == "lookup":
        proposer = PromptLookup(so.lookup_min, so.lookup_max)
    else:
        from tk.toolkit.backends import BackendOptions, open_runtime

        check_draft(Path(target), so.draft)
        draft = open_runtime(so.draft, backend, (options or BackendOptions()).for_runs(backend))
        proposer = DraftModel(draft, runtime.dims.vocab_size, so.draft_p_min)
    speculation = Speculation(proposer, so.guesses, so.max_rows)
    speculation.check(runtime)
    return speculation

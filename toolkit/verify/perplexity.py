"""`tk eval`: perplexity of a text, per backend, and how far each backend's next-token distribution
is from the full-precision model's (KL divergence, top-1 agreement: llama.cpp's `perplexity
--kl-divergence`), so a user sees what quantization costs on their own data.

The text is tokenized with the artifact's tokenizer and cut into windows of `window` tokens (no
overlap); each window is one prefill, teacher-forced: every position's logits predict the next
token, and the negative log-likelihood of those tokens is averaged over the whole text.
Perplexity = exp(mean NLL). A quantized artifact also gets the full-precision reference as a
baseline row (the quantized reference is what the graphs compute, so it is the "torch" row).

Which predictions are scored (`score`, SCORES): "all" scores every position of every window (the
last, shorter window too), so early positions with little context count; "second-half" scores what
llama.cpp's `llama-perplexity` (its --ppl-stride 0 default, tools/perplexity/perplexity.cpp: `first
= n_ctx/2`) scores, so the numbers compare with its: full windows only (n_ctx = `window`; a shorter
tail is dropped), in each the predictions of positions n_ctx/2 .. n_ctx-2, i.e. of tokens n_ctx/2+1
.. n_ctx-1 (n_ctx - 1 - n_ctx/2 a window), the first half being context only; and, as llama.cpp does
when its vocabulary adds a BOS, each window's first token is replaced by that BOS in the input (a
tokenizer that puts no token first, Qwen's say, leaves the windows as they are). KL divergence and
top-1 agreement are measured over the same positions.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np

from tk.models.spec.manifest import Manifest
from tk.models.spec.errors import UsageProblem
from tk.runtimes.base import BackendUnavailable, InputError
from tk.runtimes.slots import Slots
from tk.toolkit.backends import BackendOptions, open_runtime, reference_runtime
from tk.toolkit.progress import Progress

DEFAULT_WINDOW = 1024  # tokens per window (at most the context): logits of a window are window x vocab floats
SCORES = {"all": "every position of each window (the last, shorter window too)",
          "second-half": "llama-perplexity's: in full windows only, positions window/2 .. window-2 (the "
                         "predictions of tokens window/2+1 .. window-1), each window's first token a BOS where "
                         "the tokenizer adds one"}


def windows(ids: list[int], window: int, full: bool = False) -> list[list[int]]:
    """Consecutive windows of at most `window` tokens (`full`: of exactly `window`, llama.cpp's chunks);
    a last window of one token predicts nothing."""
    chunks = [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]
    return [c for c in chunks if len(c) == window] if full else chunks


def first_scored(window: int, score: str) -> int:
    """The first position of a window whose prediction (of the next token) is scored."""
    return window // 2 if score == "second-half" else 0


def added_bos(tokenizer) -> int | None:
    """The token the tokenizer puts before the text when it adds special tokens (llama.cpp's
    `add_bos`), or None."""
    plain, special = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a")
    return special[0] if len(special) == len(plain) + 1 and special[1:] == plain else None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - (np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)) + top)


def window_logits(runtime, chunk: list[int]) -> np.ndarray:
    """(S, V) logits of one window: one prefill, or where the prefill returns the last position's only,
    the window through a decode graph that takes runs and keeps their logits (a hybrid's one graph)."""
    ids = np.array([chunk], dtype=np.int64)
    if not runtime.all_prefill_logits:
        with Slots(runtime, 1) as slot:
            return slot.admit(0, chunk, every=True).logits[0]
    out, session = runtime.start(ids, np.ones_like(ids), room=1)
    session.close()
    return out.logits[0]


def divergence(reference: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position of (S, V) logits: KL(reference || logits) in nats, and whether the top-1 agrees
    (what llama.cpp's `perplexity --kl-divergence` reports)."""
    ref, lp = log_softmax(reference), log_softmax(logits)
    kl = (np.exp(ref) * (ref - lp)).sum(axis=-1)
    return np.maximum(kl, 0.0), ref.argmax(axis=-1) == lp.argmax(axis=-1)


class Scores:
    """One model's running score over windows: summed NLL of each window's scored next tokens and,
    given a reference's logits of the same positions, each one's KL divergence and top-1 agreement."""

    def __init__(self):
        self.nll, self.count, self.kls, self.agree = 0.0, 0, [], []

    def add(self, logits: np.ndarray, chunk: list[int], reference: np.ndarray | None = None, first: int = 0) -> None:
        """logits (S - 1 - first, V): positions first..S-2 of window `chunk` (S tokens), each predicting
        the next (`first_scored`)."""
        targets = chunk[first + 1:]
        self.nll -= float(log_softmax(logits)[np.arange(len(targets)), targets].sum())
        self.count += len(targets)
        if reference is not None:
            kl, top1 = divergence(reference, logits)
            self.kls.append(kl)
            self.agree.append(top1)

    def row(self, reference: "Scores | None" = None) -> dict:
        """tokens, nll, perplexity; with the reference's scores, also perplexity_ratio, kl_mean,
        kl_p99 and top1_agreement."""
        out = {"tokens": self.count, "nll": self.nll / self.count, "perplexity": math.exp(self.nll / self.count)}
        if reference is not None and self.kls:
            kl = np.concatenate(self.kls)
            out.update({"perplexity_ratio": math.exp((self.nll - reference.nll) / self.count),
                        "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
                        "top1_agreement": float(np.concatenate(self.agree).mean())})
        return out


def evaluate(artifact: Path, text: str, backends: list[str], window: int | None = None,
             options: BackendOptions = BackendOptions(), baseline: bool = True, score: str = "all",
             progress: Progress | None = None) -> dict:
    """Perplexity of `text` on each backend (a skipped backend says why) and, against the
    full-precision reference (the baseline row; for a float32 artifact, the torch row), each
    position's KL divergence (mean and 99th percentile) and top-1 agreement, window by window, over
    the positions `score` says (SCORES). `progress`: the steps load and score, scoring counted in
    tokens of windows run."""
    from tk.toolkit.textgen import Tokenizer

    if score not in SCORES:
        raise UsageProblem(f"--score must be one of {', '.join(SCORES)}, got {score!r}")
    progress = Progress.of(progress)
    progress.step("load")
    manifest = Manifest.read(artifact)
    if manifest.variant.prefill_logits.value != "all" and not manifest.dims.keeps_logits:
        raise UsageProblem("tk eval needs every position's logits; this artifact's prefill returns the last "
                           "position only: re-export with --prefill-logits all")
    context = manifest.variant.capacity or manifest.max_context
    window = window or min(DEFAULT_WINDOW, context)
    if not 2 <= window <= context:
        raise UsageProblem(f"--window must be 2..{context} (the artifact's context), got {window}")
    tokenizer = Tokenizer(artifact)
    ids = tokenizer.encode(text)
    chunks = windows(ids, window, full=score == "second-half")
    if not chunks:
        raise InputError(f"the text is {len(ids)} token(s): tk eval needs at least 2" if score == "all" else
                         f"the text is {len(ids)} token(s): --score second-half needs a full window of {window}")
    bos = added_bos(tokenizer) if score == "second-half" else None
    named = {name: (lambda name=name: open_runtime(artifact, name, options)) for name in backends}
    reference = "torch" if "torch" in backends and manifest.dtype == "float32" and not manifest.precision.quantized \
        else None
    if baseline and reference is None:
        reference = "torch (full-precision weights)" if manifest.precision.quantized else "torch (float32)"
        named[reference] = lambda: reference_runtime(artifact, manifest, quantized=False)
    rows, runtimes = {}, {}
    with contextlib.ExitStack() as stack:
        for name, opener in named.items():
            try:
                runtimes[name] = stack.enter_context(opener())
            except BackendUnavailable as e:
                rows[name] = {"status": "skipped", "reason": str(e)}
        scores = {name: Scores() for name in runtimes}
        progress.step("score")
        with progress.task("score", len(runtimes) * sum(map(len, chunks)), "tokens", len(chunks), "windows") as task:
            for chunk in chunks:
                first = first_scored(len(chunk), score)
                run = chunk if bos is None else [bos, *chunk[1:]]  # llama.cpp's BOS in place of the first token
                logits = {name: window_logits(rt, run)[first:-1] for name, rt in runtimes.items()}
                task.advance(len(runtimes) * len(chunk), 1)
                for name, lg in logits.items():
                    scores[name].add(lg, chunk, logits.get(reference) if name != reference else None, first)
    for name in runtimes:
        rows[name] = {"status": "ok", **scores[name].row(scores.get(reference))}
    return {"artifact": str(artifact), "precision": manifest.precision.describe(), "window": window, "score": score,
            "bos_first": bos is not None, "text_tokens": len(ids), "reference": reference,
            "backends": {n: rows[n] for n in named}}


def format_eval(result: dict) -> str:
    scored = "" if result["score"] == "all" else "; scored: the second half of each full window (llama-perplexity's)"
    lines = [f"{result['artifact']}: {result['precision']}; {result['text_tokens']} tokens in windows of "
             f"{result['window']}{scored}" + (f"; KL and top-1 against {result['reference']}" if result["reference"]
                                             else ""),
             f"{'backend':34} {'tokens':>7} {'nll':>8} {'perplexity':>11} {'ratio':>7} {'KL mean':>9} {'KL p99':>9} "
             f"{'top-1':>7}"]
    for name, row in result["backends"].items():
        if row["status"] == "skipped":
            lines.append(f"{name:34} skipped: {row['reason']}")
            continue
        line = f"{name:34} {row['tokens']:>7} {row['nll']:8.4f} {row['perplexity']:11.3f}"
        if "kl_mean" in row:
            line += (f" {row['perplexity_ratio']:7.4f} {row['kl_mean']:9.5f} {row['kl_p99']:9.5f} "
                     f"{row['top1_agreement']:7.2%}")
        lines.append(line)
    return "\n".join(lines)

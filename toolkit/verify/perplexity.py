"""`tk eval`: perplexity of a text, per backend, and how far each backend's next-token distribution
is from the full-precision model's (KL divergence, top-1 agreement: llama.cpp's `perplexity
--kl-divergence`), so a user sees what quantization costs on their own data.

The text is tokenized with the artifact's tokenizer and cut into windows of `window` tokens (no
overlap); each window is one prefill, teacher-forced: every position's logits predict the next
token, and the negative log-likelihood of those tokens is averaged over the whole text.
Perplexity = exp(mean NLL). A quantized artifact also gets the full-precision reference as a
baseline row (the quantized reference is what the graphs compute, so it is the "torch" row).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np

from tk.models.spec.manifest import Manifest
from tk.models.spec.errors import UsageProblem
from tk.runtimes.base import BackendUnavailable, InputError
from tk.toolkit.backends import BackendOptions, open_runtime, reference_runtime

DEFAULT_WINDOW = 1024  # tokens per window (at most the context): logits of a window are window x vocab floats


def windows(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of at most `window` tokens; a last window of one token predicts nothing."""
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - (np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)) + top)


def window_logits(runtime, chunk: list[int]) -> np.ndarray:
    """(S, V) logits of one window, one prefill."""
    ids = np.array([chunk], dtype=np.int64)
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
    """One model's running score over windows: summed NLL of each window's next tokens and, given a
    reference's logits of the same window, each position's KL divergence and top-1 agreement."""

    def __init__(self):
        self.nll, self.count, self.kls, self.agree = 0.0, 0, [], []

    def add(self, logits: np.ndarray, chunk: list[int], reference: np.ndarray | None = None) -> None:
        """logits (S - 1, V): positions 0..S-2 of window `chunk` (S tokens), each predicting the next."""
        self.nll -= float(log_softmax(logits)[np.arange(len(chunk) - 1), chunk[1:]].sum())
        self.count += len(chunk) - 1
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
             options: BackendOptions = BackendOptions(), baseline: bool = True) -> dict:
    """Perplexity of `text` on each backend (a skipped backend says why) and, against the
    full-precision reference (the baseline row; for a float32 artifact, the torch row), each
    position's KL divergence (mean and 99th percentile) and top-1 agreement, window by window."""
    from tk.toolkit.textgen import Tokenizer

    manifest = Manifest.read(artifact)
    if manifest.variant.prefill_logits.value != "all":
        raise UsageProblem("tk eval needs every position's logits; this artifact's prefill returns the last "
                           "position only: re-export with --prefill-logits all")
    context = manifest.variant.capacity or manifest.max_context
    window = window or min(DEFAULT_WINDOW, context)
    if not 2 <= window <= context:
        raise UsageProblem(f"--window must be 2..{context} (the artifact's context), got {window}")
    ids = Tokenizer(artifact).encode(text)
    chunks = windows(ids, window)
    if not chunks:
        raise InputError(f"the text is {len(ids)} token(s): tk eval needs at least 2")
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
        for chunk in chunks:
            logits = {name: window_logits(rt, chunk)[:-1] for name, rt in runtimes.items()}
            for name, lg in logits.items():
                scores[name].add(lg, chunk, logits.get(reference) if name != reference else None)
    for name in runtimes:
        rows[name] = {"status": "ok", **scores[name].row(scores.get(reference))}
    return {"artifact": str(artifact), "precision": manifest.precision.describe(), "window": window,
            "text_tokens": len(ids), "reference": reference, "backends": {n: rows[n] for n in named}}


def format_eval(result: dict) -> str:
    lines = [f"{result['artifact']}: {result['precision']}; {result['text_tokens']} tokens in windows of "
             f"{result['window']}" + (f"; KL and top-1 against {result['reference']}" if result["reference"] else ""),
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

"""`tk eval`: perplexity of a text, per backend, so a user sees what quantization costs on their
own data.

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

from tk.models.artifact import Manifest
from tk.models.errors import UsageProblem
from tk.runtimes.base import BackendUnavailable, InputError
from tk.toolkit.backends import BackendOptions, open_runtime, reference_runtime

DEFAULT_WINDOW = 1024  # tokens per window (at most the context): logits of a window are window x vocab floats


def windows(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of at most `window` tokens; a last window of one token predicts nothing."""
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def window_nll(logits: np.ndarray, chunk: list[int]) -> float:
    """Summed negative log-likelihood of a window's tokens after its first, from its (S, V) logits
    (position t predicts token t + 1)."""
    logits = logits[:-1].astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    return float((log_z - logits[np.arange(len(chunk) - 1), chunk[1:]]).sum())


def nll(runtime, chunks: list[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood of the windows on `runtime`, and how many tokens it counts."""
    total = 0.0
    for chunk in chunks:
        ids = np.array([chunk], dtype=np.int64)
        out, session = runtime.start(ids, np.ones_like(ids), room=1)
        session.close()
        total += window_nll(out.logits[0], chunk)
    return total, sum(len(c) - 1 for c in chunks)


def evaluate(artifact: Path, text: str, backends: list[str], window: int | None = None,
             options: BackendOptions = BackendOptions(), baseline: bool = True) -> dict:
    """Perplexity of `text` on each backend (a skipped backend says why)."""
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
    rows = {}
    named = {name: (lambda name=name: open_runtime(artifact, name, options)) for name in backends}
    if baseline and manifest.precision.quantized:
        named["torch (full-precision weights)"] = lambda: reference_runtime(artifact, manifest, quantized=False)
    for name, opener in named.items():
        try:
            with contextlib.ExitStack() as stack:
                runtime = stack.enter_context(opener())
                total, count = nll(runtime, chunks)
        except BackendUnavailable as e:
            rows[name] = {"status": "skipped", "reason": str(e)}
            continue
        rows[name] = {"status": "ok", "tokens": count, "nll": total / count, "perplexity": math.exp(total / count)}
    return {"artifact": str(artifact), "precision": manifest.precision.describe(), "window": window,
            "text_tokens": len(ids), "backends": rows}


def format_eval(result: dict) -> str:
    lines = [f"{result['artifact']}: {result['precision']}; {result['text_tokens']} tokens in windows of "
             f"{result['window']}", f"{'backend':34} {'tokens':>7} {'nll':>8} {'perplexity':>11}"]
    for name, row in result["backends"].items():
        if row["status"] == "skipped":
            lines.append(f"{name:34} skipped: {row['reason']}")
        else:
            lines.append(f"{name:34} {row['tokens']:>7} {row['nll']:8.4f} {row['perplexity']:11.3f}")
    return "\n".join(lines)

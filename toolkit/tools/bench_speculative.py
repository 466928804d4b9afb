"""`tk bench --workloads`: speculative decoding against plain decoding on named workloads, one
backend, in one run.

Each workload is one prompt, read through the artifact's tokenizer (token ids of the same shape
where it has none): `code-edit` (2,600 characters of Python source, then "# The same module,
copied exactly:" and its first 200 characters, the workload llama.cpp's lookup was measured on in
examples/bench_speculative.py: the answer copies the prompt), `summary` (a page of prose, then a request to restate it) and `free` (a short prompt,
nothing to copy). The modes are plain decoding, prompt lookup and, given a draft artifact, the
draft; they run alternately (plain, lookup, draft, plain, ...) after a warm-up, greedy, the same
number of new tokens each (EOS ignored). The report gives, per workload and mode, decode ms/token
(medians and spread), tokens per target step, the acceptance rate, the speed-up over plain (a
ratio of medians) and whether the tokens were plain's, as greedy speculation promises.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
from pathlib import Path

import numpy as np

from tk.models.spec.errors import UsageProblem
from tk.runtimes.decoding.generate import generate
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.speculation import WORKLOADS, SpeculationOptions, open_speculation


def workload_text(name: str) -> str:
    """The prompt text of a named workload (the same in every run: tk's own source and docstrings)."""
    from tk.runtimes.decoding import generate as gen_module, sampling, speculative

    if name == "code-edit":
        source = inspect.getsource(sampling)[:2600]
        return f"{source}\n\n# The same module, copied exactly:\n{source[:200]}"
    if name == "summary":
        prose = "\n\n".join(inspect.getdoc(m) for m in (speculative, gen_module, sampling))
        return f"{prose}\n\nThe text above, restated in its own words:\n"
    if name == "free":
        return "Write a short story about a lighthouse keeper who finds a map:"
    raise UsageProblem(f"unknown workload {name!r}; use one of {', '.join(WORKLOADS)}")


def workload_ids(name: str, tokenizer, vocab_size: int) -> list[int]:
    """The workload's prompt ids: its text through `tokenizer`, or without one, ids of its shape
    (code-edit and summary repeat a stretch of their prompt; free does not)."""
    if tokenizer is not None:
        return tokenizer.encode(workload_text(name))
    rng = np.random.default_rng(WORKLOADS.index(name))
    body = rng.integers(2, vocab_size, 150 if name != "free" else 12).tolist()
    return body + body[:32] if name != "free" else body


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_speculative(artifact: Path, backend: str = "ort", workloads=WORKLOADS, new_tokens: int = 128,
                      repeats: int = 3, options: BackendOptions = BackendOptions(),
                      speculation: SpeculationOptions = SpeculationOptions(lookup=True)) -> dict:
    """Plain, prompt lookup and (where `speculation` names a draft) the draft, alternated, on named workloads;
    `speculation` gives k, the n-grams and the draft's p_min. `options` are the runs' (for_runs)."""
    from tk.toolkit.textgen import Tokenizer

    if new_tokens < 1 or repeats < 1:
        raise UsageProblem(f"--new-tokens and --repeats must be at least 1, got {new_tokens} and {repeats}")
    rt = open_runtime(artifact, backend, options.for_runs(backend))
    if problem := rt.verify_problem:
        raise UsageProblem(f"{artifact}: {problem}")
    tokenizer = Tokenizer.find(artifact)
    lookup = dataclasses.replace(speculation, lookup=True, draft=None)
    modes = {"plain": None, "lookup": open_speculation(artifact, rt, lookup, backend, options)}
    if speculation.draft is not None:
        modes["draft"] = open_speculation(artifact, rt, speculation, backend, options)
    report = {"artifact": str(artifact), "backend": backend, "new_tokens": new_tokens, "repeats": repeats,
              "draft": None if speculation.draft is None else str(speculation.draft),
              "k": {m: s.k for m, s in modes.items() if s}, "lookup": [speculation.lookup_min, speculation.lookup_max],
              "draft_p_min": speculation.draft_p_min, "workloads": {}}
    with rt:
        try:
            for name in workloads:
                report["workloads"][name] = _workload(rt, name, workload_ids(name, tokenizer, rt.dims.vocab_size),
                                                      modes, new_tokens, repeats)
        finally:
            if "draft" in modes:
                modes["draft"].proposer.runtime.deactivate()
    return report


def _workload(rt, name: str, prompt: list[int], modes: dict, new_tokens: int, repeats: int) -> dict:
    if len(prompt) + new_tokens > rt.max_context:
        raise UsageProblem(f"the {name} workload's prompt of {len(prompt)} tokens plus --new-tokens {new_tokens} "
                           f"exceeds the artifact's context of {rt.max_context}")
    for spec in modes.values():  # warm-up: allocator, thread pools, each run width's first call
        generate(rt, [prompt], min(new_tokens, 16), ignore_eos=True, speculation=spec)
    runs: dict[str, list] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    for _ in range(repeats):
        for mode, spec in modes.items():
            result = generate(rt, [prompt], new_tokens, ignore_eos=True, speculation=spec)
            runs[mode].append(result.timings())
            tokens.setdefault(mode, result.rows[0].tokens)
    plain = statistics.median(r["decode_ms_per_token"] for r in runs["plain"])
    out = {"prompt_tokens": len(prompt), "modes": {}}
    for mode, rs in runs.items():
        ms = _spread([r["decode_ms_per_token"] for r in rs])
        entry = {"decode_ms_per_token": ms, "tokens_per_s": _spread([r["tokens_per_s"] for r in rs]),
                 "speedup": plain / ms["median"], "same_tokens": tokens[mode] == tokens["plain"]}
        if "speculation" in rs[0]:
            s = rs[0]["speculation"]
            entry.update(tokens_per_step=s["tokens_per_step"], acceptance=s["acceptance"],
                         proposed=s["proposed"], accepted=s["accepted"])
        out["modes"][mode] = entry
    return out


def format_speculative(report: dict) -> str:
    lines = [f"{report['artifact']} on {report['backend']}: {report['new_tokens']} new tokens, greedy, "
             f"median of {report['repeats']} (the most guesses a step: "
             + ", ".join(f"{m} {k}" for m, k in report["k"].items()) + ")",
             f"{'workload':10} {'mode':7} {'ms/token':>9} {'speed-up':>9} {'tokens/step':>12} {'accepted':>9}  same tokens"]
    for name, w in report["workloads"].items():
        for mode, m in w["modes"].items():
            step = f"{m['tokens_per_step']:.2f}" if "tokens_per_step" in m else "1"
            acc = f"{m['acceptance']:.0%}" if m.get("acceptance") is not None else "-"
            lines.append(f"{name:10} {mode:7} {m['decode_ms_per_token']['median']:9.2f} {m['speedup']:8.2f}x "
                         f"{step:>12} {acc:>9}  {'yes' if m['same_tokens'] else 'NO'}")
    return "\n".join(lines)

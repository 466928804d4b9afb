"""`tk bench`: time to first token, decode ms/token, tokens/s and peak memory per backend, side by
side in one run.

Backends are loaded once and run alternately (A B A B ...) after a warm-up, so a shift in machine
load hits all of them alike; the report gives medians and spreads and flags runs during which
other processes used a noticeable share of the CPUs. Peak memory is sampled from /proc while
each backend runs and set beside `tk inspect`'s prediction (weights + KV cache). Progress: the
steps load, warm-up and measure, the runs counted in tokens generated (tk.toolkit.progress).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from tk.models.spec.manifest import Manifest
from tk.models.spec.contract import DECODE
from tk.models.spec.errors import UsageProblem
from tk.runtimes.base import BackendUnavailable
from tk.runtimes.decoding.generate import generate
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.progress import Progress
from tk.toolkit.tools.describe import describe_profile, matching_profiles, memory_plan

BUSY_CORES = 0.25  # other processes using more than this many cores on average: the run is flagged


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return busy, int(own[11]) + int(own[12])  # utime + stime


class _Watch:
    """Peak RSS and other processes' CPU use while a block runs."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._cpu0, self._t0 = _cpu_jiffies(), time.perf_counter()
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        (busy0, own0), (busy1, own1) = self._cpu0, _cpu_jiffies()
        seconds = max(time.perf_counter() - self._t0, 1e-9)
        self.other_cores = max(0, (busy1 - busy0) - (own1 - own0)) / os.sysconf("SC_CLK_TCK") / seconds
        self.peak = max(self.peak, _rss())


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench(artifact: Path, backends: list[str], prompt_len: int = 128, new_tokens: int = 128, batch: int = 1,
          repeats: int = 3, options: BackendOptions = BackendOptions(), seed: int = 0,
          progress: Progress | None = None) -> dict:
    progress = Progress.of(progress)
    for name, value in (("--prompt-len", prompt_len), ("--new-tokens", new_tokens), ("--batch", batch),
                        ("--repeats", repeats)):
        if value < 1:
            raise UsageProblem(f"{name} must be at least 1, got {value}")
    progress.step("load")
    with contextlib.ExitStack() as active:  # every loaded runtime is closed, whatever happens
        runtimes, skipped, loaded = {}, {}, {}
        for name in backends:
            rt = open_runtime(artifact, name, options)
            try:
                before = _rss()
                active.enter_context(rt)
                runtimes[name], loaded[name] = rt, _rss() - before  # what holding this backend costs
            except BackendUnavailable as e:
                skipped[name] = str(e)
        if not runtimes:
            raise BackendUnavailable("no backend could run: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        return _bench(artifact, runtimes, skipped, loaded, prompt_len, new_tokens, batch, repeats, options, seed,
                      progress)


def _bench(artifact, runtimes, skipped, loaded, prompt_len, new_tokens, batch, repeats, options, seed,
           progress: Progress) -> dict:
    first = next(iter(runtimes.values()))
    manifest = Manifest.read(artifact)
    cfg = manifest.config
    if prompt_len + new_tokens > first.max_context:
        raise UsageProblem(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} exceeds the model's context of "
                           f"{first.max_context}")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, first.dims.vocab_size, (batch, prompt_len)).tolist()
    runs: dict[str, list] = {name: [] for name in runtimes}
    growth = dict.fromkeys(runtimes, 0)  # peak RSS over the RSS before a run: activations, KV cache, outputs
    progress.step("warm-up")
    for rt in runtimes.values():  # warm-up: allocator, thread pools, first-call paths
        generate(rt, prompts, min(new_tokens, 8), ignore_eos=True)
    progress.step("measure")
    total = repeats * len(runtimes)
    with progress.task("measure", total * batch * new_tokens, "tokens", total, "runs") as task:
        for _ in range(repeats):
            for name, rt in runtimes.items():
                before = _rss()
                with _Watch() as w:
                    result = generate(rt, prompts, new_tokens, ignore_eos=True)
                growth[name] = max(growth[name], w.peak - before)
                runs[name].append({**result.timings(), "other_cores": w.other_cores})
                task.advance(batch * new_tokens, 1)
    data = {g.data_file: g.data_bytes for g in manifest.graphs.values() if g.data_file}  # the weights as stored
    plan = memory_plan(cfg, manifest.precision, batch, prompt_len + new_tokens, sum(data.values()) or None,
                       manifest.dims)
    report = {"artifact": str(artifact), "profile": manifest.profile,
              "same_graphs_as": matching_profiles(manifest.variant, manifest.precision), "prompt_len": prompt_len, "new_tokens": new_tokens, "batch": batch,
              "repeats": repeats, "threads": options.threads, "cpu_count": os.cpu_count(),
              "predicted": {k: plan[k] for k in ("weights_bytes", "kv_bytes", "total_bytes")},
              "backends": {}, "skipped": skipped}
    for name, rs in runs.items():
        busy = [i for i, r in enumerate(rs) if r["other_cores"] > BUSY_CORES]
        report["backends"][name] = {
            "ttft_ms": _spread([r["ttft_ms"] for r in rs]),
            "decode_ms_per_token": _spread([r["decode_ms_per_token"] for r in rs]),
            "tokens_per_s": _spread([r["tokens_per_s"] for r in rs]),
            "load_rss_bytes": loaded[name],
            "run_peak_rss_growth_bytes": growth[name],
            "busy_runs": busy,
            "max_other_cores": max(r["other_cores"] for r in rs),
            "huge_page_bytes": getattr(runtimes[name], "huge_page_bytes", 0),  # weights on 2-MiB pages (ORT)
        }
    return report


def format_bench(report: dict) -> str:
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    cell = lambda m: f"{m['median']:.2f} ({m['min']:.2f}..{m['max']:.2f})"  # noqa: E731
    p = report["predicted"]
    lines = [f"{report['artifact']}: profile {describe_profile(report['profile'], report['same_graphs_as'])}",
             f"prompt {report['prompt_len']}, {report['new_tokens']} new tokens, batch {report['batch']}: "
             f"median (min..max) of {report['repeats']} runs, backends alternated",
             f"{'backend':8} {'ttft ms':>22} {'decode ms/token':>22} {'tokens/s':>24} {'load MiB':>9} "
             f"{'run MiB':>8}  busy"]
    for name, b in report["backends"].items():
        busy = (f"runs {b['busy_runs']}: other processes used up to {b['max_other_cores']:.2f} cores"
                if b["busy_runs"] else "no")
        lines.append(f"{name:8} {cell(b['ttft_ms']):>22} {cell(b['decode_ms_per_token']):>22} "
                     f"{cell(b['tokens_per_s']):>24} {mib(b['load_rss_bytes']):>9} "
                     f"{mib(b['run_peak_rss_growth_bytes']):>8}  {busy}")
    lines.append(f"predicted (tk inspect): weights {mib(p['weights_bytes'])} MiB, KV cache {mib(p['kv_bytes'])} MiB; "
                 "load MiB is RSS added by loading a backend, run MiB the peak RSS added during a run")
    lines += [f"{name}: {mib(b['huge_page_bytes'])} MiB of what it loaded sits on huge pages"
              for name, b in report["backends"].items() if b["huge_page_bytes"]]
    for name, reason in report["skipped"].items():
        lines.append(f"{name}: skipped: {reason}")
    names = list(report["backends"])
    for other in names[1:]:
        ratio = (report["backends"][names[0]]["decode_ms_per_token"]["median"]
                 / report["backends"][other]["decode_ms_per_token"]["median"])
        lines.append(f"decode speed of {other} relative to {names[0]}: {ratio:.2f}x")
    return "\n".join(lines)


def profile_decode(artifact: Path, prompt_len: int = 128, new_tokens: int = 64, threads: int | None = None,
                   top: int = 8) -> dict:
    """Where a decode step's time goes on ORT: Python and binding overhead (the step's wall time
    minus ORT's own run time) against ORT's run, and the op types that take the kernel time."""
    from tk.runtimes.backends.ort import OrtRuntime

    with OrtRuntime(artifact, threads=threads, profile=True) as rt:
        prompt = np.random.default_rng(0).integers(0, rt.dims.vocab_size, prompt_len).tolist()
        generate(rt, [prompt], 8, ignore_eos=True)  # warm-up, profiled too: dropped below by count
        result = generate(rt, [prompt], new_tokens, ignore_eos=True)
        trace = rt.end_profiling()
    events = json.loads(trace[DECODE].read_text())
    for path in trace.values():
        path.unlink(missing_ok=True)
    steps = len(result.decode_s)
    # the last `steps` runs are the decode steps (a session that also prefills ran prompts before them)
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run"][-steps:]
    starts = [w[0] for w in windows]
    kernels: dict[str, float] = {}
    per_step = [0.0] * len(windows)  # each step's kernel time, paired with its run and its wall time
    nodes = 0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            i = bisect.bisect_right(starts, e["ts"]) - 1
            if i >= 0 and e["ts"] <= windows[i][1]:
                kernels[e["args"]["op_name"]] = kernels.get(e["args"]["op_name"], 0.0) + e["dur"]
                per_step[i] += e["dur"]
                nodes += 1
    # medians of paired series keep each step's order (kernels <= run <= wall): a mean of the kernels
    # against a median of the runs did not, when one slow step inflated the mean
    wall_ms = 1e3 * statistics.median(result.decode_s)
    run_ms = statistics.median([b - a for a, b in windows]) / 1e3
    kernel_ms = statistics.median(per_step) / 1e3
    return {"steps": steps, "step_wall_ms": wall_ms, "ort_run_ms": run_ms, "kernel_ms": kernel_ms,
            "python_overhead_ms": wall_ms - run_ms, "executor_overhead_ms": run_ms - kernel_ms,
            "nodes_per_step": nodes // steps, "kernel_mean_ms": sum(kernels.values()) / steps / 1e3,  # ops' shares
            "ops": {op: us / steps / 1e3 for op, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]}}


def format_profile(p: dict) -> str:
    lines = [f"decode step on ORT (median of {p['steps']}, profiled, so slower than unprofiled runs): "
             f"{p['step_wall_ms']:.2f} ms wall = {p['python_overhead_ms']:.2f} ms Python/binding + "
             f"{p['executor_overhead_ms']:.2f} ms ORT executor + {p['kernel_ms']:.2f} ms in {p['nodes_per_step']} kernels"]
    lines += [f"  {op:26} {ms:7.3f} ms  {100 * ms / p['kernel_mean_ms']:5.1f}%" for op, ms in p["ops"].items()]
    return "\n".join(lines)

"""tk bench: runs every backend side by side and reports timings, memory and machine load."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tk.toolkit.cli.main import main
from tk.toolkit.tools.bench import BUSY_CORES


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_bench_reports_both_backends(tiny_artifact, tmp_path):
    result = run("bench", tiny_artifact, "--prompt-len", "8", "--new-tokens", "6", "--repeats", "2",
                 "--batch", "2", "--report", tmp_path / "b.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "b.json").read_text())
    assert set(report["backends"]) == {"torch", "ort"}
    for b in report["backends"].values():
        # a run's rate is its 2 x 6 tokens over its time to first token and 5 decode steps, so the median rate
        # lies between the rates of the slowest and the fastest timings (1e-9: rounding)
        t, d = b["ttft_ms"], b["decode_ms_per_token"]
        slowest, fastest = (2 * 6 * 1e3 / (t[k] + 5 * d[k]) for k in ("max", "min"))
        assert slowest * (1 - 1e-9) <= b["tokens_per_s"]["median"] <= fastest * (1 + 1e-9)
        assert all(0 <= i < 2 for i in b["busy_runs"]) and bool(b["busy_runs"]) == (b["max_other_cores"] > BUSY_CORES)
    # KV: 2 (k, v) * 2 layers * batch 2 * 14 tokens * 2 kv heads * 16 head_dim * 4 bytes
    assert report["predicted"]["kv_bytes"] == 2 * 2 * 2 * 14 * 2 * 16 * 4
    assert "decode speed of ort relative to torch" in result.stdout


def test_bench_profile_splits_a_decode_step(tiny_artifact):
    from tk.toolkit.tools.bench import profile_decode

    p = profile_decode(tiny_artifact, prompt_len=8, new_tokens=6)
    assert p["steps"] == 5 and p["nodes_per_step"] > 20
    assert p["kernel_ms"] > 0 and p["ort_run_ms"] >= p["kernel_ms"]
    assert abs(p["python_overhead_ms"] + p["executor_overhead_ms"] + p["kernel_ms"] - p["step_wall_ms"]) < 1e-9
    assert "MatMul" in p["ops"]
    result = run("bench", tiny_artifact, "--backends", "ort", "--prompt-len", "8", "--new-tokens", "6",
                 "--repeats", "1", "--profile")
    assert result.exit_code == 0 and "ms in " in result.stdout and "kernels" in result.stdout


def test_bench_bad_input(tiny_artifact):
    result = run("bench", tiny_artifact, "--new-tokens", "0")
    assert result.exit_code == 2 and result.stderr.strip() == "Error: --new-tokens must be at least 1, got 0"
    result = run("bench", tiny_artifact, "--prompt-len", "1000", "--new-tokens", "100")
    assert result.exit_code == 2
    # the steps it took before the check (progress, on stderr), then the one-line error
    assert result.stderr.strip().splitlines() == ["[load]", "Error: --prompt-len 1000 + --new-tokens 100 exceeds the "
                                                            "model's context of 1024"]
    result = run("bench", tiny_artifact, "--backends", "tpu")
    assert result.exit_code == 2 and "unknown backend tpu" in result.stderr


def test_anchor_script_runs_transformers_on_the_same_tokens(tiny, tiny_artifact, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    report = tmp_path / "anchors.json"
    out = subprocess.run([sys.executable, "examples/bench_anchors.py", str(tiny), str(tiny_artifact),
                          "--prompt-len", "8", "--new-tokens", "8", "--repeats", "2", "--report", str(report),
                          "--optimum", str(tmp_path / "optimum")],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    try:  # an optional anchor that is not installed is reported as skipped, and the run goes on
        import optimum.onnxruntime  # noqa: F401
    except ImportError:
        assert "optimum: skipped (optimum is not installed)" in out.stdout
    r = json.loads(report.read_text())
    assert set(r["stacks"]) >= {"tk portable dynamic", "transformers"}
    assert all(s["same_tokens_as_first"] for s in r["stacks"].values())
    ratio = r["ratios"]["transformers / tk portable dynamic"]
    assert ratio["decode"] > 0 and ratio["ttft"] > 0
    assert r["read_bandwidth_gbs"] > 0 and 0 < r["stacks"]["tk portable dynamic"]["fraction_of_decode_bound"]


def test_profile_serve_counts_threads_blocked_in_a_wait_as_idle():
    """examples/profile_serve.py: the HTTP front end's worker threads wait in their queue all their
    life; counted busy, they made the event loop look 90% busy (it is 2%)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("profile_serve", Path(__file__).parent.parent / "examples" / "profile_serve.py")
    ps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ps)
    worker = ("thread (11): AnyIO worker thread;_bootstrap (threading.py:1002);WorkerThread.run (anyio/_backends/"
              "_asyncio.py:1113);Queue.get (queue.py:171);Condition.wait (threading.py:327)")
    loop_idle = "thread (1): MainThread;BaseEventLoop.run_forever (asyncio/base_events.py:607);EpollSelector.select (selectors.py:468)"
    loop_busy = ("thread (1): MainThread;BaseEventLoop.run_forever (asyncio/base_events.py:607);RequestResponseCycle.send "
                 "(uvicorn/protocols/http/h11_impl.py:500);_SelectorSocketTransport.write (asyncio/selector_events.py:1071)")
    ort = ("thread (2): tk-batcher;OrtRuntime.run (runtimes/backends/ort.py:240);Session.run_with_iobinding "
           "(onnxruntime/capi/onnxruntime_inference_collection.py:400)")
    assert ps.classify(worker) == ("other", "idle")
    assert ps.classify(loop_idle) == ("event loop", "idle") and ps.classify(loop_busy) == ("event loop", "busy")
    assert ps.classify(ort) == ("batcher", "onnxruntime")


def test_run_drift_script_measures_a_run_against_steps(tiny_artifact):
    """examples/run_drift.py: a float32 export's run of tokens computes its steps' logits to the kernels'
    rounding; a bad prefix length is a usage error."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "examples/run_drift.py", str(tiny_artifact), "--tokens", "6", "--at", "2,5"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    drift = [float(x) for x in re.findall(r"\d: ([0-9.e+-]+)", out.stdout)]
    assert len(drift) == 2 and all(0 <= d < 1e-3 for d in drift), out.stdout
    bad = subprocess.run([sys.executable, "examples/run_drift.py", str(tiny_artifact), "--tokens", "6", "--at", "6"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--at takes prefix lengths" in bad.stderr


def test_serve_timeline_records_each_step_and_sums_its_runs(serve_artifact, tmp_path, monkeypatch):
    """examples/serve_timeline.py: each batcher step of a lookup-speculating batcher is one line with its
    plan and runs (prompt chunks, plain decodes, verify runs), and the summary's sums are the lines'."""
    import importlib.util
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tk.runtimes.decoding.speculative import PromptLookup, Speculation
    from tk.runtimes.serving import stepping
    from tk.runtimes.serving.batching import Batcher, BatcherLimits, Request, wait_all
    from tk.runtimes.serving.spec_rule import Guess
    from tk.toolkit.backends import BackendOptions, open_runtime

    script = Path(__file__).parent.parent / "examples" / "serve_timeline.py"
    spec = importlib.util.spec_from_file_location("serve_timeline", script)
    st = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)
    monkeypatch.setattr(stepping.Steps, "run", stepping.Steps.run)  # put back after the test
    timeline = tmp_path / "steps.jsonl"
    st.install(timeline)
    runtime = open_runtime(serve_artifact, "ort", BackendOptions(static_cache=True, prepack=True))
    with Batcher(runtime, limits=BatcherLimits(slots=2, max_queue=4),
                 speculation=Speculation(PromptLookup(1, 3), 4)) as batcher:
        # every request with guesses verifies them (whether guessing pays is the rule's: tests/test_scheduler.py)
        batcher.speculating.rule.plan = lambda decoding, spare=None: [Guess(s, s.room) for s in decoding if s.room]
        copying = [5, 6, 7, 8, 9] * 6
        requests = [batcher.submit(Request(p, 24, ignore_eos=True)) for p in (copying, [11, 12, 13, 14])]
        assert wait_all(requests, timeout=120)
    assert all(len(r.tokens) == 24 for r in requests)
    steps = [json.loads(line) for line in timeline.read_text().splitlines()]
    kinds = {r[2] for s in steps for r in s["runs"]}
    assert kinds == {"p", "d", "v"} and all(r[0] > 0 and r[1] >= 0 for s in steps for r in s["runs"])
    assert sum(r[0] for s in steps for r in s["runs"] if r[2] == "p") == len(copying) + 4  # every prompt token once
    assert all(s["dt"] >= sum(r[1] for r in s["runs"]) for s in steps)
    total = st.summary(timeline)
    assert total["steps"] == len(steps) and total["outside_runs_s"] >= 0
    assert total["prompt chunks"]["tokens"] == len(copying) + 4
    assert total["verify"]["runs"] == sum(1 for s in steps for r in s["runs"] if r[2] == "v")
    out = subprocess.run([sys.executable, str(script), "summary", str(timeline)], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout) == total
    bad = subprocess.run([sys.executable, str(script), "record", str(tmp_path / "x.jsonl")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "after --" in bad.stderr


def test_run_peaks_script_measures_what_each_run_holds(serve_artifact):
    """examples/run_peaks.py: a line per kind of run a server makes, each its base RSS and VmHWM's rise
    over it; a verify run of every row holds at least its logits (rows x 9 x V float32) while it runs."""
    import json
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "examples/run_peaks.py", str(serve_artifact), "--slots", "8",
                          "--prompt", "64"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    peaks = dict(re.findall(r"^(.+?)\s+base\s+[0-9.]+ MiB, peak \+([0-9.]+) MiB$", out.stdout, re.M))
    assert len(peaks) + out.stdout.count("(no group)") == 5, out.stdout
    vocab = json.loads((serve_artifact / "manifest.json").read_text())["config"]["vocab_size"]
    assert float(peaks["verify run, 8 rows x 9"]) >= 8 * 9 * vocab * 4 / 2 ** 20 - 0.1, out.stdout
    bad = subprocess.run([sys.executable, "examples/run_peaks.py", str(serve_artifact), "--slots", "4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--slots must be at least 8" in bad.stderr

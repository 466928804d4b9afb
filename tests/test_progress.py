"""Progress on long work (tk.toolkit.progress): off a terminal one plain line per step on stderr, bars
only on a terminal, nothing on stdout, and an interrupted export (Ctrl-C or SIGTERM) that leaves
nothing behind and says so in one line."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import textwrap

import pytest

import tk.toolkit.cli.export as cli_export
from tk.toolkit.progress import Progress, StderrProgress, Task

from clitools import run

STEP = re.compile(r"^\[([a-z-]+)\]$")


def steps(stderr: str) -> list[str]:
    return [m.group(1) for line in stderr.splitlines() if (m := STEP.match(line))]


def test_a_non_terminal_export_prints_one_plain_line_per_step(tiny, tmp_path):
    out = tmp_path / "out"
    result = run("export", tiny, "-o", out, "--no-validate")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{out}\n"  # stdout is the folder written, nothing else
    assert steps(result.stderr) == ["load", "trace", "weights", "write"]
    assert "\r" not in result.stderr and "|" not in result.stderr  # no bars
    assert re.search(r"^  weights: \d+ tensors, [\d.,]+ [KM]iB in [\d.]+ s \([\d.,]+ [KM]iB/s\)$", result.stderr, re.M)
    assert "  export prefill (" in result.stderr  # the notes are still there, under their steps


def test_a_library_caller_still_gets_the_notes_only(tiny, tmp_path):
    from tk.toolkit.pipeline.export import export_artifact

    said = []
    export_artifact(tiny, tmp_path / "out", progress=said.append, validate=False)
    assert any(s.startswith("export decode (") for s in said) and not any(s.startswith("[") for s in said)


class _Interrupt(StderrProgress):
    """Ctrl-C at step `at`, or (at="tensor") from the weights writer's thread once a tensor is written."""

    def __init__(self, at: str):
        super().__init__(io.StringIO())
        self.at = at

    def step(self, name: str) -> None:
        super().step(name)
        if name == self.at:
            raise KeyboardInterrupt

    def task(self, *args):
        class Mid(Task):
            def advance(self, n=1, items=0):
                raise KeyboardInterrupt

        return Mid(*args) if self.at == "tensor" else super().task(*args)


@pytest.mark.parametrize("at", ["trace", "tensor", "quantize", "write"])
def test_an_interrupted_export_leaves_nothing_behind(tiny, tmp_path, monkeypatch, at):
    monkeypatch.setattr(cli_export, "reporter", lambda: _Interrupt(at))
    out = tmp_path / "new" / "out"  # its parent too is made by the export, and removed with it
    result = run("export", tiny, "-o", out, "--weights", "int4", "--no-validate")
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-1] == "Error: interrupted" and "Traceback" not in result.output
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_sigterm_ends_an_export_like_ctrl_c(tiny, tmp_path):
    """A real SIGTERM, sent at the quantize step: exit 143, one line, no output folder, no temporary one."""
    script = tmp_path / "term.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        import tk.toolkit.cli.export as cli_export
        from tk.toolkit.cli.main import main
        from tk.toolkit.progress import StderrProgress

        class Term(StderrProgress):
            def step(self, name):
                super().step(name)
                if name == "quantize":
                    os.kill(os.getpid(), signal.SIGTERM)

        cli_export.reporter = Term
        main(prog_name="tk")
    """))
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run([sys.executable, str(script), "export", str(tiny), "-o", str(work / "out"), "--weights", "int4",
                        "--no-validate"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 143, r.stderr
    assert r.stderr.splitlines()[-1] == "Error: terminated (SIGTERM)" and "Traceback" not in r.stderr
    assert steps(r.stderr)[-1] == "quantize" and r.stdout == ""
    assert list(work.iterdir()) == []


def test_eval_json_parses_while_progress_goes_to_stderr(tiny_artifact, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a small model. " * 8)
    result = run("eval", tiny_artifact, "--text", text, "--window", "32", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["backends"]["ort"]["status"] == "ok"
    assert steps(result.stderr) == ["load", "score"]
    assert re.search(r"^  score: \d+ windows, [\d,]+ tokens in [\d.]+ s \([\d,.]+ tokens/s\)$", result.stderr, re.M)


def test_bench_keeps_progress_off_stdout(tiny_artifact):
    result = run("bench", tiny_artifact, "--backends", "ort", "--prompt-len", 4, "--new-tokens", 4, "--repeats", 2)
    assert result.exit_code == 0, result.output
    assert steps(result.stderr) == ["load", "warm-up", "measure"]
    assert "  measure: 2 runs, 8 tokens in " in result.stderr
    assert not steps(result.stdout) and "measure" not in result.stdout and "decode ms/token" in result.stdout


def test_bars_only_on_a_terminal():
    plain = StderrProgress(io.StringIO())
    assert not plain.bars  # a StringIO is no terminal
    stream = io.StringIO()
    bars = StderrProgress(stream, bars=True)
    bars.step("quantize")
    with bars.task("quantize", 3 * 2**20, "B", 3, "tensors") as task:
        for _ in range(3):
            task.advance(2**20, 1)
    shown = stream.getvalue()
    assert shown.startswith("[quantize]\n") and "3/3 tensors" in shown and "/s" in shown and "\r" in shown


def test_a_plain_callable_hears_notes_only():
    said = []
    p = Progress.of(said.append)
    p.step("load")
    with p.task("score", 10, "tokens") as task:
        task.advance(10)
    p("a note")
    assert said == ["a note"] and Progress.of(p) is p

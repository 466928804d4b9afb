"""What the CLI tests share: run `tk` in-process, read its one error line, and check that an export
with bad options is refused before a weight is read."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from tk.toolkit.cli.main import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def ort_options_seen(monkeypatch, option: str) -> list:
    """From now on (until the test ends), each OrtRuntime built appends its `option` attribute to the list
    returned: what a command's flags reached ONNX Runtime as."""
    from tk.runtimes.backends.ort import OrtRuntime

    seen, init = [], OrtRuntime.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(getattr(self, option))

    monkeypatch.setattr(OrtRuntime, "__init__", record)
    return seen


def error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


def refused_export(checkpoint: Path, out: Path, monkeypatch, *args) -> str:
    """`tk export CHECKPOINT -o OUT ARGS` must exit 2 before reading a weight and leave no OUT: its error line."""
    import tk.models.checkpoint.loading

    def no(*a, **k):
        raise AssertionError("weights were read for an export whose options are bad")
    monkeypatch.setattr(tk.models.checkpoint.loading, "load_state_dict", no)
    result = run("export", checkpoint, "-o", out, *args)
    assert result.exit_code == 2, result.output
    assert not out.exists()
    return error_line(result)

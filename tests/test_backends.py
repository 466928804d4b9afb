"""A new backend is one module and one registry line: a small numpy backend (ONNX's own reference
evaluator over the same two graphs) registered here runs `tk generate` and `tk parity` unchanged."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tk.models.spec.manifest import Manifest
from tk.runtimes.base import Runtime, StepOutput
from tk.toolkit import backends
from tk.toolkit.cli.main import main

pytestmark = pytest.mark.slow


class NumpyRuntime(Runtime):
    """onnx.reference.ReferenceEvaluator over prefill.onnx and decode.onnx: every op in numpy."""

    name = "numpy"

    def __init__(self, artifact):
        self.artifact, self.manifest = artifact, Manifest.read(artifact)
        super().__init__(self.manifest.dims, self.manifest.max_context)

    def _load(self):
        from onnx.reference import ReferenceEvaluator

        paths = self.manifest.verify_files(self.artifact)
        self.graphs = {g: ReferenceEvaluator(str(p)) for g, p in paths.items()}

    def run(self, graph, feeds, past, session, in_place=False):
        inputs = {**feeds, **dict(zip(self.past_names, past or []))}
        outs = self.graphs[graph].run(None, inputs)
        present = outs[1 : 1 + len(self.present_names)]
        if in_place:  # the evaluator returns a new buffer: copy it into the session's
            for buf, new in zip(past, present):
                buf[...] = new
            present = past
        return StepOutput(outs[0]), present


@pytest.fixture
def numpy_backend(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "numpy", backends.Backend(
        "numpy", lambda artifact, manifest, options: NumpyRuntime(artifact), "ONNX's reference evaluator"))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_registered_backend_runs_generate_and_parity(numpy_backend, tiny_artifact, tmp_path):
    args = ["--prompt-ids", "5,6,7", "--prompt-ids", "9,10", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    ours = run("generate", tiny_artifact, "--backend", "numpy", *args)
    assert ours.exit_code == 0, ours.output
    ort = run("generate", tiny_artifact, "--backend", "ort", *args)
    assert [r["tokens"] for r in json.loads(ours.stdout)["rows"]] == [r["tokens"] for r in json.loads(ort.stdout)["rows"]]
    report = tmp_path / "r.json"
    result = run("parity", tiny_artifact, "--backends", "numpy,ort", "--steps", "4", "--report", report)
    assert result.exit_code == 0, result.output
    entry = json.loads(report.read_text())["backends"]["numpy"]
    assert entry["status"] == "passed" and len(entry["probes"]) == 5
    assert run("doctor").stdout.count("numpy") == 1  # the registry is what doctor lists


def test_an_unregistered_backend_is_a_usage_error(tiny_artifact):
    result = run("generate", tiny_artifact, "--backend", "numpy", "--prompt-ids", "1")
    assert result.exit_code == 2 and "unknown backend 'numpy'; use one of torch, ort, trt" in result.stderr

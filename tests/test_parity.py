"""tk parity: every family passes, precisions are told apart, injected bugs fail and are localized,
the report follows its schema and is stable."""

from __future__ import annotations

import dataclasses
import json
import shutil
import xml.etree.ElementTree as ET

import jsonschema
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from conftest import FAMILY_NAMES
from hf_models import ci_picks
from tk.models.reference.layers import RMSNorm
from tk.models.checkpoint.loading import load_decoder
from tk.models.spec.config import DecoderConfig
from tk.models.spec.manifest import Manifest
from tk.models.reference.positions import rope_inv_freq
from tk.runtimes.backends.torch import TorchRuntime
from tk.toolkit.cli.main import main
from tk.toolkit.verify.compare import BackendReport, CaseReport, ParityReport, compare_backends, parity
from tk.toolkit.verify.metrics import (Comparison, Divergence, StepMetrics, StepResult, Trace, compare_traces,
                                       measure_traces, random_cases)
from tk.toolkit.verify.probes import PROBES, ProbeResult
from tk.toolkit.verify.report import SCHEMA_PATH, format_table, to_dict, verdict
from tk.toolkit.verify.tolerance import tolerance_for

PROBE_NAMES = [p.__name__ for p in PROBES]

pytestmark = pytest.mark.slow
SMALL = DecoderConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)  # for tolerances


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("family", ci_picks(FAMILY_NAMES, {"llama", "gemma"}))  # the rest: -m families
def test_fp32_ort_passes_on_every_family(artifacts, family):
    report = parity(artifacts(family), ["ort"], steps=8)
    ort = report.backends["ort"]
    assert report.passed and ort.passed
    assert len(ort.probes) == len(PROBES) and all(p.passed for p in ort.probes)
    assert all(m == 8 for c in ort.cases for m in c.greedy_match)


def test_fp16_passes_its_table_and_fails_the_fp32_table(artifacts):
    art = artifacts("llama", "fp16")
    assert parity(art, ["ort"], steps=6).passed
    strict = tolerance_for("float32", Manifest.read(art).config)
    report = parity(art, ["ort"], steps=6, atol=strict.atol, rtol=strict.rtol)
    assert not report.passed and report.backends["ort"].failed
    assert report.backends["ort"].first_divergence.step == 0


def test_report_schema_and_stability(tiny_artifact, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        result = run("parity", tiny_artifact, "--steps", "4", "--report", path, "--seed", "3")
        assert result.exit_code == 0, result.output
    schema = json.loads(SCHEMA_PATH.read_text())
    report = json.loads(a.read_text())
    jsonschema.validate(report, schema)
    assert a.read_text() == b.read_text()
    assert set(report["backends"]) == {"torch", "ort"}
    bad = dict(report, passed="yes")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_missing_backend_is_skipped_with_reason_and_require_fails(tiny_artifact, tmp_path):
    result = run("parity", tiny_artifact, "--backends", "ort,trt", "--steps", "2", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    trt = json.loads((tmp_path / "r.json").read_text())["backends"]["trt"]
    assert trt["status"] == "skipped" and "pip install" in trt["reason"]
    assert "trt: skipped: " in result.stderr
    for require, kind in ((), "skipped"), (("--require", "trt"), "failure"):
        junit = tmp_path / f"{kind}.xml"
        required = run("parity", tiny_artifact, "--backends", "ort,trt", "--steps", "2", *require, "--junit", junit)
        suite = ET.parse(junit).getroot().find("testsuite")
        trt_case = next(tc for tc in suite.findall("testcase") if tc.get("classname") == "tk.parity.trt")
        assert trt_case.find(kind).get("message").startswith("trt was skipped: ")
        assert suite.get("failures") == ("1" if require else "0")
    assert required.exit_code == 3
    assert required.stderr.strip().splitlines()[-1] == "Error: parity failed: required backend trt was skipped"


def test_plot_is_written(tiny_artifact, tmp_path):
    result = run("parity", tiny_artifact, "--steps", "2", "--plot", tmp_path / "p.png")
    assert result.exit_code == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- injected bugs: each must fail the gate and be localized -------------------------------


class Shifted(torch.nn.Module):
    """The reference with position ids off by one."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, ids, mask, pos, past=None, write_index=None, output_hidden=False):
        return self.model(ids, mask, pos + 1, past, write_index, output_hidden)


class Fp16SquareNorm(RMSNorm):
    """A norm that squares in float16: overflows once |x| > 256."""

    def forward(self, x):
        var = (x.half() ** 2).mean(-1, keepdim=True).float()
        return (x.float() * torch.rsqrt(var + self.eps) * (self.offset + self.weight.float())).to(x.dtype)


def _drop_mask(layer):
    forward = layer.forward
    layer.forward = lambda x, inputs, *rest: forward(x, dataclasses.replace(inputs, mask=None), *rest)


def _swap_kv(layer, cfg):
    w = layer.attn.wqkv.weight.data
    q, kv = cfg.q_size, cfg.kv_size
    w[q:q + kv], w[q + kv:] = w[q + kv:].clone(), w[q:q + kv].clone()


def _mutate(model, kind):
    cfg = model.config
    if kind == "rope_base":
        model.inv_freq = rope_inv_freq(cfg) * 0.5
    elif kind == "position_off_by_one":
        return Shifted(model)
    elif kind == "no_causal_mask":
        _drop_mask(model.layers[0])
    elif kind == "swap_kv":
        _swap_kv(model.layers[1], cfg)
    elif kind == "scaled_ffn":
        model.layers[0].ffn.w_down.weight.data *= 1.1
    elif kind == "scaled_norm":
        model.layers[1].attn_norm.weight.data *= 1.25
    elif kind == "fp16_norm_overflow":
        good = model.layers[1].attn_norm
        bad = Fp16SquareNorm(cfg.hidden_size, good.eps, good.offset)
        bad.weight = good.weight
        model.layers[1].attn_norm = bad
    return model


# kind -> (first divergent tensor, layer) from the cache alone, and with hidden states (debug)
MUTATIONS = {
    "rope_base": (("present.0.key", 0), ("present.0.key", 0)),  # keys rotate wrongly from layer 0 on
    "position_off_by_one": (("present.0.key", 0), ("present.0.key", 0)),
    # layer 0's attention sees the future: its K/V are right, its output is not; without hidden
    # states layer 1's cache is the first place that shows it
    "no_causal_mask": (("present.1.key", 1), ("hidden.0", 0)),
    "swap_kv": (("present.1.key", 1), ("present.1.key", 1)),
    "scaled_norm": (("present.1.key", 1), ("present.1.key", 1)),
    "fp16_norm_overflow": (("present.1.key", 1), ("present.1.key", 1)),
    "scaled_ffn": (("present.1.key", 1), ("hidden.0", 0)),  # layer 0's FFN output
}


@pytest.fixture(scope="module")
def mutation_checkpoints(checkpoints, trained_like, tmp_path_factory):
    """model -> (checkpoint, its loud copy: layer 0's FFN output scaled so layer 1's norm sees |x|
    in the hundreds)."""
    out = {}
    for model, folder in (("llama", checkpoints("llama")), ("trained-like", trained_like)):
        d = tmp_path_factory.mktemp("loud") / model
        shutil.copytree(folder, d)
        sd = load_file(d / "model.safetensors")
        sd["model.layers.0.mlp.down_proj.weight"] *= 300 if model == "llama" else 3000
        save_file(sd, d / "model.safetensors")
        out[model] = (folder, d)
    return out


@pytest.mark.parametrize("hidden", [False, True], ids=["cache", "hidden"])
@pytest.mark.parametrize("kind", list(MUTATIONS))
@pytest.mark.parametrize("model", ["llama", "trained-like"])
def test_injected_bug_fails_and_is_localized(mutation_checkpoints, model, kind, hidden):
    """On a tiny family and on the trained-like preset (24 layers, logits ~30), whose own rounding
    noise is what an absolute tolerance cannot tell from a fault."""
    folder, loud = mutation_checkpoints[model]
    folder = loud if kind == "fp16_norm_overflow" else folder
    reference = TorchRuntime(load_decoder(folder), debug=hidden)
    cases = random_cases(reference.dims.vocab_size, seed=1)
    tol = tolerance_for("float32", reference.model.config)
    healthy = TorchRuntime(load_decoder(folder), debug=hidden)
    mutant = TorchRuntime(_mutate(load_decoder(folder), kind), debug=hidden)
    with reference, healthy, mutant:  # the labels name the two torch runtimes in the report
        report = compare_backends(reference, {"healthy": healthy, "mutant": mutant}, cases, tol, steps=3)
    assert report.backends["healthy"].passed and report.backends["mutant"].failed and not report.passed
    assert {c.comparison.backend for c in report.backends["mutant"].cases} == {"mutant"}
    where, layer = MUTATIONS[kind][hidden]
    div = report.backends["mutant"].first_divergence
    assert (div.step, div.where, div.layer) == (0, where, layer), div
    # the line tk parity exits 3 with names the step and the layer
    line = verdict(report)
    assert line.startswith("parity failed: mutant first leaves its tolerance at step 0, row ")
    assert f"in {where} (layer {layer})" in line


@pytest.mark.parametrize("prefill_logits", ["all", "last"])
def test_bug_in_the_reference_exits_3_naming_step_and_layer(tiny, tmp_path, prefill_logits):
    """With --prefill-logits last the prefill's cache, which covers every position, still names the layer."""
    from tk.toolkit.pipeline.export import export_artifact

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    art = tmp_path / "art"
    export_artifact(ckpt, art, validate=False, prefill_logits=prefill_logits)
    sd = load_file(ckpt / "model.safetensors")
    sd["model.layers.1.input_layernorm.weight"] *= 1.25  # the reference changes, the graphs do not
    save_file(sd, ckpt / "model.safetensors")
    result = run("parity", art, "--backends", "ort", "--steps", "3", "--junit", tmp_path / "gate.xml")
    assert result.exit_code == 3
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: parity failed: ort first leaves its tolerance at step 0, row 0, position ")
    assert "in present.1.key (layer 1)" in line
    # the CI's test view: each failing case carries the line that locates it
    suite = ET.parse(tmp_path / "gate.xml").getroot().find("testsuite")
    cases = {(tc.get("classname"), tc.get("name")): tc for tc in suite.findall("testcase")}
    assert set(cases) == {("tk.parity.ort", "batch1-len7"), ("tk.parity.ort", "batch3-len5/9/12"),
                          *(((f"tk.parity.{who}.probes", p) for who in ("reference", "ort") for p in PROBE_NAMES))}
    failure = cases["tk.parity.ort", "batch1-len7"].find("failure")
    assert failure is not None and failure.get("message").startswith("ort first leaves its tolerance at step 0, ")
    assert "in present.1.key (layer 1) of case batch1-len7" in failure.get("message")
    assert "FAIL at step 0" in failure.text  # the case's table
    assert int(suite.get("failures")) >= 2 and suite.get("tests") == str(len(cases))


def test_prompts_file_text_and_ids(tiny_artifact, tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("Once upon a time\nThe quick brown fox jumps\n")
    ids = tmp_path / "prompts.json"
    ids.write_text("[[5, 6, 7], [8, 9, 10, 11, 12]]")
    for path in (text, ids):
        result = run("parity", tiny_artifact, "--backends", "ort", "--steps", "3", "--prompts", path,
                     "--report", tmp_path / "r.json")
        assert result.exit_code == 0, result.output
        cases = json.loads((tmp_path / "r.json").read_text())["backends"]["ort"]["cases"]
        assert [c["case"] for c in cases] == ["file-batch2"]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    result = run("parity", tiny_artifact, "--prompts", empty)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: {empty} holds no prompts: one text per line, or a JSON list of token-id lists")


def test_debug_export_localizes_to_the_layer_output(tiny, tmp_path):
    """A debug export's hidden.{i} outputs let tk parity name the layer whose output diverged."""
    from tk.toolkit.pipeline.export import export_artifact

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    art = tmp_path / "art"
    manifest = export_artifact(ckpt, art, debug_outputs=True)
    assert manifest.dims.hidden_size == 64 and manifest.validation.passed
    assert parity(art, ["ort"], steps=3).passed
    sd = load_file(ckpt / "model.safetensors")
    sd["model.layers.0.mlp.down_proj.weight"] *= 1.1  # the reference's layer-0 FFN changes, the graphs do not
    save_file(sd, ckpt / "model.safetensors")
    result = run("parity", art, "--backends", "ort", "--steps", "3")
    assert result.exit_code == 3
    assert "in hidden.0 (layer 0)" in result.stderr.strip().splitlines()[-1]


# --- the report tree: the leaves decide, the tree aggregates, the edge writes --------------


def _case(name: str, *passed: bool, divergence: Divergence | None = None) -> CaseReport:
    steps = [StepResult(metrics=StepMetrics(step=i, max_abs=0.0, mean_abs=0.0, max_rel=0.0, cosine_min=1.0, top1=1.0,
                                            top5=1.0, kl_max=0.0),
                        error_ratio=0.5 if ok else 2.0, top1=1.0, kl_ratio=0.0, present_max_abs=[], present_ratio=0.0,
                        passed=ok)
             for i, ok in enumerate(passed)]
    return CaseReport(Comparison(name.split("/")[0], "torch", name, steps, divergence))


def test_passed_is_decided_by_the_leaves():
    tol = tolerance_for("float32", SMALL)
    ok, bad = ProbeResult("finite", True, 0.0, 0.0, "all finite"), ProbeResult("finite", False, 0.0, 0.0, "NaN")
    good = BackendReport("good", "float32", [_case("good/a", True, True)], [ok])
    skipped = BackendReport("trt", skipped="pip install tensorrt")
    report = ParityReport(BackendReport("torch", "float32", probes=[ok]), {"good": good, "trt": skipped}, tol, 1, 0,
                          "art", "float32")
    assert report.passed and good.passed and not skipped.passed and not skipped.failed
    assert verdict(report) is None
    assert verdict(report, ("trt",)) == "parity failed: required backend trt was skipped"
    assert verdict(report, ("numpy",)) == "parity failed: required backend numpy was skipped"  # not even listed
    d = to_dict(report)
    jsonschema.validate(d, json.loads(SCHEMA_PATH.read_text()))
    assert d["passed"] and d["backends"]["good"]["status"] == "passed" and d["backends"]["trt"] == {
        "status": "skipped", "reason": "pip install tensorrt"}

    report.backends["probe"] = BackendReport("probe", "float32", [_case("probe/a", True, True)], [bad])
    assert report.backends["probe"].failed and not report.passed
    assert verdict(report) == "parity failed: probe failed the probe(s) finite"
    div = Divergence("drift/a", 1, 0, 8, "present.1.key", 1, 0.5, 0.1)
    report.backends = {"drift": BackendReport("drift", "float32", [_case("drift/a", True, False, divergence=div)])}
    assert report.backends["drift"].first_divergence is div and not report.passed
    assert verdict(report) == ("parity failed: drift first leaves its tolerance at step 1, row 0, position 8, in "
                               "present.1.key (layer 1) of case drift/a: max_abs 0.5 > bound 0.1")
    d = to_dict(report)
    jsonschema.validate(d, json.loads(SCHEMA_PATH.read_text()))
    assert d["backends"]["drift"]["first_divergence"] == d["backends"]["drift"]["cases"][0]["first_divergence"] == {
        "case": "drift/a", "step": 1, "row": 0, "position": 8, "where": "present.1.key", "layer": 1, "max_abs": 0.5,
        "bound": 0.1}
    report.backends, report.reference.probes = {}, [bad]
    assert verdict(report) == "parity failed: the reference backend failed a probe"


def test_measure_traces_gives_the_gates_metrics_without_the_gate():
    rng = np.random.default_rng(0)
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    logits = [rng.normal(size=(2, 4, 50)), rng.normal(size=(2, 1, 50)), rng.normal(size=(2, 1, 50))]
    ref = Trace("torch", np.zeros((2, 2), np.int64), logits)
    test = Trace("ort", ref.tokens, [x + rng.normal(scale=0.3, size=x.shape) for x in logits])
    tol = tolerance_for("float32", SMALL)
    judged = compare_traces(ref, test, mask, tol, "c")
    assert not judged.passed and (judged.first_divergence.step, judged.first_divergence.where) == (0, "logits")
    measured = measure_traces(ref, test, mask)
    assert len(measured) == len(judged.steps) == 3
    for j, m in zip(judged.steps, measured):
        assert j.metrics == m
        assert m.top1 <= j.top1  # the gate counts the reference's near-ties as agreeing; a measurement does not


def _w8a8_head(rng, k: int, vocab: int):
    """A W8A8 head as the graph holds it (int8 [K, V], a jittered scale a column) and its logits of a
    head input rounded to int8 a row at a time (quantize_rows, as the graph and the reference do)."""
    from tk.models.quant.quantize import quantize_rows

    q = rng.integers(-127, 128, (k, vocab)).astype(np.int8)
    scale = (0.004 * (1 + 0.3 * rng.random(vocab))).astype(np.float32)
    w = torch.from_numpy(q.astype(np.float32) * scale)
    return (q, scale), lambda x: (quantize_rows(torch.from_numpy(x)) @ w).numpy()


def _on_boundary(x: np.ndarray, i: int, above: bool) -> np.ndarray:
    """`x` (K,) with element i a ten-thousandth of a quantum above (or below) a rounding boundary (within
    the float bound of the input, well over float32's resolution)."""
    s = np.float32(np.abs(x).max()) / np.float32(127)
    x = x.copy()
    x[i] = (np.floor(x[i] / s) + 0.5 + (1e-4 if above else -1e-4)) * s
    return x


def test_a_w8a8_heads_input_roundings_that_go_the_other_way_are_explained_and_nothing_else_is():
    """A W8A8 head rounds its input to int8: an element the reference leaves within float noise of a
    boundary can round the other way in the backend and move the position's logits past the float
    bound. Parity takes such flips out (from the reference's recorded head inputs and the head's
    int8 rows) and judges the rest; it counts them, keeps the measured metrics, and still fails a
    wrong column scale or an input off by a whole quantum."""
    from tk.models.quant.quantize import quantize_rows
    from tk.toolkit.verify.head_rounding import HeadRounding

    rng = np.random.default_rng(5)
    k, vocab = SMALL.hidden_size, SMALL.vocab_size
    weights, head = _w8a8_head(rng, k, vocab)
    mask = np.array([[0, 1, 1], [1, 1, 1]])
    x = [(rng.normal(size=(2, 3, k)) * np.linspace(1, 6, k)).astype(np.float32),  # prefill, then one step
         (rng.normal(size=(2, 1, k)) * np.linspace(1, 6, k)).astype(np.float32)]
    x[0][1, 2] = _on_boundary(x[0][1, 2], 5, above=True)
    x[1][0, 0] = _on_boundary(_on_boundary(x[1][0, 0], 7, above=False), 11, above=True)
    ref = Trace("torch", np.zeros((2, 1), np.int64), [head(a) for a in x], head_inputs=x)
    assert min(np.ptp(a, axis=-1).min() for a in ref.logits) > 5.0  # not flat
    tol = tolerance_for("float32", SMALL)

    def backend(inputs, wrong_scale=False):  # what a backend computes from its own head inputs, and float noise
        scale = weights[1] * np.where(np.arange(vocab) == 3, np.float32(1.02), np.float32(1)) if wrong_scale else weights[1]
        w = torch.from_numpy(weights[0].astype(np.float32) * scale)
        logits = [(quantize_rows(torch.from_numpy(a)) @ w).numpy() for a in inputs]
        return Trace("ort", ref.tokens, [a + rng.normal(scale=1e-6, size=a.shape).astype(np.float32) for a in logits])

    flipped = [a.copy() for a in x]  # the backend's inputs: the three boundary elements round the other way
    flipped[0][1, 2] = _on_boundary(x[0][1, 2], 5, above=False)
    flipped[1][0, 0] = _on_boundary(_on_boundary(x[1][0, 0], 7, above=True), 11, above=False)
    test = backend(flipped)
    rounding = HeadRounding(None, weights=weights)

    plain = compare_traces(ref, test, mask, tol, "c")
    assert not plain.passed and plain.first_divergence.where == "logits"
    judged = compare_traces(ref, test, mask, tol, "c", rounding)
    assert judged.passed and judged.first_divergence is None
    assert [s.head_flips for s in judged.steps] == [1, 2]
    assert [s.metrics for s in judged.steps] == [s.metrics for s in plain.steps]  # measured as it was
    assert all(s.error_ratio < 0.1 for s in judged.steps) and min(s.metrics.max_abs for s in judged.steps) > 0.01
    assert "ok (3 head-input rounding flips)" in format_table([judged])
    report = ParityReport(BackendReport("torch", "float32"), {"ort": BackendReport("ort", "float32", [CaseReport(judged)])},
                          tol, 1, 0, "art", "float32")
    d = to_dict(report)
    jsonschema.validate(d, json.loads(SCHEMA_PATH.read_text()))
    assert [s["head_flips"] for s in d["backends"]["ort"]["cases"][0]["steps"]] == [1, 2]

    assert not compare_traces(ref, backend(x, wrong_scale=True), mask, tol, "c", rounding).passed  # a wrong scale
    far = [a.copy() for a in x]  # an element off by a whole quantum, far from its boundary
    s = np.abs(far[1][1, 0]).max() / 127
    far[1][1, 0, 20] += s * (1 if far[1][1, 0, 20] < 0 else -1)
    assert not compare_traces(ref, backend(far), mask, tol, "c", rounding).passed
    assert compare_traces(ref, backend(x), mask, tol, "c", rounding).steps[1].head_flips == 0  # nothing to explain

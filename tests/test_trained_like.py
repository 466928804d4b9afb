"""The gate on a model with a trained checkpoint's numerics: the trained-like preset (24 layers,
vocab 32768, logits ~30, a residual stream that grows with depth). Tolerances calibrated on
models with logits ~1 fail here on rounding alone; tk's bounds scale with the model."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tk.models.spec.manifest import Manifest
from tk.models.checkpoint.loading import load_decoder
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.cli.main import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(trained_like, tmp_path_factory):
    """dtype -> artifact, each exported with validation on (the default)."""
    out = {}
    for dtype in ("fp32", "fp16"):
        art = tmp_path_factory.mktemp(f"trained-like-{dtype}") / "artifact"
        export_artifact(trained_like, art, dtype=dtype)
        out[dtype] = art
    return out


def test_the_preset_has_trained_numerics(trained_like):
    model = load_decoder(trained_like)
    cfg = model.config
    assert cfg.num_layers >= 24 and cfg.vocab_size >= 32768 and cfg.tie_embeddings
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(7))  # not the calibration batch
    with torch.no_grad():
        logits, present, hidden = model(ids, torch.ones_like(ids), torch.arange(32).expand(2, 32), output_hidden=True)
    assert 20 < float(logits.abs().amax(-1).mean()) < 45  # logits of magnitude ~30
    rms = np.array([float(h.pow(2).mean().sqrt()) for h in hidden])
    assert (np.diff(rms) > 0).all() and rms[-1] / rms[0] > 50  # the residual stream grows layer by layer
    assert max(float(k.abs().max()) for k, _ in present) > 5  # keys of several units, as a trained cache's
    top2 = logits.topk(2, -1).values
    assert float((top2[..., 0] - top2[..., 1]).median()) > 0.1 and len(logits.argmax(-1).unique()) > 16  # not flat


def test_fp32_export_validates_and_tk_parity_passes(exported, tmp_path):
    art = exported["fp32"]
    v = Manifest.read(art).validation
    steps = [s for c in v.comparisons for s in c["steps"]]
    assert v.passed
    # rounding alone takes the logits past the 1e-4 of a table calibrated on logits ~1 (FACTS.md: the
    # real 135M checkpoint reaches 1.7e-4): this fixture exercises the scaling
    assert max(s["max_abs"] for s in steps) > 1e-4
    assert max(s["error_ratio"] for s in steps) < 0.5 and max(s["present_ratio"] for s in steps) < 0.5
    result = CliRunner().invoke(main, ["parity", str(art), "--steps", "16", "--junit", str(tmp_path / "p.xml")])
    assert result.exit_code == 0, result.output
    suite = ET.parse(tmp_path / "p.xml").getroot().find("testsuite")
    assert suite.get("failures") == "0" and int(suite.get("tests")) == 2 * 2 + 3 * 5  # 2 backends x 2 cases, probes


def test_fp16_export_validates_and_tk_parity_passes(exported):
    art = exported["fp16"]
    manifest = Manifest.read(art)
    assert manifest.dtype == "float16" and manifest.validation.passed
    result = CliRunner().invoke(main, ["parity", str(art), "--backends", "ort", "--steps", "16"])
    assert result.exit_code == 0, result.output

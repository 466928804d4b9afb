"""The cache of traced graphs (exporters/trace_cache.py) that the suite runs under: an export through
it, missed or hit, writes the same bytes as one without it, and what determines a trace is its key."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tk.exporters import trace_cache

FILES = ("prefill.onnx", "decode.onnx", "weights.onnx.data")


def _export(checkpoint: Path, out: Path, cache: Path | None, *flags: str) -> dict[str, bytes]:
    """`tk export` in a fresh process (a hit must not lean on what a trace left in the process)."""
    env = {k: v for k, v in os.environ.items() if k != trace_cache.ENV}
    if cache is not None:
        env[trace_cache.ENV] = str(cache)
    subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "export", str(checkpoint), "-o", str(out),
                    "--no-validate", *flags], env=env, check=True, capture_output=True)
    return {name: (out / name).read_bytes() for name in FILES}


@pytest.mark.slow
@pytest.mark.parametrize("family, flags", [  # CI: the fused graphs, whose trace is the longest; -m families: all
    pytest.param("tiny", (), marks=pytest.mark.families),
    ("tiny", ("--for", "ort-cpu", "--max-seq-len", "64")),
    pytest.param("gemma", ("--for", "ort-cpu"), marks=pytest.mark.families),  # constants the trace makes (the
    # embedding's scale) beside meta weights
], ids=["portable", "ort-cpu", "gemma-ort-cpu"])
def test_cached_traces_write_the_same_graphs(tiny, checkpoints, tmp_path, family, flags):
    checkpoint = tiny if family == "tiny" else checkpoints(family)
    plain = _export(checkpoint, tmp_path / "plain", None, *flags)
    missed = _export(checkpoint, tmp_path / "miss", tmp_path / "cache", *flags)
    assert len(list((tmp_path / "cache").glob("*.onnx"))) == 2  # prefill and decode, traced once each
    hit = _export(checkpoint, tmp_path / "hit", tmp_path / "cache", *flags)
    assert len(list((tmp_path / "cache").glob("*.onnx"))) == 2  # nothing traced again
    for name in FILES:
        assert missed[name] == plain[name], f"{name} differs after a miss"
        assert hit[name] == plain[name], f"{name} differs after a hit"


def test_the_key_is_what_determines_a_trace():
    from tk.models.spec.config import DecoderConfig
    from tk.models.spec.contract import GraphDims
    from tk.models.spec.manifest import Precision
    from tk.models.spec.variant import Variant
    from tk.exporters.weights import export_view
    import torch

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                        num_kv_heads=2, max_position_embeddings=64)
    view = export_view(cfg, torch.float32)
    dims = GraphDims.of(cfg, Precision(), Variant())  # the sizes, and the variant they hold
    key = trace_cache._key(view, "decode", dims)
    assert key == trace_cache._key(export_view(cfg, torch.float32), "decode", dims)
    assert key != trace_cache._key(view, "prefill", dims)
    assert key != trace_cache._key(view, "decode", dataclasses.replace(dims, kv_dtype="float16"))
    assert key != trace_cache._key(export_view(cfg, torch.float16), "decode", dims)
    assert key != trace_cache._key(export_view(dataclasses.replace(cfg, rope_theta=500.0), torch.float32),
                                   "decode", dims)
    assert key != trace_cache._key(view, "decode", dataclasses.replace(dims, variant=Variant(opset=18)))
    # the token ids generation stops at, starts with and pads with reach no graph: not in the key
    tokens = dataclasses.replace(cfg, eos_token_ids=[0, 7], bos_token_id=3, pad_token_id=5)
    assert key == trace_cache._key(export_view(tokens, torch.float32), "decode", dims)

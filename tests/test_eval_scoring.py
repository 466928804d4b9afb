"""tk eval --score second-half scores what llama.cpp's llama-perplexity scores (tools/perplexity/
perplexity.cpp, --ppl-stride 0: full chunks of n_ctx, `first = n_ctx/2`, the predictions of tokens
first+1 .. n_ctx-1, the chunk's first token replaced by BOS when the vocabulary adds one): checked
against a hand computation from the reference logits of those positions."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tk.toolkit.backends import open_runtime, reference_runtime
from tk.toolkit.textgen import Tokenizer
from tk.toolkit.verify.perplexity import evaluate, log_softmax, window_logits

from clitools import error_line, run

TEXT = "Once upon a time there was a small model that liked to count sheep and stars. " * 6 + "The end."


@pytest.fixture(scope="module")
def int8_artifact(tiny, tmp_path_factory):
    """The tiny preset with int8 weights: its torch row is measurably far from the full-precision baseline."""
    from tk.toolkit.pipeline.export import export_artifact

    out = tmp_path_factory.mktemp("int8") / "artifact"
    export_artifact(tiny, out, weights="int8", validate=False)
    return out


def hand_scores(art, text: str, window: int, bos: int | None = None) -> dict:
    """NLL of the torch row, and KL (full precision || torch) and top-1 agreement, over positions
    window//2 .. window-2 of each full window, from each model's logits of those windows."""
    from tk.models.spec.manifest import Manifest

    ids = Tokenizer(art).encode(text)
    chunks = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    first = window // 2
    nll, kls, agree = [], [], []
    with open_runtime(art, "torch") as model, reference_runtime(art, Manifest.read(art), quantized=False) as ref:
        for chunk in chunks:
            run_ids = chunk if bos is None else [bos, *chunk[1:]]
            lp, rp = (log_softmax(window_logits(rt, run_ids)) for rt in (model, ref))
            for j in range(first, window - 1):  # position j predicts token j + 1
                nll.append(-lp[j, chunk[j + 1]])
                kls.append(max(0.0, float((np.exp(rp[j]) * (rp[j] - lp[j])).sum())))
                agree.append(rp[j].argmax() == lp[j].argmax())
    return {"tokens": len(nll), "nll": float(np.mean(nll)), "kl_mean": float(np.mean(kls)),
            "kl_p99": float(np.percentile(kls, 99)), "top1_agreement": float(np.mean(agree)), "windows": len(chunks)}


@pytest.mark.parametrize("window", [32, 33])
def test_second_half_scores_llama_perplexitys_positions(int8_artifact, window):
    result = evaluate(int8_artifact, TEXT, ["torch"], window=window, score="second-half")
    want = hand_scores(int8_artifact, TEXT, window)
    row = result["backends"]["torch"]
    n_ids = result["text_tokens"]
    assert want["windows"] == n_ids // window >= 2 and n_ids % window  # a shorter tail, dropped
    assert row["tokens"] == want["tokens"] == want["windows"] * (window - 1 - window // 2)
    assert row["nll"] == pytest.approx(want["nll"], rel=1e-6)
    assert row["perplexity"] == pytest.approx(np.exp(want["nll"]), rel=1e-6)
    for key in ("kl_mean", "kl_p99", "top1_agreement"):
        assert row[key] == pytest.approx(want[key], rel=1e-5), key
    assert want["kl_mean"] > 1e-4 and not result["bos_first"]  # int8 is measurably off; this tokenizer adds no BOS


def test_all_is_still_every_position(int8_artifact):
    result = evaluate(int8_artifact, TEXT, ["torch"], window=32)
    n = result["text_tokens"]
    assert result["score"] == "all" and result["backends"]["torch"]["tokens"] == n - -(-n // 32)  # S - 1 a window


def test_second_half_puts_the_bos_first_where_the_tokenizer_adds_one(tiny_artifact, tmp_path):
    """As llama.cpp does with add_bos: each window's first token becomes the BOS (context only: never scored)."""
    art = tmp_path / "bos"
    shutil.copytree(tiny_artifact, art)
    tok = json.loads((art / "tokenizer.json").read_text())
    bos = {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
    tok["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos["id"], "type_id": 0}},
                                                                      {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {bos["id"]: bos}}
    (art / "tokenizer.json").write_text(json.dumps(tok))
    assert Tokenizer(art).encode("a")[0] == 0
    result = evaluate(art, TEXT, ["torch"], window=32, score="second-half", baseline=False)
    want, unreplaced = hand_scores(art, TEXT, 32, bos=0), hand_scores(art, TEXT, 32)
    assert result["bos_first"] and result["backends"]["torch"]["nll"] == pytest.approx(want["nll"], rel=1e-6)
    assert want["nll"] != pytest.approx(unreplaced["nll"], rel=1e-6)  # the replacement changed the context


def test_the_cli_option(int8_artifact, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = run("eval", int8_artifact, "--text", text, "--window", "32", "--score", "second-half", "--json",
                 "--backends", "ort")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert rows["score"] == "second-half" and rows["backends"]["ort"]["tokens"] == rows["text_tokens"] // 32 * 15
    assert "window/2+1 .. window-1" in " ".join(run("eval", "--help").output.split())
    short = tmp_path / "s.txt"
    short.write_text("Once upon a time")
    result = run("eval", int8_artifact, "--text", short, "--window", "32", "--score", "second-half")
    assert error_line(result).endswith("--score second-half needs a full window of 32")

"""Speculative decoding end to end: a verify run's logits are the plain steps' logits, a rewound row
attends to nothing it did not keep, and greedy output with prompt lookup or a draft artifact is the
plain greedy output token for token, on ONNX Runtime (fused and portable graphs) and torch, through
`tk generate`; a sliding-window model's rings stay right through rejections across its window.
(The acceptance rule's statistics: tests/test_speculative_rule.py.)"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from clitools import error_line, ort_options_seen, run
from conftest import assert_close
from hf_models import make_checkpoint
from tk.models.spec.manifest import Manifest
from tk.runtimes.backends.ort import OrtRuntime
from tk.runtimes.backends.ort_probes import one_row_apart
from tk.runtimes.decoding.generate import generate
from tk.runtimes.decoding.speculative import DraftModel, PromptLookup, Speculation
from tk.runtimes.slots import Slots
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.pipeline.export import export_artifact

CAPACITY = 256


def _copy_checkpoint(src: Path, dst: Path, change) -> Path:
    """A checkpoint folder like `src` (config, tokenizer) whose weights are change(name, tensor) (None: dropped)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = {n: t for n, t in ((n, change(n, t)) for n, t in load_file(src / "model.safetensors").items())
               if t is not None}
    save_file(weights, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target (llama, 2 layers), a perturbed copy of it and a one-layer draft, all sharing its
    tokenizer; each exported --for ort-cpu (the target also --for serve: the portable static graph)."""
    root = tmp_path_factory.mktemp("spec")
    target = make_checkpoint("llama", root / "target")
    gen = torch.Generator().manual_seed(7)
    perturbed = _copy_checkpoint(target, root / "perturbed",
                                 lambda n, t: t + 0.08 * t.std() * torch.randn(t.shape, generator=gen))
    small = _copy_checkpoint(target, root / "small", lambda n, t: None if ".layers.1." in n else t)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    out = {}
    for name, ckpt, profile in [("fused", target, "ort-cpu"), ("portable", target, "serve"),
                                ("perturbed", perturbed, "ort-cpu"), ("small", small, "ort-cpu")]:
        out[name] = root / f"art-{name}"
        export_artifact(ckpt, out[name], profile=profile, max_seq_len=CAPACITY, validate=False)  # (parity: elsewhere)
    return out


def _prompts(vocab: int = 384) -> list[list[int]]:
    """Two rows: one that repeats itself (prompt lookup finds it), one that does not."""
    rng = np.random.default_rng(3)
    text = rng.integers(2, vocab, 24).tolist()
    return [text + text[:12], rng.integers(2, vocab, 19).tolist()]


@pytest.mark.parametrize("graphs", ["fused", "portable"])
def test_a_verify_run_is_the_plain_steps_and_a_rewound_row_forgets(models, graphs):
    """verify([t, g1, g2, g3]) gives the logits of four plain steps fed t, g1, g2, g3; rewound to keep t
    and g1, the row's next step is the plain run's after t, g1 (what g2, g3 wrote is never attended)."""
    rt = OrtRuntime(models[graphs]).activate()
    prompt, feed, other = _prompts()[0], [11, 23, 35, 47], 99
    _, plain = rt.start(np.array([prompt]), np.ones((1, len(prompt)), np.int64))
    steps = [rt.step(plain, [t]).logits[0, -1] for t in feed[:2]]
    after = rt.step(plain, [other]).logits[0, -1]
    steps += [rt.step(plain, [t]).logits[0, -1] for t in feed[2:]]  # (past `other`: compared below only up to g1)
    _, spec = rt.start(np.array([prompt]), np.ones((1, len(prompt)), np.int64))
    logits = rt.verify(spec, np.array([feed]))
    assert logits.shape == (1, 4, rt.dims.vocab_size)
    assert_close(logits[0, :2], np.stack(steps[:2]), 1e-4, "verify vs steps")
    assert np.abs(logits[0, :2]).max() > 1.0  # logits that say something
    rt.rewind(spec, [len(prompt) + 2])
    assert int(spec.static.write[0]) == len(prompt) + 2
    assert_close(rt.step(spec, [other]).logits[0, -1], after, 1e-4, "the step after a rewind")


def _as_multi_head(src: Path, dst: Path) -> Path:
    """The GQA checkpoint `src` as multi-head attention computing the same: each kv head's rows repeated for
    the query heads that share it."""
    cfg = json.loads((src / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rep = heads // kv

    def repeated(name, t):
        if not any(f"self_attn.{p}_proj." in name for p in "kv"):
            return t
        return t.reshape(kv, -1, *t.shape[1:]).repeat_interleave(rep, dim=0).reshape(-1, *t.shape[1:])

    _copy_checkpoint(src, dst, repeated)
    (dst / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": heads}))
    return dst


@pytest.fixture(scope="module")
def exact(models, tmp_path_factory):
    """The target (GQA) --for serve (fp32) and --for serve --weights int4 (int8 compute), as tk exports them
    (pad_queries); and the target as multi-head attention, fp32, as tk exports it and as it would be without
    padding its queries (the control: its attention has no stacked heads to give a GEMM several rows)."""
    from tk.models.spec.options import ExportOptions

    root, target = tmp_path_factory.mktemp("exact"), models["portable"].parent / "target"
    mha = _as_multi_head(target, root / "mha-checkpoint")
    out = {}
    for name, ckpt, weights, pad in (("fp32", target, "fp32", True), ("int4", target, "int4", True),
                                     ("mha", mha, "fp32", True), ("mha-bare", mha, "fp32", False)):
        options = ExportOptions.from_flags(profile="serve", max_seq_len=CAPACITY, validate=False,
                                           weights=None if weights == "fp32" else weights)
        assert options.variant.pad_queries and not ExportOptions.from_flags(profile="ort-cpu").variant.pad_queries
        if not pad:
            options = dataclasses.replace(options, variant=dataclasses.replace(options.variant, pad_queries=False))
        out[name] = root / name
        export_artifact(ckpt, out[name], options)
    return out


def _opened(art: Path, pair: bool, lone: list[int]) -> OrtRuntime:
    """The artifact on ONNX Runtime as a server opens it, runs of one position `paired` where this CPU
    needs it (or, with `pair`, everywhere); each decode run's smallest GEMM (its positions; its rows
    through the head: rows x kept logits) appended to `lone` where it is one row."""
    rt = OrtRuntime(art, prefill_via="decode", prepack=True).activate()  # (as runs are: for_runs)
    rt.lone_row_apart |= pair
    run = rt.run

    def counted(graph, feeds, *args, **kwargs):
        ids, keep = feeds["input_ids"], feeds.get("logits_to_keep")
        if min(ids.size, ids.shape[0] * (1 if keep is None else keep.size)) == 1:
            lone.append(ids.size)
        return run(graph, feeds, *args, **kwargs)

    rt.run = counted
    return rt


def _ways_of_one_row(art: Path, prompt: list[int], other: list[int], n: int = 6, pair: bool = False,
                     lone: list[int] | None = None) -> dict[str, float]:
    """A row's logits computed each way a server or `tk generate` computes them, against the row prefilled alone
    in one run and decoded a token a step in a server's slot: the largest |difference| of its prompt's last
    logits grouped with another prompt (a server's first chunks in one run, right-padded), in two chunks, in
    chunks whose last has one token and in `tk generate`'s left-padded batch; of its steps' logits in one
    verify run and in `tk generate`'s session of one row. Runs of one position go to `lone` (`_opened`)."""
    lone = [] if lone is None else lone
    with _opened(art, pair, lone) as rt, Slots(rt, 3) as slots:
        alone = np.array(slots.admit(0, prompt).logits[0, -1])
        steps, token = [], int(alone.argmax())
        feed = [token]
        for _ in range(n):
            steps.append(np.array(slots.step(np.array([token]), [0]).logits[0, -1]))
            token = int(steps[-1].argmax())
            feed.append(token)
        ids = [np.array([slots.begin(1, prompt)[0]]), np.array([slots.begin(2, other)[0]])]
        grouped = slots.prefill_first([1, 2], ids, [len(prompt), len(other)])[0]
        run = slots.verify(1, feed[:n])
        chunks = {}
        for cut in (7, len(prompt) - 1):
            slots.free(2)
            whole = slots.begin(2, prompt)
            slots.prefill(2, whole, 0, cut)
            chunks[cut] = np.array(slots.prefill(2, whole, cut, len(prompt)).logits[0, -1])
    with _opened(art, pair, lone) as rt:  # tk generate: a left-padded batch, and a row alone
        T = max(len(prompt), len(other))
        ids, mask = np.zeros((2, T), np.int64), np.zeros((2, T), np.int64)
        ids[0, T - len(prompt):], mask[0, T - len(prompt):], ids[1, T - len(other):], mask[1, T - len(other):] = \
            prompt, 1, other, 1
        out, session = rt.start(ids, mask)
        batch = np.array(out.logits[0, -1])
        session.close()
        _, session = rt.start(np.array([prompt]), np.ones((1, len(prompt)), np.int64))
        generated = np.stack([np.array(rt.step(session, [t]).logits[0, -1]) for t in feed[:n]])
        session.close()
    assert np.abs(alone).max() > 1.0
    return {"grouped": float(np.abs(grouped - alone).max()), "chunks": float(np.abs(chunks[7] - alone).max()),
            "last chunk of one": float(np.abs(chunks[len(prompt) - 1] - alone).max()),
            "batch": float(np.abs(batch - alone).max()), "verify": float(np.abs(run - np.stack(steps)).max()),
            "generate": float(np.abs(generated - np.stack(steps)).max())}


@pytest.mark.parametrize("weights", ["fp32", "int4", "int4-paired", "mha"])
def test_padded_queries_compute_a_row_bit_for_bit_alike_alone_grouped_chunked_and_verified(exact, weights):
    """ONNX Runtime's CPU GEMM sums a lone row in a kernel of its own, so a one-token step's attention and a
    verify run's differ in the last bits, which int8 compute rounds into logits far apart (README "Speculative
    decoding"). In the standard graphs no attention GEMM has one row: GQA's query heads are stacked per kv head
    (`attention.attend`), and multi-head attention ("mha") takes a query more (Variant.pad_queries); prompts go
    through the decode graph. A row's logits are then the same bits however its prompt came in and whether its
    tokens were verified or stepped, so speculation and batching change no greedy token, even at a near-tie.
    On a CPU without VNNI MatMulNBits (4-bit, int8 compute) sums a lone row apart too: there no run of one
    position reaches the graph (Runs.paired); "int4-paired" runs so on any CPU, and computes the same bits."""
    if weights == "int4-paired" and one_row_apart():
        pytest.skip("needs a CPU with VNNI or AMX, where int4 runs unpaired: here the int4 case runs paired already")
    prompt, other = _prompts()[0], _prompts()[1] + _prompts()[0][:9]
    art = exact[weights.split("-")[0]]
    assert Manifest.read(art).variant.pad_queries and not Manifest.read(exact["mha-bare"]).variant.pad_queries
    with OrtRuntime(art) as rt:
        assert rt.prefill_via == "decode" and set(rt.sessions) == {"decode"}  # one session holds the weights
        assert rt.lone_row_apart == (weights.startswith("int4") and one_row_apart())
    if weights != "int4-paired":
        assert "bit for bit as its steps" in run("inspect", art).stdout
    lone: list[int] = []
    ways = _ways_of_one_row(art, prompt, other, pair=weights == "int4-paired", lone=lone)
    assert ways == dict.fromkeys(ways, 0.0), ways
    if weights == "int4-paired" or (weights == "int4" and one_row_apart()):
        assert lone == []  # not a step, a prompt's last run nor the one-token chunk went as one position
    else:
        assert lone  # (the count sees them where they run: a row alone's steps)
    if weights == "mha":  # the control: a one-row attention GEMM is what padding takes away
        assert "bit for bit" not in run("inspect", exact["mha-bare"]).stdout
        assert _ways_of_one_row(exact["mha-bare"], prompt, other)["verify"] > 0.0


@pytest.mark.parametrize("graphs,proposer", [("fused", "lookup"), ("fused", "self"), ("fused", "perturbed"),
                                             ("fused", "small"), ("portable", "lookup"), ("portable", "self")])
def test_greedy_speculation_is_the_plain_output(models, graphs, proposer):
    rt = OrtRuntime(models[graphs]).activate()
    prompts = _prompts()
    plain = generate(rt, prompts, 40, ignore_eos=True)
    draft = None if proposer == "lookup" else OrtRuntime(models["fused" if proposer == "self" else proposer])
    chosen = PromptLookup(2, 4) if draft is None else DraftModel(draft, rt.dims.vocab_size, p_min=0)
    spec = generate(rt, prompts, 40, ignore_eos=True, speculation=Speculation(chosen, 4 if draft else 6))
    assert [r.tokens for r in spec.rows] == [r.tokens for r in plain.rows]
    s = spec.speculation
    assert s.proposed > 0 and s.steps < 40
    if proposer == "self":  # the target as its own draft: every guess is the target's
        assert s.accepted == s.proposed
    if proposer == "perturbed":
        assert 0 < s.accepted < s.proposed


def test_torch_verifies_over_the_static_cache(models):
    """The reference decoder over the artifact's static cache (every position computed) verifies too."""
    rt = open_runtime(models["fused"], "torch", BackendOptions(device="cpu", static_cache=True)).activate()
    prompts = _prompts()[:1]
    plain = generate(rt, prompts, 16, ignore_eos=True)
    spec = generate(rt, prompts, 16, ignore_eos=True, speculation=Speculation(PromptLookup(1, 3), 4))
    assert spec.rows[0].tokens == plain.rows[0].tokens and spec.speculation.proposed > 0


def test_a_sliding_window_ring_survives_rejections(tmp_path):
    """Mistral with a window of 12 and a ring of 12 + 127 slots: 150 new tokens wrap the ring while
    most guesses (1-grams of a random model's text) are rejected; the tokens are the plain run's."""
    ckpt = make_checkpoint("mistral", tmp_path / "mistral")
    art = tmp_path / "art"
    manifest = export_artifact(ckpt, art, profile="ort-cpu", max_seq_len=256, validate=False)
    assert manifest.dims.ring is not None and manifest.dims.keeps_logits
    rt = OrtRuntime(art).activate()
    prompts = [_prompts()[1]]
    plain = generate(rt, prompts, 150, ignore_eos=True)
    spec = generate(rt, prompts, 150, ignore_eos=True, speculation=Speculation(PromptLookup(1, 2), 5))
    assert spec.rows[0].tokens == plain.rows[0].tokens
    assert 0 < spec.speculation.accepted < spec.speculation.proposed  # rejections happened, across the window


def test_cli_generate_speculates_and_refuses_clearly(models, tiny_artifact, tmp_path):
    ids = ",".join(map(str, _prompts()[0]))
    base = ["generate", models["fused"], "--prompt-ids", ids, "--max-new-tokens", "24", "--ignore-eos", "--json"]
    plain = json.loads(run(*base).stdout)
    lookup = ["--lookup", "--lookup-min", "1"]  # a random model's text repeats single tokens, not n-grams
    for extra in (lookup, ["--draft", models["small"], "--speculate", "3", "--draft-p-min", "0"], [*lookup, "--backend", "torch"],
                  ["--draft", models["small"], "--backend", "torch", "--draft-p-min", "0"]):  # torch: the target's and the draft's reference
        result = run(*base, *extra)
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["rows"][0]["tokens"] == plain["rows"][0]["tokens"]
        assert out["timings"]["speculation"]["proposed"] > 0
    # a draft of another tokenizer: one line
    other = tmp_path / "other"
    shutil.copytree(models["small"], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "#"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    result = run(*base, "--draft", other)
    assert result.exit_code == 1
    assert "another tokenizer than the target" in error_line(result)
    result = run(*base, "--lookup", "--speculate", str(CAPACITY + 1))
    assert result.exit_code == 2 and "verifies at most" in error_line(result)
    result = run(*base, "--speculate", "3")
    assert result.exit_code == 2 and "needs a proposer" in error_line(result)
    # an artifact whose decode graph takes one token a step (the default export) cannot verify
    result = run("generate", tiny_artifact, "--prompt-ids", ids, "--lookup")
    assert result.exit_code == 1 and "static-capacity decode graph" in error_line(result)


def test_speculation_prepacks_the_weights_unless_declined(models, monkeypatch):
    """A verify run is a MatMul of several rows, which ONNX Runtime runs over unpacked float weights
    by packing them again every run: tk generate --lookup / --draft and tk bench --workloads prepack
    the target's and the draft's weights unless told --no-prepack; plain generation keeps the one
    memory-mapped copy."""
    seen = ort_options_seen(monkeypatch, "prepack")
    ids = ",".join(map(str, _prompts()[0]))
    base = ["generate", models["fused"], "--prompt-ids", ids, "--max-new-tokens", "4", "--json"]
    for extra, expected in [([], [False]), (["--lookup"], [True]), (["--draft", models["small"]], [True, True]),
                            (["--draft", models["small"], "--no-prepack"], [False, False]),
                            (["--prepack"], [True])]:
        seen.clear()
        result = run(*base, *extra)
        assert result.exit_code == 0, result.output
        assert seen == expected, extra
    seen.clear()
    result = run("bench", models["fused"], "--workloads", "free", "--new-tokens", "4", "--repeats", "1")
    assert result.exit_code == 0, result.output
    assert seen and all(seen)


def test_tk_bench_workloads_compare_plain_lookup_and_a_draft(models, tmp_path):
    """tk bench --workloads: every mode's tokens are plain's, the target as its own draft is accepted
    whole, and the report holds what the issue asks (tokens per step, acceptance, ms/token, speed-up)."""
    art = tmp_path / "no-tokenizer"  # token ids of each workload's shape (the tiny tokenizer's code-edit is 2k tokens)
    shutil.copytree(models["fused"], art, ignore=shutil.ignore_patterns("tokenizer*"))
    report = tmp_path / "bench.json"
    result = run("bench", art, "--workloads", "all", "--new-tokens", "24", "--repeats", "1", "--draft", art,
                 "--speculate", "3", "--draft-p-min", "0", "--report", report)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert list(data["workloads"]) == ["code-edit", "summary", "free"] and data["k"] == {"lookup": 3, "draft": 3}
    for w in data["workloads"].values():
        assert list(w["modes"]) == ["plain", "lookup", "draft"]
        assert all(m["same_tokens"] and m["decode_ms_per_token"]["median"] > 0 for m in w["modes"].values())
        draft = w["modes"]["draft"]
        assert draft["acceptance"] == 1.0 and draft["tokens_per_step"] > 3
    assert "code-edit  draft" in result.stdout
    result = run("bench", art, "--workloads", "code-edit", "--backends", "torch,ort")
    assert result.exit_code == 2 and "one backend" in error_line(result)
    result = run("bench", art, "--draft", art)
    assert result.exit_code == 2 and "go with --workloads" in error_line(result)


def test_a_backend_whose_rows_cannot_run_alone_refuses_in_one_line(models):
    """TensorRT's decode takes one token a row (its buffers' rows cannot run alone): it says so
    before anything loads (no GPU needed); the loop refuses it through the same line."""
    from tk.runtimes.backends.trt import TrtRuntime

    rt = TrtRuntime(models["portable"])
    assert rt.verify_problem == "the trt backend cannot run a multi-token verify step (its decode takes one token a row)"
    with pytest.raises(Exception, match="cannot run a multi-token verify step"):
        Speculation(PromptLookup(), 4).check(rt)


def test_a_draft_stops_guessing_where_it_is_unsure(models):
    """p_min (llama.cpp's --draft-p-min): a guess needs that much of the draft's own probability. The
    tiny random draft is rarely sure: 0 lets every guess through, 0.1 a few, 1 none; the tokens stay plain's."""
    rt = OrtRuntime(models["fused"]).activate()
    prompts = _prompts()[:1]
    plain = generate(rt, prompts, 24, ignore_eos=True).rows[0].tokens
    counts = {}
    for p_min in (0.0, 0.1, 1.0):
        spec = generate(rt, prompts, 24, ignore_eos=True,
                        speculation=Speculation(DraftModel(OrtRuntime(models["small"]), rt.dims.vocab_size, p_min), 4))
        assert spec.rows[0].tokens == plain
        counts[p_min] = spec.speculation.proposed
    assert counts[0.0] > counts[0.1] > counts[1.0] == 0

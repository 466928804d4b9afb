"""The generation loop and samplers on the torch and ORT backends, and `tk generate` / `tk demo`."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from tk.models.spec import contract
from tk.models.spec.manifest import Manifest
from tk.models.spec.errors import UsageProblem
from tk.runtimes.base import InputError
from tk.runtimes.decoding.generate import generate
from tk.runtimes.decoding.sampling import Sampler, SamplingConfig
from tk.toolkit.backends import open_runtime

from clitools import error_line, run

PROMPTS = [[5, 17, 99, 3], [42, 8, 300, 12, 77, 150, 9, 61, 33], [250, 251]]
BACKENDS = ["torch", "ort"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_batch_rows_equal_each_prompt_alone(tiny_artifact, backend):
    with open_runtime(tiny_artifact, backend) as rt:
        batch = generate(rt, PROMPTS, 12, ignore_eos=True)
        for prompt, row in zip(PROMPTS, batch.rows):
            assert row.tokens == generate(rt, [prompt], 12, ignore_eos=True).rows[0].tokens
    assert len({tuple(r.tokens) for r in batch.rows}) == 3


def test_seeded_sampling_is_the_same_on_torch_and_ort(tiny_artifact):
    cfg = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=7)
    out = {}
    for backend in BACKENDS:
        with open_runtime(tiny_artifact, backend) as rt:
            out[backend] = [r.tokens for r in generate(rt, PROMPTS, 16, cfg, ignore_eos=True).rows]
    assert out["torch"] == out["ort"]
    with open_runtime(tiny_artifact, "ort") as rt:
        greedy = [r.tokens for r in generate(rt, PROMPTS, 16, ignore_eos=True).rows]
        other_seed = [r.tokens for r in generate(rt, PROMPTS, 16, SamplingConfig(0.8, 40, 0.9, 1.2, seed=8),
                                                 ignore_eos=True).rows]
    assert out["ort"] != greedy and out["ort"] != other_seed


def test_sampler_rules():
    logits = np.array([[1.0, 3.0, 2.0, 2.9, -1.0]], dtype=np.float32)
    assert Sampler(SamplingConfig())(logits).tolist() == [1]
    draws = {int(Sampler(SamplingConfig(temperature=1.0, top_k=2, seed=s))(logits)[0]) for s in range(50)}
    assert draws == {1, 3}
    assert {int(Sampler(SamplingConfig(temperature=5.0, top_p=0.01, seed=s))(logits)[0]) for s in range(20)} == {1}
    # repetition penalty: 3.0 / 2 = 1.5 falls below 2.9 (token 3), so greedy moves off a seen token
    seen = np.array([[False, True, False, False, False]])
    assert Sampler(SamplingConfig(repetition_penalty=2.0))(logits, seen).tolist() == [3]
    a = [Sampler(SamplingConfig(temperature=1.0, seed=3))(np.repeat(logits, 4, 0)).tolist() for _ in range(2)]
    assert a[0] == a[1]
    with pytest.raises(UsageProblem, match="top_p must be in"):
        SamplingConfig(top_p=0)


def test_eos_max_tokens_and_stop(tiny_artifact):
    with open_runtime(tiny_artifact, "ort") as rt:
        free = generate(rt, [PROMPTS[1]], 10, ignore_eos=True).rows[0]
        assert len(free.tokens) == 10 and free.finish_reason == "length"
        eos = free.tokens[4]
        stopped = generate(rt, [PROMPTS[1]], 10, eos_ids=[eos]).rows[0]
        assert stopped.tokens == free.tokens[: free.tokens.index(eos)] and stopped.finish_reason == "eos"
        cut = generate(rt, [PROMPTS[1]], 10, ignore_eos=True, stop=lambda row, toks: len(toks) == 3).rows[0]
        assert cut.tokens == free.tokens[:3] and cut.finish_reason == "stop"


def test_context_guard(tiny_artifact):
    with open_runtime(tiny_artifact, "ort") as rt:
        with pytest.raises(InputError, match="a prompt of 9 tokens plus 1016 new tokens exceeds the model's context of 1024"):
            generate(rt, PROMPTS, 1016)
        generate(rt, PROMPTS, 1015 - 1000)  # inside the context: fine


def test_runtime_checks_inputs_against_contract(tiny_artifact):
    rt = open_runtime(tiny_artifact, "ort")
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    with pytest.raises(RuntimeError, match="the ort runtime is not active; use `with runtime:`"):
        rt.start(ids, np.ones((1, 3), np.int64))  # as Polygraphy's runners, an inactive runtime refuses
    with rt:
        with pytest.raises(InputError, match=r"prefill: attention_mask has shape \[1, 4\], expected"):
            rt.start(ids, np.ones((1, 4), np.int64))
        with pytest.raises(InputError, match="prefill: input_ids has dtype int32, expected int64"):
            rt.start(ids.astype(np.int32), np.ones((1, 3), np.int64))
        _, session = rt.start(ids, np.ones((1, 3), np.int64))
        with pytest.raises(InputError, match="decode: 2 tokens for a session of 1 rows"):
            rt.step(session, [4, 5])
        with pytest.raises(InputError, match=r"token id 512 is outside the vocabulary \(0..511\)"):
            rt.step(session, [512])


def test_cli_generate_json_and_stream_agree(tiny_artifact):
    result = run("generate", tiny_artifact, "--prompt", "Once upon a time", "--max-new-tokens", "12",
                 "--ignore-eos", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    row = data["rows"][0]
    assert len(row["tokens"]) == 12 and row["finish_reason"] == "length"
    assert set(data["timings"]) == {"ttft_ms", "decode_ms_per_token", "tokens_per_s", "decode_steps"}
    streamed = run("generate", tiny_artifact, "--backend", "torch", "--prompt", "Once upon a time",
                   "--max-new-tokens", "12", "--ignore-eos")
    assert streamed.exit_code == 0
    assert streamed.stdout.rstrip("\n") == row["text"]
    assert "time to first token" in streamed.stderr


def test_cli_stop_string(tiny_artifact):
    full = json.loads(run("generate", tiny_artifact, "--prompt-ids", "5,17,99", "--max-new-tokens", "16",
                          "--ignore-eos", "--json").stdout)["rows"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    row = json.loads(run("generate", tiny_artifact, "--prompt-ids", "5,17,99", "--max-new-tokens", "16",
                         "--ignore-eos", "--stop", stop, "--json").stdout)["rows"][0]
    assert row["finish_reason"] == "stop" and row["text"] == full[: full.index(stop)]


def test_cli_generate_takes_the_request_processors(tiny_artifact):
    """tk generate runs a server request's processors through the same Row: a logit bias that forces a
    token, a penalty that moves the tokens off the greedy ones, a regular expression the text must match;
    a malformed bias and two grammars are usage errors."""
    base = ["generate", tiny_artifact, "--prompt", "Once upon a time", "--max-new-tokens", "8", "--ignore-eos",
            "--json"]
    forced = json.loads(run(*base, "--logit-bias", "7=100").stdout)["rows"][0]
    assert forced["tokens"] == [7] * 8
    plain = json.loads(run(*base).stdout)["rows"][0]["tokens"]
    penalized = json.loads(run(*base, "--frequency-penalty", "50").stdout)["rows"][0]["tokens"]
    assert penalized != plain and len(set(penalized)) == len(penalized)  # each token once: a count costs 50
    digits = json.loads(run(*base[:-2], "--regex", "[0-9]{3,5}", "--json").stdout)["rows"][0]
    assert re.fullmatch("[0-9]{3,5}", digits["text"]) and digits["finish_reason"] in ("eos", "stop")
    bad = run(*base, "--logit-bias", "seven=1")
    assert bad.exit_code == 2 and "is not ID=BIAS" in error_line(bad)
    both = run(*base, "--regex", "a", "--json-schema", __file__)
    assert both.exit_code == 2 and "give one" in error_line(both)


@pytest.fixture
def broken(tiny_artifact, tmp_path):
    def make(mutate):
        d = tmp_path / "art"
        shutil.copytree(tiny_artifact, d)
        mutate(d)
        return d
    return make


def _old_contract(d, version: int = 0):
    m = json.loads((d / contract.MANIFEST).read_text())
    m["contract_version"] = version
    (d / contract.MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("mutate, args, expected", [
    (None, ["--backend", "onnx", "--prompt", "hi"], "Error: Invalid value for '--backend'"),
    (lambda d: (d / "decode.onnx").unlink(), ["--prompt", "hi"], "Error: {d} is missing decode.onnx; re-export the artifact"),
    (lambda d: (d / "manifest.json").unlink(), ["--prompt", "hi"],
     "Error: {d} has no manifest.json; it is not a tk artifact (tk export makes one)"),
    (_old_contract, ["--prompt", "hi"], "Error: artifact has graph contract version 0, this tk reads version 7; "
     "re-export it with this version of tk (tk export)"),
    (None, ["--prompt-ids", "1,2,999"], "Error: token id 999 is outside the vocabulary (0..511)"),
    (None, ["--prompt", ""], "Error: empty prompt: give at least one token per prompt"),
    (None, ["--prompt-ids", "1,x"], "Error: --prompt-ids takes comma-separated integers, got '1,x'"),
    (None, [], "Error: give one of --prompt, --prompt-ids or --chat"),
])
def test_cli_generate_bad_input(broken, mutate, args, expected):
    d = broken(mutate or (lambda d: None))
    result = run("generate", d, *args)
    assert result.exit_code in (1, 2)
    assert error_line(result).startswith(expected.format(d=d))


def test_no_new_tokens_is_a_usage_error(tiny_artifact):
    result = run("generate", tiny_artifact, "--prompt", "hi", "--max-new-tokens", "0")
    assert result.exit_code == 2
    assert error_line(result) == "Error: Invalid value for '--max-new-tokens': 0 is not in the range x>=1."


@pytest.mark.parametrize("version", [2, 3, 4, 5])
def test_an_artifact_of_an_older_contract_still_runs(broken, version):
    """Contract version 3 added rings to static caches, 4 narrow masks, 5 logits_to_keep, 6 recurrent
    state: an artifact of an earlier version (which has none of the later ones) is one of version 6 without them."""
    d = broken(lambda d: _old_contract(d, version=version))
    result = run("generate", d, "--prompt-ids", "1,2,3", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output


def test_a_version_2_static_cache_has_no_rings(tiny_artifact):
    """A version-2 static export of a sliding-window model kept full buffers: read as such, not as rings."""
    raw = json.loads((tiny_artifact / contract.MANIFEST).read_text())
    raw["config"]["sliding_window"] = 8
    raw["variant"].update(cache="static", capacity=64)
    assert Manifest.from_dict({**raw, "contract_version": 3}).dims.ring == (8, 8)
    assert Manifest.from_dict({**raw, "contract_version": 2}).dims.ring is None


def test_demo_runs_the_whole_path():
    # the tiny preset: the path is the default's, without its training (test_quantized's `trained` fixture
    # writes that preset), and its graphs are the trace cache's (.ci/run): a minute less on 2 cores
    result = run("demo", "--preset", "tiny", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    assert "tokens identical on torch and ORT: yes" in result.output
    assert "validate ORT vs torch float32 (8 decode steps): passed" in result.output


@pytest.mark.slow
def test_example_script_exports_and_generates(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "examples/export_and_generate.py", "--out", str(tmp_path / "art")],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("torch", "ort"))]
    assert len(lines) == 2 and lines[0].split("tokens ")[-1] == lines[1].split("tokens ")[-1]
    assert (tmp_path / "art" / "manifest.json").is_file()


def test_debug_flag_shows_the_traceback(tmp_path):
    plain = run("inspect", tmp_path / "nope")
    assert plain.exit_code == 1 and "Traceback" not in plain.output
    debug = run("--debug", "inspect", tmp_path / "nope")
    assert debug.exit_code == 1 and type(debug.exception).__name__ == "CheckpointError"


def test_torch_backend_cuda_without_a_gpu(tiny_artifact):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device; the test covers machines without one")
    result = run("generate", tiny_artifact, "--backend", "torch", "--device", "cuda", "--prompt-ids", "1,2")
    assert result.exit_code == 1
    assert error_line(result) == ("Error: the torch backend was asked for CUDA but torch sees no CUDA device; "
                                  "use --device cpu or install a CUDA build of torch on a GPU machine")


def test_text_stream_is_incremental_and_cuts_at_stop_strings(tiny_artifact):
    """Each token decodes a short window: a row of n tokens costs O(n) decoded tokens, not O(n^2)."""
    from tk.toolkit.textgen import TextStream, Tokenizer

    tok = Tokenizer(tiny_artifact)
    ids = tok.encode("Once upon a time there was a small model that wanted to run everywhere: on a laptop, "
                     "on a server, on a GPU. Numbers: 3.14159 2.71828. Once upon a time.")
    decoded = []
    real = tok._decode
    tok._decode = lambda t, skip: decoded.append(len(t)) or real(t, skip)
    stream = TextStream(tok)
    shown = "".join(stream.add(t) for t in ids) + stream.finish()
    assert shown == stream.text == real(ids, True)
    assert sum(decoded) < 8 * len(ids)  # the whole text so far, every token, would be ~len(ids)^2 / 2
    for stop in ("wanted", "laptop, on", "GPU."):  # stop strings that span tokens
        s = TextStream(tok, [stop])
        pieces = []
        for t in ids:
            pieces.append(s.add(t))
            if s.stopped:
                break
        pieces.append(s.finish())
        assert s.stopped and "".join(pieces) == s.text == real(ids, True).split(stop)[0]


def test_ort_provider_option(tiny_artifact):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("ONNX Runtime has its CUDA provider here; the test covers machines without it")
    result = run("generate", tiny_artifact, "--provider", "cuda", "--prompt-ids", "1,2")
    assert result.exit_code == 1 and error_line(result) == (
        "Error: ONNX Runtime has no CUDA provider here; pip install onnxruntime-gpu on a machine with an NVIDIA GPU, "
        "or use --provider cpu")
    assert run("generate", tiny_artifact, "--provider", "cpu", "--prompt-ids", "1,2", "--json").exit_code == 0


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_a_finished_row_leaves_the_batch_and_the_others_are_unchanged(tiny_artifact, backend):
    """Rows that stop early stop being computed (the session keeps the rest); what the others
    generate is what they generate alone."""
    with open_runtime(tiny_artifact, backend) as rt:
        solo = [generate(rt, [p], 10, ignore_eos=True).rows[0].tokens for p in PROMPTS]
        steps = []
        original = rt.step
        rt.step = lambda session, tokens: steps.append(session.batch) or original(session, tokens)
        result = generate(rt, PROMPTS, 10, ignore_eos=True, stop=lambda row, toks: row == 0 and len(toks) == 3)
    assert result.rows[0].tokens == solo[0][:3] and result.rows[0].finish_reason == "stop"
    assert [r.tokens for r in result.rows[1:]] == solo[1:]
    assert steps[:2] == [len(PROMPTS)] * 2 and set(steps[2:]) == {len(PROMPTS) - 1}  # row 0 left after its 3rd


def test_ort_weight_modes_give_the_same_tokens(tiny_artifact):
    """Default: both sessions read the memory-mapped weights file; --prepack: each repacks its own copy;
    swap_sessions (export validation): one session at a time, the cache handed back as numpy so the
    other session's map of the weights is gone."""
    from tk.runtimes.backends.ort import OrtRuntime

    runs = {}
    for name, kw in (("shared", {}), ("prepack", {"prepack": True}), ("swap", {"swap_sessions": True})):
        with OrtRuntime(tiny_artifact, **kw) as rt:
            runs[name] = [r.tokens for r in generate(rt, PROMPTS, 8, ignore_eos=True).rows]
            if name == "swap":
                assert list(rt.sessions) == ["decode"]  # the prefill session was dropped for the decode one
    assert runs["shared"] == runs["prepack"] == runs["swap"]
    cli = run("generate", tiny_artifact, "--prepack", "--prompt-ids", "5,17,99,3", "--max-new-tokens", "8",
              "--ignore-eos", "--json")
    assert cli.exit_code == 0 and json.loads(cli.stdout)["rows"][0]["tokens"] == runs["shared"][0]

"""The tk command line: exit codes and the exact one-line errors, through click's CliRunner."""

from __future__ import annotations

import json
import shutil

import pytest

from tk.models.spec import contract

from clitools import error_line, refused_export, run


def test_version_and_help():
    assert run("--version").exit_code == 0 and "tk, version" in run("--version").output
    out = run("--help").output
    for cmd in ("export", "inspect", "generate", "demo"):
        assert cmd in out


@pytest.fixture
def bad_checkpoints(tmp_path, tiny):
    """name -> (folder, expected error line)."""
    cases = {}

    def make(name, mutate, error):
        d = tmp_path / name
        shutil.copytree(tiny, d)
        mutate(d)
        cases[name] = (d, error)

    cases["missing"] = (tmp_path / "nope", f"Error: checkpoint folder {tmp_path / 'nope'} does not exist")
    make("no-config", lambda d: (d / "config.json").unlink(),
         f"Error: {tmp_path / 'no-config'} has no config.json; point at a Hugging Face checkpoint folder")
    make("no-weights", lambda d: (d / "model.safetensors").unlink(),
         f"Error: {tmp_path / 'no-weights'} has no model.safetensors or model.safetensors.index.json")

    def arch(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["architectures"] = ["GPTNeoXForCausalLM"]
        (d / "config.json").write_text(json.dumps(cfg))
    make("unsupported", arch, "Error: architecture GPTNeoXForCausalLM is not supported; supported: LlamaForCausalLM, "
         "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, GemmaForCausalLM, "
         "Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma4ForCausalLM, "
         "Gemma4ForConditionalGeneration, GraniteForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, GptOssForCausalLM, "
         "SmolLM3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, "
         "Lfm2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM, "
         "Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM, GraniteMoeHybridForCausalLM")

    def corrupt(d):
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 3])
    make("corrupt", corrupt, f"Error: {tmp_path / 'corrupt' / 'model.safetensors'} is not a readable safetensors file "
         "(Error while deserializing header: incomplete metadata, file not fully covered); re-download or re-save it")

    def shapes(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["hidden_size"] = 96
        (d / "config.json").write_text(json.dumps(cfg))
    make("mismatch", shapes, "Error: tensor model.embed_tokens.weight has shape [512, 64] but config.json implies [512, 96]")
    return cases


@pytest.mark.parametrize("case", ["missing", "no-config", "no-weights", "unsupported", "corrupt", "mismatch"])
def test_export_bad_checkpoint(bad_checkpoints, tmp_path, case):
    folder, expected = bad_checkpoints[case]
    out = tmp_path / "out"
    result = run("export", folder, "-o", out)
    assert result.exit_code == 1
    assert error_line(result) == expected
    assert not out.exists()
    assert not any(p.name.startswith(".out.tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("args, expected", [
    (("--dtype", "fp13"), "Error: Invalid value for '--dtype': 'fp13' is not one of 'fp32', 'float32', 'fp16', "
                          "'float16', 'bf16', 'bfloat16'."),
    (("--opset", "17"), "Error: opset 17 is not supported; use 18..23 (default 23)"),
    (("--target", "trt"), "Error: Invalid value for '--target': 'trt' is not one of 'portable', 'ort'."),
    (("--for", "trt", "--target", "ort"),  # tests/test_profiles.py has every conflict
     "Error: --for trt conflicts with --target ort: the profile exports --target portable; drop one of them"),
])
def test_export_bad_options_exit_2_before_loading_weights(tiny, tmp_path, args, expected, monkeypatch):
    assert refused_export(tiny, tmp_path / "out", monkeypatch, *args) == expected


def test_demo_presets_come_from_the_table():
    from tk.models.fixtures.presets import PRESETS

    help_text = " ".join(run("demo", "--help").output.split())
    assert f"--preset [{'|'.join(PRESETS)}]" in help_text and "[default: trained]" in help_text
    result = run("demo", "--preset", "huge")
    assert result.exit_code == 2 and error_line(result).startswith("Error: Invalid value for '--preset': 'huge'")


def test_a_bug_keeps_its_traceback(tiny, tmp_path, monkeypatch):
    """A plain ValueError (a numpy broadcast, say) is not a user's error: no one-line message."""
    def bug(*a, **k):
        raise ValueError("operands could not be broadcast together")
    monkeypatch.setattr("tk.toolkit.pipeline.export.read_config", bug)
    result = run("export", tiny, "-o", tmp_path / "out", "--no-validate")
    assert result.exit_code == 1 and isinstance(result.exception, ValueError)
    assert "Error:" not in result.stderr


def test_cli_imports_neither_torch_nor_onnxruntime():
    import subprocess
    import sys

    code = ("import sys, tk.toolkit.cli.main; from click.testing import CliRunner; "
            "r = CliRunner().invoke(tk.toolkit.cli.main.main, ['--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('torch', 'onnxruntime', 'onnx', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_export_refuses_existing_out_and_unwritable_out(tiny, tmp_path):
    (tmp_path / "out").mkdir()
    result = run("export", tiny, "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert error_line(result) == f"Error: {tmp_path / 'out'} already exists; pass --force to replace it"
    (tmp_path / "file").write_text("x")
    result = run("export", tiny, "-o", tmp_path / "file" / "out")
    assert result.exit_code == 1
    assert error_line(result) == f"Error: cannot write {tmp_path / 'file' / 'out'}: {tmp_path / 'file'} is not a folder"
    result = run("export", tiny, "-o", tmp_path / "file" / "deeper" / "out")
    assert error_line(result) == (f"Error: cannot write {tmp_path / 'file' / 'deeper' / 'out'}: {tmp_path / 'file'} "
                                  "is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]


@pytest.mark.slow
def test_failed_validation_exits_3_and_leaves_nothing(tiny, tmp_path, monkeypatch):
    from tk.toolkit.pipeline import validate

    strict = validate.tolerance_for
    monkeypatch.setattr(validate, "tolerance_for", lambda *a, **k: strict(*a, **k, atol=1e-12, rtol=1e-12))
    out = tmp_path / "new" / "folders" / "out"  # missing parents are created, and removed on failure
    result = run("export", tiny, "-o", out)
    assert result.exit_code == 3
    line = error_line(result)
    # a failed export names the step, position and layer, as tk parity does
    assert line.startswith("Error: export validation failed: ort first leaves its tolerance at step 0, row 0, "
                           "position "), line
    assert "in present.0.key (layer 0) of case batch1-len7" in line
    assert "batch3-len5/9/12" in result.stderr and "FAIL" in result.stderr  # the table of what differed
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_export_creates_missing_parent_folders(tiny, tmp_path):
    out = tmp_path / "a" / "b" / "model"
    result = run("export", tiny, "-o", out, "--no-validate")
    assert result.exit_code == 0, result.output
    assert (out / "manifest.json").is_file() and sorted(p.name for p in out.parent.iterdir()) == ["model"]


def test_export_says_when_the_static_decode_graph_is_not_in_the_asked_opset(tiny, tmp_path):
    result = run("export", tiny, "-o", tmp_path / "out", "--no-validate", "--opset", "22", "--kv-cache", "static",
                 "--max-seq-len", "32")
    assert result.exit_code == 0, result.output
    assert ("  note: decode.onnx is opset 24, not --opset 22: its static cache is written with TensorScatter"
            in result.stderr.splitlines())
    assert contract.MANIFEST in {p.name for p in (tmp_path / "out").iterdir()}


@pytest.mark.slow
def test_force_replaces_and_inspect_reads_artifact(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("old")
    result = run("export", tiny, "-o", out, "--force", "--no-validate")
    assert result.exit_code == 0, result.output
    assert not (out / "stale").exists() and (out / "decode.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    info = json.loads(run("inspect", out, "--json", "--batch", "2", "--seq-len", "100").stdout)
    assert info["kind"] == "artifact" and info["graphs"]["decode"]["opset"] == 23
    assert info["graphs"]["decode"]["ops"]["Attention"] == 2
    names = [r["name"] for r in info["graphs"]["decode"]["io"]]
    assert names == ["input_ids", "attention_mask", "position_ids", *contract.past_names(2), "logits",
                     *contract.present_names(2)]
    # 2 (k, v) * 2 layers * batch 2 * 100 tokens * 2 kv heads * 16 head_dim * 4 bytes
    assert info["memory"]["kv_bytes"] == 2 * 2 * 2 * 100 * 2 * 16 * 4
    assert info["validation"] == {"skipped": True}


def test_inspect_checkpoint(tiny):
    result = run("inspect", tiny)
    assert result.exit_code == 0
    # embed + lm_head 2 * 512 * 64, final norm 64; per layer q/o 2 * 64 * 64, k/v 2 * 32 * 64,
    # gate/up/down 3 * 176 * 64, two norms 2 * 64
    params = 2 * 512 * 64 + 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64 + 2 * 64)
    assert "architecture: LlamaForCausalLM" in result.output and f"parameters: {params:,}" in result.output

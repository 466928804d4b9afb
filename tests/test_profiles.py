"""Export profiles (`tk export --for`): each is a row of models/options.PROFILES, checked with the
other flags before any work, recorded in the manifest, and `--for ort-cpu` writes the graphs of
the long flag recipe it replaces."""

from __future__ import annotations

import json

import pytest

from tk.models.spec.config import DecoderConfig
from tk.models.spec.manifest import Manifest, Precision, Source
from tk.models.spec.variant import Variant

from tk.models.spec.options import PROFILE_CAPACITY, PROFILES, ExportOptions
from tk.models.checkpoint.families import config_from_hf
from tk.models.spec.errors import UsageProblem
from tk.models.fixtures.presets import PRESETS
from tk.toolkit.tools.describe import describe_profile, matching_profiles

from clitools import refused_export, run


def config(preset: str = "tiny", **changes):
    return config_from_hf({**PRESETS[preset], **changes})


@pytest.mark.parametrize("name, target, dtype", [("ort-cpu", "ort", "float32"), ("ort-cuda", "ort", "float16"),
                                                 ("trt", "portable", "float32"), ("serve", "portable", "float32")])
def test_each_profile_is_its_row(name, target, dtype):
    options = ExportOptions.from_flags(profile=name).for_model(config())
    v = options.variant
    assert (v.target.value, v.cache.value, v.prefill_logits.value) == (target, "static", "last")
    assert v.capacity == 1024 and options.precision.activations == dtype and options.profile == name
    assert v.decode_prefills  # a run of tokens per row: one ORT session on the CPU, serving's chunks everywhere
    assert v.narrow_mask  # attention as wide as the rows need; the fused graph's first runs batched (Slots.prefill_first)
    assert v.pad_queries == (name == "serve")  # a query more where ONNX Runtime's CPU kernels verify standard graphs


def test_capacity_is_the_context_capped_and_overridable():
    long = config(max_position_embeddings=131072)
    assert ExportOptions.from_flags(profile="serve").for_model(long).variant.capacity == PROFILE_CAPACITY == 2048
    assert ExportOptions.from_flags(profile="serve", max_seq_len=8192).for_model(long).variant.capacity == 8192
    assert ExportOptions.from_flags(profile="serve").for_model(config(max_position_embeddings=256)).variant.capacity \
        == 256


def test_profiles_compose_with_precision_and_explicit_flags_alone_still_work():
    o = ExportOptions.from_flags(profile="ort-cpu", dtype="fp16", weights="int4", block_size=16).for_model(config())
    assert (o.precision.activations, o.precision.weights, o.precision.block_size) == ("float16", "int4", 16)
    same = ExportOptions.from_flags(profile="trt", target="portable", kv_cache="static", prefill_logits="last")
    assert same.variant == ExportOptions.from_flags(profile="trt").variant  # the profile's own values are fine
    plain = ExportOptions.from_flags()
    assert plain.variant == Variant() and plain.precision == Precision() and plain.profile is None
    with pytest.raises(TypeError):
        ExportOptions.from_flags("fp32")  # keywords only


def test_trt_int4_takes_a_block_tensorrt_accepts():
    def block(cfg):
        return ExportOptions.from_flags(profile="trt", weights="int4").for_model(cfg).precision.block_size

    assert block(config("trained")) == 128  # hidden 128, FFN 384
    assert block(config("trained", intermediate_size=320)) == 64  # 320 = 5 x 64
    with pytest.raises(UsageProblem, match=r"^--for trt --weights int4: blocks of 128 or 64 rows are what it takes, "
                                           r"and neither divides the K of layers\.\*\.ffn\.w_down \(intermediate_size\), "
                                           r"176; leave out --weights$"):
        block(config("tiny"))
    # without a profile the default block stays ONNX Runtime's 32
    assert ExportOptions.from_flags(weights="int4").precision.block_size == 32


@pytest.mark.parametrize("args, expected", [
    (("--for", "trt", "--target", "ort"),
     "Error: --for trt conflicts with --target ort: the profile exports --target portable; drop one of them"),
    (("--for", "serve", "--kv-cache", "dynamic"),
     "Error: --for serve conflicts with --kv-cache dynamic: the profile exports --kv-cache static; drop one of them"),
    (("--for", "ort-cpu", "--prefill-logits", "all"),
     "Error: --for ort-cpu conflicts with --prefill-logits all: the profile exports --prefill-logits last; drop one "
     "of them"),
    (("--for", "trt", "--weights", "int8"),
     "Error: --for trt conflicts with --weights int8: TensorRT documents int4 weight-only quantization (symmetric "
     "blocks of 64 or 128, no zero points) and no int8 weight-only path; drop one of them"),
    (("--for", "trt", "--weights", "int4", "--block-size", "32"),
     "Error: --for trt conflicts with --block-size 32: TensorRT documents int4 weight-only quantization (symmetric "
     "blocks of 64 or 128, no zero points) and no int8 weight-only path; drop one of them"),
    (("--for", "ort-cuda", "--dtype", "fp32"),
     "Error: --for ort-cuda conflicts with --dtype fp32: ONNX Runtime's CUDA GroupQueryAttention runs fp16 and bf16 "
     "only; drop one of them"),
    (("--for", "serve", "--debug-outputs"),
     "Error: --for serve conflicts with --debug-outputs: a debug export has the dynamic cache and the portable "
     "target; drop one of them"),
    (("--for", "serve", "--max-seq-len", "4096"), "Error: --max-seq-len (4096) is beyond the model's context of 1024"),
    (("--for", "trt", "--weights", "int4"),
     "Error: --for trt --weights int4: blocks of 128 or 64 rows are what it takes, and neither divides the K of "
     "layers.*.ffn.w_down (intermediate_size), 176; leave out --weights"),
    (("--for", "gpu"), "Error: Invalid value for '--for': 'gpu' is not one of 'ort-cpu', 'ort-cuda', 'trt', 'serve'."),
])
def test_conflicts_are_usage_errors_before_any_work(tiny, tmp_path, args, expected, monkeypatch):
    assert refused_export(tiny, tmp_path / "out", monkeypatch, *args) == expected


def test_manifest_without_profile_loads_as_none():
    config = DecoderConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)
    manifest = Manifest(config=config, precision=Precision(), variant=Variant(), graphs={}, source=Source("x", ""),
                        profile="serve")
    d = manifest.to_dict()
    assert d["profile"] == "serve" and Manifest.from_dict(d).profile == "serve"
    del d["profile"]  # written before profiles
    assert Manifest.from_dict(d).profile is None


def test_an_explicit_variant_names_the_profiles_it_equals():
    ort = ExportOptions.from_flags(target="ort", kv_cache="static", max_seq_len=64, prefill_logits="last")
    assert matching_profiles(ort.variant, ort.precision) == ["ort-cpu"]  # fp32: not what ort-cuda runs
    static = ExportOptions.from_flags(kv_cache="static", max_seq_len=64, prefill_logits="last", weights="int8")
    assert matching_profiles(static.variant, static.precision) == ["serve"]  # TensorRT has no int8 path
    int4 = ExportOptions.from_flags(kv_cache="static", max_seq_len=64, prefill_logits="last", weights="int4",
                                    block_size=128, zero_points=False)
    trt = ExportOptions.from_flags(profile="trt", weights="int4", block_size=128)
    assert matching_profiles(int4.variant, int4.precision) == ["serve"]  # its queries padded, TensorRT's not
    assert matching_profiles(trt.variant, trt.precision) == ["trt"]
    assert describe_profile(None, ["trt", "serve"]) == "none (explicit flags; the same graphs as --for trt or --for serve)"
    assert describe_profile(None, []) == "none (explicit flags)"
    assert describe_profile("trt", []) == "trt (tk export --for trt)"
    assert set(PROFILES) == {"ort-cpu", "ort-cuda", "trt", "serve"}


@pytest.mark.slow
def test_for_ort_cpu_writes_the_graphs_of_the_long_recipe(tiny, tmp_path):
    import onnx

    profiled, recipe = tmp_path / "profiled", tmp_path / "recipe"
    result = run("export", tiny, "-o", profiled, "--for", "ort-cpu", "--no-validate")
    assert result.exit_code == 0, result.output
    assert ("--for ort-cpu: ONNX Runtime on CPUs: fused kernels, in-place cache, one session; that is --target ort "
            "--kv-cache static --max-seq-len 1024 --prefill-logits last --dtype fp32") in result.stderr
    result = run("export", tiny, "-o", recipe, "--target", "ort", "--kv-cache", "static", "--max-seq-len", "1024",
                 "--prefill-logits", "last", "--no-validate")
    assert result.exit_code == 0, result.output
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (profiled, recipe))
    assert a["variant"] == b["variant"] and a["variant"]["decode_prefills"]
    assert a["precision"] == b["precision"] and a["weights"] == b["weights"]
    assert (a["profile"], b["profile"]) == ("ort-cpu", None)
    for graph in ("prefill.onnx", "decode.onnx"):
        pa, pb = (onnx.load(str(d / graph), load_external_data=False) for d in (profiled, recipe))
        assert pa.SerializeToString() == pb.SerializeToString(), graph
    assert "profile: ort-cpu (tk export --for ort-cpu)" in run("inspect", profiled).output
    assert "profile: none (explicit flags; the same graphs as --for ort-cpu)" in run("inspect", recipe).output
    bench = run("bench", recipe, "--backends", "ort", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1")
    assert bench.exit_code == 0, bench.output
    assert bench.stdout.startswith(f"{recipe}: profile none (explicit flags; the same graphs as --for ort-cpu)")

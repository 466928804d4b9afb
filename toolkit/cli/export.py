"""`tk export` and `tk build-engine`: the artifact and its TensorRT engines. Option parsing only;
tk.toolkit.pipeline does the work, and its progress goes to stderr (stdout: the folder written)."""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from tk.models.spec.manifest import DEFAULT_BLOCK, DEFAULT_METHOD, METHODS, MIXED, QUANTIZED
from tk.models.spec.variant import CacheLayout, PrefillLogits, Target

from tk.models.spec.options import PROFILE_CAPACITY, PROFILES
from tk.models.spec import contract
from tk.models.spec.dtypes import DTYPE_CHOICES
from tk.toolkit.cli.options import choices, interruptible, reporter


def _profiles_help() -> str:
    return "; ".join(f"{name}: {p.why}" for name, p in PROFILES.items())


@click.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path),
              help="Artifact folder to create (missing parents are created).")
@click.option("--for", "profile", type=click.Choice(list(PROFILES)),
              help=f"Export the variant for one deployment ({_profiles_help()}). Its static cache holds the model's "
                   f"context, at most {PROFILE_CAPACITY} positions, unless --max-seq-len says otherwise; --dtype, "
                   "--weights and --block-size compose with it.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES),
              help="Precision of the graphs' weights, activations and KV cache [default: fp32, or the profile's].")
@click.option("--opset", default=23, show_default=True, type=int, help="23 (fused Attention/RMSNorm) or 18..22.")
@click.option("--no-validate", is_flag=True, help="Skip the ORT-vs-PyTorch numeric validation.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--kv-cache", type=choices(CacheLayout),
              help="dynamic (past in, longer present out) or static (fixed capacity, updated in place) "
                   "[default: dynamic].")
@click.option("--max-seq-len", type=int, help="Capacity of a static cache (with --kv-cache static or --for).")
@click.option("--debug-outputs", is_flag=True, help="Also output every layer's hidden state (for tk parity).")
@click.option("--target", type=choices(Target),
              help="portable (standard ONNX: ONNX Runtime and TensorRT) or ort (ONNX Runtime's fused kernels: "
                   "faster on ONNX Runtime, not loadable by TensorRT) [default: portable].")
@click.option("--prefill-logits", type=choices(PrefillLogits),
              help="all (every prompt position) or last (the last position only: what generation needs, and a "
                   "faster first token) [default: all].")
@click.option("--weights", type=click.Choice(QUANTIZED),
              help="Weight-only quantization of every linear layer (activations stay in --dtype).")
@click.option("--block-size", type=int, help=f"Rows of K per scale with --weights (default {DEFAULT_BLOCK}; "
              "TensorRT takes 64 or 128, which --for trt picks).")
@click.option("--quantize-lm-head/--no-quantize-lm-head", default=True, show_default=True,
              help="Quantize the LM head too with --weights.")
@click.option("--quant-method", type=click.Choice(METHODS),
              help=f"How --weights chooses scales: rtn (round to nearest from each block's range) or search (a "
                   f"weighted scale search, llama.cpp's k-quant way) [default: {DEFAULT_METHOD}].")
@click.option("--zero-points/--symmetric", default=None,
              help="Blocks with zero points (asymmetric) or without [default: zero points; --for trt: symmetric].")
@click.option("--mixed-precision", type=click.Choice(MIXED),
              help="Keep some weights in int8 with --weights int4: lm-head (the LM head, and a tied embedding with "
                   "it), lm-head-w8a8 (7-bit, a scale a column, its input rounded to int8 a row at a time: ONNX "
                   "Runtime's integer GEMM, which runs batches of rows faster on VNNI or AMX; --for ort-cpu) or sensitive (also the "
                   "QKV and down projections of llama.cpp's Q4_K_M layers) [default: none].")
@click.option("--quantize-embedding/--no-quantize-embedding", default=None,
              help="Quantize the embedding too (a tied one is read from the LM head's table) [default: with the "
                   "LM head, unless the vocabulary is odd with int4; --for trt and GPTQ/AWQ checkpoints: no].")
@click.option("--lm-head-block-size", type=int,
              help="The LM head's (and a quantized embedding's) own block with --weights: smaller blocks for the "
                   "layer that costs most when rounded [default: --block-size].")
@click.option("--calibration", type=click.Path(path_type=Path),
              help="A text file: its activation statistics on the model weight the scale search per input channel.")
@interruptible
def export(model_dir: Path, out: Path, profile: str | None, dtype: str | None, opset: int, no_validate: bool,
           force: bool, kv_cache: str | None, max_seq_len: int | None, debug_outputs: bool, target: str | None,
           prefill_logits: str | None, weights: str | None, block_size: int | None, quantize_lm_head: bool,
           quant_method: str | None, zero_points: bool | None, mixed_precision: str | None,
           quantize_embedding: bool | None, lm_head_block_size: int | None, calibration: Path | None) -> None:
    """Export MODEL_DIR (a Hugging Face checkpoint folder) to prefill/decode ONNX graphs."""
    from tk.models.spec.options import ExportOptions

    options = ExportOptions.from_flags(  # every flag checked before any work
        profile=profile, dtype=dtype, opset=opset, kv_cache=kv_cache, max_seq_len=max_seq_len, target=target,
        prefill_logits=prefill_logits, debug_outputs=debug_outputs, validate=not no_validate, force=force,
        weights=weights, block_size=block_size, quantize_lm_head=quantize_lm_head, quant_method=quant_method,
        zero_points=zero_points, mixed_precision=mixed_precision, quantize_embedding=quantize_embedding,
        calibration=calibration, lm_head_block_size=lm_head_block_size)
    from tk.toolkit.pipeline.export import export_artifact

    click.echo(f"tk export {model_dir} -> {out}", err=True)
    manifest = export_artifact(model_dir, out, options, reporter())
    decode_opset = manifest.graphs[contract.DECODE].opset
    if click.get_current_context().get_parameter_source("opset") is ParameterSource.COMMANDLINE and decode_opset != opset:
        click.echo(f"  note: decode.onnx is opset {decode_opset}, not --opset {opset}: its static cache is written "
                   "with TensorScatter", err=True)
    v = manifest.validation
    if v is not None:
        steps = [s for c in v.comparisons for s in c["steps"]]
        flips = sum(s.get("head_flips", 0) for s in steps)
        click.echo(f"  validation passed: max |logit diff| {max(s['max_abs'] for s in steps):.3g}, at most "
                   f"{max(s['error_ratio'] for s in steps):.2g} of its bound"
                   + (f" with {flips} rounding flip(s) of the W8A8 head's input taken out" if flips else "")
                   + f"; KV cache at most {max(s['present_ratio'] for s in steps):.2g} of its bound", err=True)
    click.echo(str(out))


@click.command("build-engine")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]),
              help="Must be the graphs' dtype: engines are strongly typed, so fp16/bf16 engines come from graphs "
                   "exported with --dtype fp16/bf16 [default: the graphs' dtype].")
@click.option("--max-batch", default=1, show_default=True, type=int)
@click.option("--max-input-len", type=int, help="Longest prompt [default: half of --max-seq-len].")
@click.option("--max-seq-len", type=int, help="Prompt + generated tokens [default: the model's context, at most 2048].")
@click.option("--timing-cache", type=click.Path(dir_okay=False, path_type=Path),
              help="Load and save this cache (FILE.json records the TensorRT that wrote it; another version's "
                   "cache is ignored and replaced).")
@click.option("--workspace", type=float, metavar="GIB", help="Cap the builder's workspace [default: TensorRT's own].")
@click.option("--decomposable-attention", is_flag=True,
              help="Let TensorRT decompose Attention it has no fused kernel for (TRT_decomposable=1, set in memory; "
                   "the artifact is unchanged). Without it, a build that fails on attention is retried this way.")
@click.option("--verbose", is_flag=True, help="Show TensorRT's verbose log (the layers and tactics it chose).")
@click.option("--force", is_flag=True, help="Replace existing engines.")
@interruptible
def build_engine(artifact: Path, precision: str | None, max_batch: int, max_input_len: int | None,
                 max_seq_len: int | None, timing_cache: Path | None, workspace: float | None,
                 decomposable_attention: bool, verbose: bool, force: bool) -> None:
    """Build TensorRT engines for an exported ARTIFACT (needs TensorRT and an NVIDIA GPU)."""
    from tk.toolkit.pipeline.build_engine import build

    build(artifact, precision=precision, max_batch=max_batch, max_input_len=max_input_len, max_seq_len=max_seq_len,
          timing_cache=timing_cache, workspace=workspace, force=force, progress=reporter(),
          decomposable_attention=decomposable_attention, verbose=verbose)
    click.echo(str(artifact))

"""The `tk` command line: parse options, call library functions, format results. Nothing else.

Library code raises `TkError`s (models/errors.py), each carrying its exit code (1 error, 2 usage,
3 a check ran and failed); `TkGroup` prints their first line, once, here. Option values come
from the typed tables (dtypes, export variants, the backend registry), so a bad one is a usage
error at parse time. `--debug` shows tracebacks.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import click

from models.artifact import DEFAULT_BLOCK, QUANTIZED, CacheLayout, PrefillLogits, Target
from models.dtypes import DTYPE_CHOICES
from models.errors import CheckFailed, TkError
from toolkit.backends import BACKENDS, PROVIDERS, BackendOptions

# Only the standard library, click and tk's stdlib-only modules are imported here: `tk --help`
# and `tk generate --backend ort` never pay for torch. Each command imports what it runs.


class TkGroup(click.Group):
    """Maps a TkError to its one-line message and exit code (1 error, 2 usage, 3 a check failed).
    Anything else is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TkError as exc:
            if ctx.obj.get("debug"):
                raise
            if isinstance(exc, CheckFailed) and exc.table:
                click.echo(exc.table, err=True)
            click.echo(f"Error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", err=True)
            ctx.exit(exc.exit_code)


def _version() -> str:
    try:
        return metadata.version("tk")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class BackendName(click.ParamType):
    """A registered backend (toolkit/backends.py); read at parse time, so a registered one counts."""

    name = "backend"

    def convert(self, value, param, ctx):
        if value not in BACKENDS:
            self.fail(f"unknown backend {value!r}; use one of {', '.join(BACKENDS)}", param, ctx)
        return value


class BackendList(click.ParamType):
    """A comma-separated list of registered backends."""

    name = "backends"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        names = [b.strip() for b in value.split(",") if b.strip()]
        unknown = [b for b in names if b not in BACKENDS]
        if unknown or not names:
            self.fail(f"unknown backend {', '.join(unknown) or '(none)'}; use {', '.join(BACKENDS)}", param, ctx)
        return names


def _choices(enum) -> click.Choice:
    return click.Choice([e.value for e in enum])


def _progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


def backend_options(f=None, *, prepack: bool = False):
    """--threads, --device, --provider, --prepack: how a backend runs (BackendOptions). Serving
    prepacks by default: batched MatMuls on unpacked weights repack them every step."""
    def add(f):
        f = click.option("--prepack/--no-prepack", default=prepack, show_default=True,
                         help="ONNX Runtime: repack the weights for the CPU's kernels in each session (faster decode, "
                              "much faster batched decode; a private copy of the weights per session; without it: "
                              "one memory-mapped copy).")(f)
        f = click.option("--provider", default="auto", show_default=True, type=click.Choice(PROVIDERS),
                         help="ONNX Runtime execution provider (auto: CUDA when onnxruntime-gpu sees a GPU).")(f)
        f = click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
                         help="Device of the torch backend (auto: CUDA when present).")(f)
        return click.option("--threads", type=click.IntRange(min=1), help="ONNX Runtime intra-op threads.")(f)

    return add if f is None else add(f)


@click.group(cls=TkGroup)
@click.version_option(_version(), prog_name="tk")
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """tk: decoder-only transformers from PyTorch to ONNX Runtime and TensorRT, with parity proofs."""
    ctx.ensure_object(dict)["debug"] = debug


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path),
              help="Artifact folder to create (missing parents are created).")
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(DTYPE_CHOICES),
              help="Precision of the graphs' weights, activations and KV cache.")
@click.option("--opset", default=23, show_default=True, type=int, help="23 (fused Attention/RMSNorm) or 18..22.")
@click.option("--no-validate", is_flag=True, help="Skip the ORT-vs-PyTorch numeric validation.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--kv-cache", default="dynamic", show_default=True, type=_choices(CacheLayout),
              help="dynamic (past in, longer present out) or static (fixed capacity, updated in place).")
@click.option("--max-seq-len", type=int, help="Capacity of a static cache (with --kv-cache static).")
@click.option("--debug-outputs", is_flag=True, help="Also output every layer's hidden state (for tk parity).")
@click.option("--target", default="portable", show_default=True, type=_choices(Target),
              help="portable (standard ONNX: ONNX Runtime and TensorRT) or ort (ONNX Runtime's fused kernels: "
                   "faster on ONNX Runtime, not loadable by TensorRT).")
@click.option("--prefill-logits", default="all", show_default=True, type=_choices(PrefillLogits),
              help="all (every prompt position) or last (the last position only: what generation needs, and a "
                   "faster first token).")
@click.option("--weights", type=click.Choice(QUANTIZED),
              help="Weight-only quantization of every linear layer (activations stay in --dtype).")
@click.option("--block-size", type=int, help=f"Rows of K per scale with --weights (default {DEFAULT_BLOCK}; "
              "TensorRT takes 64 or 128).")
@click.option("--quantize-lm-head/--no-quantize-lm-head", default=True, show_default=True,
              help="Quantize the LM head too with --weights.")
def export(model_dir: Path, out: Path, dtype: str, opset: int, no_validate: bool, force: bool, kv_cache: str,
           max_seq_len: int | None, debug_outputs: bool, target: str, prefill_logits: str, weights: str | None,
           block_size: int | None, quantize_lm_head: bool) -> None:
    """Export MODEL_DIR (a Hugging Face checkpoint folder) to prefill/decode ONNX graphs."""
    from models.artifact import ExportOptions

    options = ExportOptions.from_flags(dtype, opset, kv_cache, max_seq_len, target, prefill_logits, debug_outputs,
                                       not no_validate, force, weights, block_size,
                                       quantize_lm_head)  # every flag checked before any work
    from toolkit.export import export_artifact

    click.echo(f"tk export {model_dir} -> {out}", err=True)
    manifest = export_artifact(model_dir, out, options, _progress)
    v = manifest.validation
    if not v.get("skipped"):
        steps = [s for c in v["comparisons"] for s in c["steps"]]
        click.echo(f"  validation passed: max |logit diff| {max(s['max_abs'] for s in steps):.3g}, at most "
                   f"{max(s['error_ratio'] for s in steps):.2g} of its bound; KV cache at most "
                   f"{max(s['present_ratio'] for s in steps):.2g} of its bound", err=True)
    click.echo(str(out))


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", type=click.IntRange(min=1), help="Context length for the memory plan (default: the model's).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(path: Path, batch: int, seq_len: int | None, as_json: bool) -> None:
    """Describe a checkpoint or an artifact: config, parameters, graph I/O, memory plan."""
    from toolkit.describe import format_info, inspect_path

    info = inspect_path(path, batch, seq_len)
    click.echo(json.dumps(info, indent=2) if as_json else format_info(info))


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backend", default="ort", show_default=True, type=BackendName())
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for a batch).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Comma-separated token ids (repeat for a batch).")
@click.option("--chat", help="A user message, rendered with the checkpoint's chat template; prints the reply.")
@click.option("--system", help="A system message before --chat.")
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--stop", "stops", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly --max-new-tokens.")
@backend_options
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text, finish reason and timings as JSON.")
def generate(artifact: Path, backend: str, prompts: tuple[str, ...], prompt_ids: tuple[str, ...],
             chat: str | None, system: str | None, max_new_tokens: int, temperature: float, top_k: int,
             top_p: float, repetition_penalty: float, seed: int, stops: tuple[str, ...], ignore_eos: bool,
             threads: int | None, device: str, provider: str, prepack: bool, as_json: bool) -> None:
    """Generate text from an exported ARTIFACT on one backend."""
    from models.artifact import Manifest
    from runtimes.sampling import SamplingConfig
    from toolkit.backends import open_runtime
    from toolkit.textgen import Tokenizer, generate_text, parse_ids

    if sum(map(bool, (prompts, prompt_ids, chat is not None))) != 1:
        raise click.UsageError("give one of --prompt, --prompt-ids or --chat")
    if system is not None and chat is None:
        raise click.UsageError("--system goes with --chat")
    manifest = Manifest.read(artifact)
    runtime = open_runtime(artifact, backend, BackendOptions(threads, device, provider, prepack))
    tokenizer = Tokenizer(artifact) if prompts or chat is not None else Tokenizer.find(artifact)
    if chat is not None:
        ids = [tokenizer.chat(chat, system)]
    else:
        ids = [tokenizer.encode(p) for p in prompts] if prompts else [parse_ids(p) for p in prompt_ids]
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              repetition_penalty=repetition_penalty, seed=seed)
    stream = None if as_json else lambda text: click.echo(text, nl=False)
    result, texts = generate_text(runtime, tokenizer, ids, max_new_tokens, sampling,
                                  manifest.eos_token_ids, stops, ignore_eos, stream)
    if as_json:
        rows = [{"prompt_tokens": r.prompt_tokens, "tokens": r.tokens, "text": t, "finish_reason": r.finish_reason}
                for r, t in zip(result.rows, texts)]
        click.echo(json.dumps({"backend": backend, "rows": rows, "timings": result.timings()}, indent=2))
        return
    if len(ids) > 1:
        for i, text in enumerate(texts):
            click.echo(f"[{i}] {text}")
    else:
        click.echo()
    t = result.timings()
    click.echo(f"{backend}: time to first token {t['ttft_ms']:.1f} ms, decode {t['decode_ms_per_token']:.2f} ms/token, "
               f"{t['tokens_per_s']:.1f} tokens/s, finish: {', '.join(r.finish_reason for r in result.rows)}",
               err=True)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backends", default="torch,ort", show_default=True, type=BackendList(),
              help="Comma-separated: torch, ort, trt.")
@click.option("--steps", default=16, show_default=True, type=click.IntRange(min=1), help="Decode steps after the prefill.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="One prompt per line, or a JSON list of token-id lists (default: random prompts).")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Write the JSON report here.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Plot error per step (needs matplotlib).")
@click.option("--require", "required", multiple=True, type=BackendName(),
              help="A backend whose skip is a failure (repeatable).")
@click.option("--junit", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a JUnit XML file: one test case per backend and case, and per probe.")
@click.option("--atol", type=float, help="Override the absolute floor of every bound.")
@click.option("--rtol", type=float, help="Override the relative error allowed per layer of depth.")
@click.option("--min-top1", type=float, help="Override the top-1 agreement tolerance.")
@backend_options
def parity(artifact: Path, backends: list[str], steps: int, seed: int, prompts_file: Path | None, report: Path | None,
           plot: Path | None, required: tuple[str, ...], junit: Path | None, atol: float | None, rtol: float | None,
           min_top1: float | None, threads: int | None, device: str, provider: str, prepack: bool) -> None:
    """Compare every backend with the float32 PyTorch reference, step by step; exit 3 on drift.

    A tensor that went through d layers may differ by atol + rtol * d * its own magnitude (the
    logits: per position); float32's rtol follows from the model's accumulation length."""
    from toolkit import parity_report as pr

    names = backends
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install 'tk[plot]'") from None
    result = pr.parity(artifact, names, steps, seed, prompts_file, {"atol": atol, "rtol": rtol, "min_top1": min_top1},
                       BackendOptions(threads, device, provider, prepack))
    click.echo(pr.summary(result), err=True)
    if report is not None:
        report.write_text(json.dumps(result, indent=2))
    if junit is not None:
        pr.write_junit(result, junit, required)
    if plot is not None:
        pr.plot(result, plot)
    failure = pr.verdict(result, required)
    if failure:
        raise CheckFailed(failure)
    click.echo("parity passed")


@main.command("eval")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--text", "text_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A UTF-8 text file: its perplexity is computed, teacher-forced.")
@click.option("--backends", default="torch,ort", show_default=True, type=BackendList(),
              help="Comma-separated: torch, ort, trt.")
@click.option("--window", type=click.IntRange(min=2), help="Tokens per window (default: min(1024, the context)).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="With quantized weights, also the full-precision reference.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@backend_options
def eval_(artifact: Path, text_file: Path, backends: list[str], window: int | None, baseline: bool, as_json: bool,
          threads: int | None, device: str, provider: str, prepack: bool) -> None:
    """Perplexity of a text on each backend of ARTIFACT (what quantization costs, on your text)."""
    from toolkit.evaluate import evaluate, format_eval

    result = evaluate(artifact, text_file.read_text(encoding="utf-8"), backends, window,
                      BackendOptions(threads, device, provider, prepack), baseline)
    click.echo(json.dumps(result, indent=2) if as_json else format_eval(result))


@main.command("build-engine")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), help="Default: the graphs' own dtype.")
@click.option("--max-batch", default=1, show_default=True, type=int)
@click.option("--max-input-len", type=int, help="Longest prompt [default: half of --max-seq-len].")
@click.option("--max-seq-len", type=int, help="Prompt + generated tokens [default: the model's context, at most 2048].")
@click.option("--timing-cache", type=click.Path(dir_okay=False, path_type=Path), help="Load and save this cache.")
@click.option("--workspace", default=4.0, show_default=True, type=float, help="Builder workspace, GiB.")
@click.option("--force", is_flag=True, help="Replace existing engines.")
def build_engine(artifact: Path, precision: str | None, max_batch: int, max_input_len: int | None,
                 max_seq_len: int | None,
                 timing_cache: Path | None, workspace: float, force: bool) -> None:
    """Build TensorRT engines for an exported ARTIFACT (needs TensorRT and an NVIDIA GPU)."""
    from toolkit.engines import build

    build(artifact, precision, max_batch, max_input_len, max_seq_len, timing_cache, workspace, force, _progress)
    click.echo(str(artifact))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(as_json: bool) -> None:
    """Which backends, providers, GPUs and versions this machine has."""
    from toolkit.doctor import doctor_report

    report = doctor_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for name, entry in report.items():
        state = entry["version"] if entry.get("available") else "missing"
        extra = "; ".join(f"{k}: {v}" for k, v in entry.items() if k not in ("available", "version"))
        click.echo(f"{name:12} {state:14} {extra}")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backends", default="torch,ort", show_default=True, type=BackendList(),
              help="Comma-separated: torch, ort, trt.")
@click.option("--prompt-len", default=128, show_default=True, type=int)
@click.option("--new-tokens", default=128, show_default=True, type=int)
@click.option("--batch", default=1, show_default=True, type=int)
@click.option("--repeats", default=3, show_default=True, type=int)
@backend_options
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Write the JSON report here.")
@click.option("--profile", is_flag=True, help="Also split an ORT decode step into Python, executor and kernel time.")
def bench(artifact: Path, backends: list[str], prompt_len: int, new_tokens: int, batch: int, repeats: int,
          threads: int | None, device: str, provider: str, prepack: bool, report: Path | None,
          profile: bool) -> None:
    """Time to first token, decode speed and memory of each backend, side by side in one run."""
    from toolkit.bench import bench as run_bench
    from toolkit.bench import format_bench, format_profile, profile_decode

    result = run_bench(artifact, backends, prompt_len, new_tokens, batch, repeats,
                       BackendOptions(threads, device, provider, prepack))
    click.echo(format_bench(result))
    if profile:
        result["decode_profile"] = profile_decode(artifact, prompt_len, new_tokens, threads)
        click.echo(format_profile(result["decode_profile"]))
    if report is not None:
        report.write_text(json.dumps(result, indent=2))


@main.command()
@click.option("--preset", default="tiny", show_default=True, help="Built-in model preset: tiny, small, trained-like.")
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--max-new-tokens", default=24, show_default=True, type=click.IntRange(min=1))
def demo(preset: str, prompt: str, max_new_tokens: int) -> None:
    """The whole path on a built-in tiny model: checkpoint, export, validate, generate on torch and ORT."""
    from toolkit.demo import run_demo

    run_demo(preset, prompt, max_new_tokens, echo=lambda msg: click.echo(msg))


from toolkit import cli_serving  # noqa: E402,F401  (registers tk serve and tk triton on `main`)


def entry() -> None:
    """The `tk` console script: this process is tk's own, so its ORT sessions share one thread pool."""
    from runtimes.ort_runtime import use_shared_thread_pool

    use_shared_thread_pool()
    main()


if __name__ == "__main__":
    sys.exit(entry())

"""`tk generate`, `tk eval`, `tk bench`, `tk demo`: running an artifact. Option parsing and output only;
eval's and bench's progress goes to stderr, so their stdout (--json) is the result alone."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tk.models.fixtures.presets import PRESETS
from tk.toolkit.backends import BackendOptions
from tk.toolkit.cli.options import (BackendName, WorkloadList, backend_options, backends_option, interruptible,
                                   processor_options, processors_from, reporter, speculation_from, speculation_options)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backend", default="ort", show_default=True, type=BackendName())
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for a batch).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Comma-separated token ids (repeat for a batch).")
@click.option("--chat", help="A user message, rendered with the checkpoint's chat template; prints the reply.")
@click.option("--system", help="A system message before --chat.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--stop", "stops", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly --max-new-tokens.")
@processor_options
@backend_options(prepack=None)
@speculation_options
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text, finish reason and timings as JSON.")
@click.pass_context
def generate(ctx: click.Context, artifact: Path, backend: str, prompts: tuple[str, ...], prompt_ids: tuple[str, ...],
             chat: str | None, system: str | None, max_new_tokens: int, temperature: float, top_k: int,
             top_p: float, repetition_penalty: float, seed: int, stops: tuple[str, ...], ignore_eos: bool,
             options: BackendOptions, as_json: bool) -> None:
    """Generate text from an exported ARTIFACT on one backend."""
    from tk.models.spec.manifest import Manifest
    from tk.runtimes.decoding.sampling import SamplingConfig
    from tk.toolkit.backends import open_runtime
    from tk.toolkit.speculation import open_speculation
    from tk.toolkit.textgen import Tokenizer, generate_text, parse_ids

    if sum(map(bool, (prompts, prompt_ids, chat is not None))) != 1:
        raise click.UsageError("give one of --prompt, --prompt-ids or --chat")
    if system is not None and chat is None:
        raise click.UsageError("--system goes with --chat")
    speculation = speculation_from(ctx)
    if speculation.proposer:  # verify runs: packed weights; torch: the reference over the artifact's static cache
        options = options.for_runs(backend)
    manifest = Manifest.read(artifact)
    runtime = open_runtime(artifact, backend, options)
    spec = open_speculation(artifact, runtime, speculation, backend, options)
    tokenizer = Tokenizer(artifact) if prompts or chat is not None else Tokenizer.find(artifact)
    if chat is not None:
        ids = [tokenizer.chat(chat, system)]
    else:
        ids = [tokenizer.encode(p) for p in prompts] if prompts else [parse_ids(p) for p in prompt_ids]
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              repetition_penalty=repetition_penalty, seed=seed)
    processors = processors_from(ctx, tokenizer, manifest.config.vocab_size, manifest.eos_token_ids, sampling)
    stream = None if as_json else lambda text: click.echo(text, nl=False)
    result, texts = generate_text(runtime, tokenizer, ids, max_new_tokens, sampling,
                                  manifest.eos_token_ids, stops, ignore_eos, stream, spec, processors)
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
    if "speculation" in t:
        s = t["speculation"]
        click.echo(f"speculation ({speculation.describe()}): {s['accepted']} of {s['proposed']} guesses accepted, "
                   f"{s['tokens_per_step']:.2f} tokens per target step", err=True)


@click.command("eval")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--text", "text_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A UTF-8 text file: its perplexity is computed, teacher-forced.")
@backends_option("torch,ort")
@click.option("--window", type=click.IntRange(min=2), help="Tokens per window (default: min(1024, the context)).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="With quantized weights (or fp16/bf16), also the full-precision float32 reference: the row "
                   "each backend's KL divergence and top-1 agreement are measured against.")
@click.option("--score", default="all", show_default=True, type=click.Choice(["all", "second-half"]),
              help="Which predictions count, for perplexity, KL and top-1: all (every position of each window, the "
                   "last shorter window too) or second-half (llama-perplexity's, comparable with its numbers: full "
                   "windows only, in each the predictions of tokens window/2+1 .. window-1 from positions window/2 "
                   ".. window-2, the first half context only; each window's first token replaced by the BOS where "
                   "the tokenizer adds one, as llama.cpp does).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (progress goes to stderr).")
@backend_options
@interruptible
def eval_(artifact: Path, text_file: Path, backends: list[str], window: int | None, baseline: bool, score: str,
          as_json: bool, options: BackendOptions) -> None:
    """Perplexity of a text on each backend of ARTIFACT, and each backend's KL divergence and top-1
    agreement with the full-precision model (what quantization costs, on your text)."""
    from tk.toolkit.verify.perplexity import evaluate, format_eval

    result = evaluate(artifact, text_file.read_text(encoding="utf-8"), backends, window, options, baseline, score,
                      reporter())
    click.echo(json.dumps(result, indent=2) if as_json else format_eval(result))


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@backends_option("torch,ort")
@click.option("--prompt-len", default=128, show_default=True, type=int)
@click.option("--new-tokens", default=128, show_default=True, type=int)
@click.option("--batch", default=1, show_default=True, type=int)
@click.option("--repeats", default=3, show_default=True, type=int)
@backend_options(prepack=None)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Write the JSON report here.")
@click.option("--profile", is_flag=True, help="Also split an ORT decode step into Python, executor and kernel time.")
@click.option("--workloads", type=WorkloadList(),
              help="Speculative decoding instead: plain, prompt lookup (and --draft) on these named workloads "
                   "(comma-separated: code-edit, summary, free; 'all'), on one backend (ort unless --backends names one).")
@speculation_options
@click.pass_context
@interruptible
def bench(ctx: click.Context, artifact: Path, backends: list[str], prompt_len: int, new_tokens: int, batch: int,
          repeats: int, options: BackendOptions, report: Path | None, profile: bool, workloads: list[str] | None) -> None:
    """Time to first token, decode speed and memory of each backend, side by side in one run; with
    --workloads, speculative decoding (plain, prompt lookup, and --draft) against plain decoding on
    named workloads."""
    from tk.toolkit.tools.bench import bench as run_bench
    from tk.toolkit.tools.bench import format_bench, format_profile, profile_decode

    flags = ctx.meta.get("tk.speculation", {})
    if workloads is None and (flags.get("draft") is not None or flags.get("k") is not None):
        raise click.UsageError("--draft and --speculate go with --workloads", ctx)
    # --workloads runs prompt lookup always, and the draft where one is named: the record of the draft, or of lookup
    speculation = speculation_from(ctx, lookup=flags.get("draft") is None)
    if workloads is not None:
        from tk.toolkit.tools.bench_speculative import bench_speculative, format_speculative

        given = ctx.get_parameter_source("backends") is not click.core.ParameterSource.DEFAULT
        if given and len(backends) != 1:
            raise click.UsageError("--workloads runs on one backend: give --backends NAME", ctx)
        backend = backends[0] if given else "ort"
        result = bench_speculative(artifact, backend, workloads, new_tokens, repeats, options.for_runs(backend),
                                   speculation)
        click.echo(format_speculative(result))
        if report is not None:
            report.write_text(json.dumps(result, indent=2))
        return
    progress = reporter()
    result = run_bench(artifact, backends, prompt_len, new_tokens, batch, repeats, options, progress=progress)
    click.echo(format_bench(result))
    if profile:
        progress.step("profile")
        result["decode_profile"] = profile_decode(artifact, prompt_len, new_tokens, options.threads)
        click.echo(format_profile(result["decode_profile"]))
    if report is not None:
        report.write_text(json.dumps(result, indent=2))


@click.command()
@click.option("--preset", default="trained", show_default=True, type=click.Choice(list(PRESETS)),
              help="Built-in model preset (models/fixtures/presets.py): trained is really trained, for about 10 s, so its "
                   "text reads as text; the others have seeded random weights.")
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--max-new-tokens", default=24, show_default=True, type=click.IntRange(min=1))
def demo(preset: str, prompt: str, max_new_tokens: int) -> None:
    """The whole path on a small built-in model: checkpoint, export, validate, generate on torch and ORT."""
    from tk.toolkit.tools.demo import run_demo

    run_demo(preset, prompt, max_new_tokens, echo=lambda msg: click.echo(msg))

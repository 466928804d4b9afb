"""What several `tk` commands share: typed option values (a registered backend, a list of them, an
enum's values), the --backends option and the backend options, progress on stderr (a terminal's
bars, else plain lines: tk.toolkit.progress) and SIGTERM ending long work as Ctrl-C does. Standard
library, click and tk's stdlib-only modules only."""

from __future__ import annotations

import dataclasses
import functools
import signal
import sys
import threading
from pathlib import Path

import click

from tk.toolkit.backends import BACKENDS, PROVIDERS, BackendOptions
from tk.toolkit.progress import StderrProgress


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


class WorkloadList(click.ParamType):
    """A comma-separated list of tk bench's named workloads ('all': every one)."""

    name = "workloads"

    def convert(self, value, param, ctx):
        from tk.toolkit.speculation import WORKLOADS

        if isinstance(value, list):
            return value
        names = list(WORKLOADS) if value.strip() == "all" else [w.strip() for w in value.split(",") if w.strip()]
        unknown = [w for w in names if w not in WORKLOADS]
        if unknown or not names:
            self.fail(f"unknown workload {', '.join(unknown) or '(none)'}; use {', '.join(WORKLOADS)} or all", param, ctx)
        return names


def choices(enum) -> click.Choice:
    return click.Choice([e.value for e in enum])


def progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


def reporter() -> StderrProgress:
    """What a long command shows on stderr: steps, notes and tasks (bars on a terminal, else lines)."""
    return StderrProgress(sys.stderr)  # read now: click's test runner swaps it


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that what cleans up after
    an interruption (an export's temporary folder, a child process) runs for it too; tk exits 143."""


def interruptible(f):
    """The command's work ends on SIGTERM as on Ctrl-C (Terminated, a KeyboardInterrupt); a second
    SIGTERM while it cleans up is ignored (SIGKILL still ends it). Off the main thread, as it was."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return f(*args, **kwargs)

        def terminated(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise Terminated()
        before = signal.signal(signal.SIGTERM, terminated)
        try:
            return f(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, before)

    return run


def backends_option(default: str):
    """--backends: a comma-separated list of registered backends; the help lists the registry's."""
    return click.option("--backends", default=default, show_default=True, type=BackendList(),
                        help=f"Comma-separated: {', '.join(BACKENDS)}.")


def _set_option(ctx: click.Context, param: click.Parameter, value):
    """One flag's value, set on the command's `options` (BackendOptions), which click passes in place
    of the flags. Click calls this for each of them, given or not."""
    ctx.params["options"] = dataclasses.replace(ctx.params.get("options", BackendOptions()), **{param.name: value})
    return value


def quant_compute_option(**kwargs):
    """--quant-compute int8|float: how ONNX Runtime multiplies a quantized export (BackendOptions.quant_compute)."""
    return click.option("--quant-compute", default="int8", show_default=True, type=click.Choice(["int8", "float"]),
                        help="ONNX Runtime, int4/int8 exports: int8 rounds each block of activations to int8 "
                             "(the fast path); float multiplies in float32, as the quantized reference and tk "
                             "parity do. Only float keeps a request's greedy tokens independent of the runs it "
                             "shares (batching, prompt chunks, speculation's verify runs) beyond float32's last "
                             "bits.", **kwargs)


def backend_options(f=None, *, prepack: bool | None = False, quant_compute: bool = True):
    """--threads, --device, --provider, --prepack, --quant-compute (not on tk parity, which judges a quantized
    export in float always): how a backend runs, passed to the command as one `options` (BackendOptions).
    Serving prepacks by default; `prepack=None` (the commands that speculate) leaves it to the command,
    which prepacks where it speculates (BackendOptions.for_runs): MatMuls of several rows on unpacked
    weights repack them every run."""
    def add(f):
        into_options = dict(expose_value=False, callback=_set_option)
        default = ("on when speculating (--lookup, --draft, --workloads), else off" if prepack is None
                   else "prepack" if prepack else "no-prepack")
        f = click.option("--prepack/--no-prepack", default=prepack,
                         help="ONNX Runtime: repack the weights for the CPU's kernels in each session (faster decode, "
                              "much faster batched and speculative decode; a private copy of the weights per session; "
                              f"without it: one memory-mapped copy) [default: {default}].", **into_options)(f)
        if quant_compute:
            f = quant_compute_option(**into_options)(f)
        f = click.option("--provider", default="auto", show_default=True, type=click.Choice(PROVIDERS),
                         help="ONNX Runtime execution provider (auto: CUDA when onnxruntime-gpu sees a GPU).",
                         **into_options)(f)
        f = click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
                         help="Device of the torch backend (auto: CUDA when present).", **into_options)(f)
        return click.option("--threads", type=click.IntRange(min=1), help="ONNX Runtime intra-op threads.",
                            **into_options)(f)

    return add if f is None else add(f)


def _p_min() -> float:
    """The draft's default p_min, read where it is defined (imported only when a command runs)."""
    from tk.runtimes.decoding.speculative import P_MIN

    return P_MIN


def speculation_options(f):
    """--lookup, --draft, --speculate, --lookup-min, --lookup-max: the proposer speculative decoding
    guesses with, passed to the command as one `speculation` (SpeculationOptions)."""
    def gather(ctx: click.Context, param: click.Parameter, value):
        ctx.meta.setdefault("tk.speculation", {})[param.name] = value
        return value

    into = dict(expose_value=False, callback=gather, is_eager=False)
    f = click.option("--draft-p-min", "draft_p_min", default=_p_min, show_default=True, type=click.FloatRange(0, 1),
                     help="A draft stops guessing at a token it gives less than this probability (llama.cpp's "
                          "--spec-draft-p-min; 0: never) [default: speculative decoding's P_MIN].", **into)(f)
    f = click.option("--lookup-max", "lookup_max", default=4, show_default=True, type=click.IntRange(min=1),
                     help="Prompt lookup: the longest n-gram matched.", **into)(f)
    f = click.option("--lookup-min", "lookup_min", default=2, show_default=True, type=click.IntRange(min=1),
                     help="Prompt lookup: the shortest n-gram matched.", **into)(f)
    f = click.option("--speculate", "k", type=click.IntRange(min=1),
                     help="The most guesses a step (default 16 with --lookup: a row starts at 8 and grows while its "
                          "guesses are kept; 4 with --draft).", **into)(f)
    f = click.option("--draft", type=click.Path(path_type=Path),
                     help="Speculate with this draft artifact (same tokenizer; a static cache that takes runs).",
                     **into)(f)
    return click.option("--lookup", is_flag=True,
                        help="Speculate with prompt lookup: guesses copied from the text so far (code edits, "
                             "summaries); verified in one run, the same tokens greedy.", **into)(f)


def speculation_from(ctx: click.Context, **more):
    """The SpeculationOptions the speculation flags gave, with `more` fields (a bad combination: a
    usage error, exit 2)."""
    from tk.models.spec.errors import UsageProblem
    from tk.toolkit.speculation import SpeculationOptions

    try:
        return SpeculationOptions(**{**ctx.meta.get("tk.speculation", {}), **more})
    except UsageProblem as e:
        raise click.UsageError(str(e), ctx) from None


def processor_options(f):
    """--presence-penalty, --frequency-penalty, --logit-bias, --regex, --json-schema: a row's logits
    processors, as a server's request asks for them (toolkit/serving/frontend.Params), gathered for
    `processors_from`."""
    def gather(ctx: click.Context, param: click.Parameter, value):
        ctx.meta.setdefault("tk.processors", {})[param.name] = value
        return value

    into = dict(expose_value=False, callback=gather)
    f = click.option("--json-schema", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="The text must be JSON valid against this schema file (llguidance's grammar).", **into)(f)
    f = click.option("--regex", help="The text must match this regular expression (llguidance's grammar).", **into)(f)
    f = click.option("--logit-bias", multiple=True, metavar="ID=BIAS",
                     help="Add BIAS to token ID's logit (OpenAI's logit_bias: -100 bans, 100 forces; repeatable).",
                     **into)(f)
    f = click.option("--frequency-penalty", default=0.0, show_default=True, type=float,
                     help="OpenAI's: minus this times each token's count in the row's text so far.", **into)(f)
    return click.option("--presence-penalty", default=0.0, show_default=True, type=float,
                        help="OpenAI's: minus this from every token the row has generated.", **into)(f)


def processors_from(ctx: click.Context, tokenizer, vocab_size: int, eos_ids, sampling):
    """The row -> processors factory the processor flags ask for (None: none); a bad value is a
    usage error (exit 2)."""
    import json
    from types import SimpleNamespace

    from tk.toolkit.serving.frontend import Params

    flags = ctx.meta.get("tk.processors", {})
    bias = {}
    for item in flags.get("logit_bias", ()):
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise click.BadParameter(f"{item!r} is not ID=BIAS", param_hint="--logit-bias") from None
        if not 0 <= int(token) < vocab_size:
            raise click.BadParameter(f"token {token} is outside the vocabulary (0..{vocab_size - 1})",
                                     param_hint="--logit-bias")
    params = Params(max_tokens=1, presence_penalty=flags.get("presence_penalty", 0.0),
                    frequency_penalty=flags.get("frequency_penalty", 0.0), logit_bias=bias)
    constraint = None
    if flags.get("regex") is not None or flags.get("json_schema") is not None:
        from tk.toolkit.serving.openai.api import ApiError
        from tk.toolkit.serving.openai.structured import Compiler

        if flags.get("regex") is not None and flags.get("json_schema") is not None:
            raise click.UsageError("--regex and --json-schema are two grammars; give one", ctx)
        if tokenizer is None:
            raise click.UsageError("a grammar needs the artifact's tokenizer", ctx)
        schema = None if flags.get("json_schema") is None else json.loads(flags["json_schema"].read_text())
        wanted = SimpleNamespace(json_=schema, regex=flags.get("regex"), choice=None, grammar=None, json_object=False)
        body = SimpleNamespace(response_format=None, structured_outputs=wanted, guided_json=None, guided_regex=None,
                               guided_choice=None, guided_grammar=None)
        try:
            constraint = Compiler(tokenizer, vocab_size, list(eos_ids)).compile(body)
        except ApiError as e:
            raise click.UsageError(e.message.replace("structured_outputs: ", ""), ctx) from None
    if not (params.presence_penalty or params.frequency_penalty or bias or constraint):
        return None
    return lambda row: params.processors(vocab_size, list(eos_ids), constraint.start(sampling.for_row(row))
                                         if constraint is not None else None)

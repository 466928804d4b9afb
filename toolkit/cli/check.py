"""`tk parity`, `tk inspect`, `tk doctor`: checking an artifact and this machine. Option parsing and
output only; tk.toolkit.verify and tk.toolkit.tools do the work."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tk.models.spec.errors import CheckFailed
from tk.toolkit.backends import BackendOptions
from tk.toolkit.cli.options import BackendName, backend_options, backends_option


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@backends_option("torch,ort")
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
@backend_options(quant_compute=False)
def parity(artifact: Path, backends: list[str], steps: int, seed: int, prompts_file: Path | None, report: Path | None,
           plot: Path | None, required: tuple[str, ...], junit: Path | None, atol: float | None, rtol: float | None,
           min_top1: float | None, options: BackendOptions) -> None:
    """Compare every backend with the float32 PyTorch reference, step by step; exit 3 on drift.

    A tensor that went through d layers may differ by atol + rtol * d * its own magnitude (the
    logits: per position); float32's rtol follows from the model's accumulation length."""
    from tk.toolkit.verify import compare, report as parity_report

    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install 'tk[plot]'") from None
    result = compare.parity(artifact, backends, steps=steps, seed=seed, prompts_file=prompts_file, options=options,
                            atol=atol, rtol=rtol, min_top1=min_top1)
    click.echo(parity_report.summary(result), err=True)
    if report is not None:
        report.write_text(json.dumps(parity_report.to_dict(result), indent=2))
    if junit is not None:
        parity_report.write_junit(result, junit, required)
    if plot is not None:
        parity_report.plot(result, plot)
    failure = parity_report.verdict(result, required)
    if failure:
        raise CheckFailed(failure)
    click.echo("parity passed")


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", type=click.IntRange(min=1), help="Context length for the memory plan (default: the model's).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(path: Path, batch: int, seq_len: int | None, as_json: bool) -> None:
    """Describe a checkpoint or an artifact: config, parameters, graph I/O, memory plan."""
    from tk.toolkit.tools.describe import format_info, inspect_path

    info = inspect_path(path, batch, seq_len)
    click.echo(json.dumps(info, indent=2) if as_json else format_info(info))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(as_json: bool) -> None:
    """Which backends, providers, GPUs and versions this machine has."""
    from tk.toolkit.tools.doctor import doctor_report

    report = doctor_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for name, entry in report.items():
        state = entry["version"] if entry.get("available") else "missing"
        extra = "; ".join(f"{k}: {v}" for k, v in entry.items() if k not in ("available", "version"))
        click.echo(f"{name:12} {state:14} {extra}")

"""The `tk` command line: the group, its error mapping, and the commands registered on it.

Commands live in one module per group (export, run, check, serve: tk.toolkit.cli.*); they parse
options, call library functions and format results, nothing else. Library code raises `TkError`s
(models/spec/errors.py), each carrying its exit code (1 error, 2 usage, 3 a check ran and failed);
`TkGroup` prints their first line, once, here, and an interruption's (Ctrl-C: exit 130; SIGTERM,
during the commands that do long work: 143). Option values come from the typed tables (dtypes,
export variants and profiles, the backend registry), so a bad one is a usage error at parse
time. `--debug` shows tracebacks. Only the standard library, click and tk's stdlib-only modules
are imported here: `tk --help` and `tk generate --backend ort` never pay for torch.
"""

from __future__ import annotations

import sys

import click

from tk.models.spec.errors import CheckFailed, TkError
from tk.toolkit.cli import check, export, run, serve
from tk.toolkit.cli.options import Terminated
from tk.toolkit.versions import package_version


class TkGroup(click.Group):
    """Maps a TkError to its one-line message and exit code (1 error, 2 usage, 3 a check failed), and
    an interruption to one line and 130 (SIGTERM: 143). Anything else is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            terminated = isinstance(exc, Terminated)
            click.echo(f"Error: {'terminated (SIGTERM)' if terminated else 'interrupted'}", err=True)
            ctx.exit(143 if terminated else 130)
        except TkError as exc:
            if ctx.obj.get("debug"):
                raise
            if isinstance(exc, CheckFailed) and exc.table:
                click.echo(exc.table, err=True)
            click.echo(f"Error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=TkGroup)
@click.version_option(package_version("tk") or "0+unknown", prog_name="tk")
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """tk: decoder-only transformers from PyTorch to ONNX Runtime and TensorRT, with parity proofs."""
    ctx.ensure_object(dict)["debug"] = debug


for command in (export.export, check.inspect, run.generate, check.parity, run.eval_, export.build_engine,
                check.doctor, run.bench, run.demo, serve.serve, serve.triton):
    main.add_command(command)


def entry() -> None:
    """The `tk` console script: this process is tk's own, so its ORT sessions share one thread pool."""
    from tk.runtimes.backends.ort_pool import use_shared_thread_pool

    use_shared_thread_pool()
    main()


if __name__ == "__main__":
    sys.exit(entry())

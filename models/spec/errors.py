"""The errors tk reports to a user, each carrying its exit code. Standard library only, so every
package (and the CLI, before it imports anything heavy) may import it.

A `TkError` is a user's problem: the CLI prints its first line and exits with `exit_code`.
Anything else that escapes (a plain ValueError from a numpy broadcast, say) is a bug and keeps
its traceback.
"""

from __future__ import annotations

import json
from pathlib import Path


class TkError(Exception):
    """Something the user can fix; the message says what and how (exit 1)."""

    exit_code = 1


class UsageProblem(TkError):
    """A bad option value or combination of options (exit 2, as click's usage errors)."""

    exit_code = 2


class CheckFailed(TkError):
    """A check ran and the artifact failed it: export validation, tk parity (exit 3). `table` says
    what differed."""

    exit_code = 3

    def __init__(self, message: str, table: str = ""):
        super().__init__(message)
        self.table = table


class CheckpointError(TkError, ValueError):
    """The checkpoint folder is missing, incomplete, corrupt, or disagrees with its config."""


class FilesystemProblem(TkError):
    """An output that exists, a folder that cannot be written."""


TRT_INSTALL_HINT = ("on a machine with an NVIDIA GPU, pip install 'tk[gpu]' --extra-index-url https://pypi.nvidia.com "
                    "(TensorRT's libraries come from NVIDIA's index, not PyPI)")
TRT_MISSING = f"TensorRT is not installed; {TRT_INSTALL_HINT}"


def read_json(folder: str | Path, name: str, error: type[TkError], *, no_folder: str, no_file: str,
              bad_json: str = "") -> dict:
    """`folder/name` parsed, or one line of `error`: `no_folder`/`no_file` (formatted with `folder`)
    when either is missing, `bad_json` after the parser's complaint when it is not JSON."""
    folder = Path(folder)
    path = folder / name
    if not folder.is_dir():
        raise error(no_folder.format(folder=folder))
    if not path.is_file():
        raise error(no_file.format(folder=folder))
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON ({e}){bad_json}") from None

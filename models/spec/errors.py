"""The errors tk reports to a user, each carrying its exit code. Standard library only, so every
package (and the CLI, before it imports anything heavy) may import it.

A `TkError` is a user's problem: the CLI prints its first line and exits with `exit_code`.
Anything else that escapes (a plain ValueError from a numpy broadcast, say) is a bug and keeps
its traceback.
"""

from __future__ import annotations


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

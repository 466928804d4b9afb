"""The errors runtimes raise for the CLI to report (tk.models.spec.errors maps them to exit codes).
Beneath every other runtimes module, so that each can raise them; tk.runtimes.base re-exports them.
"""

from __future__ import annotations

from tk.models.spec.errors import TkError


class RuntimeProblem(TkError):
    """Base of the errors runtimes raise for the CLI to report."""


class BackendUnavailable(RuntimeProblem):
    """An optional library or device this backend needs is missing; the message says how to get it."""


class InputError(RuntimeProblem, ValueError):
    """Inputs do not fit the contract or the backend's limits."""

"""Installed package versions, as tk reports and records them: `tk --version`, the OpenAI server's
API document, an artifact's manifest and `tk doctor` read them here. Standard library only."""

from __future__ import annotations

from importlib import metadata


def package_version(package: str) -> str | None:
    """The installed version of distribution `package`; None when it is not installed (tk itself,
    run from a source tree)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None

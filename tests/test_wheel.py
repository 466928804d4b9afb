"""An installed tk owns one top-level name, `tk`: its wheel holds `tk/` (and its dist-info) only,
with the parity report's schema as package data, and installed beside another project's own
top-level `models` and `toolkit` packages, both import, each its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("models", "exporters", "runtimes", "toolkit", "pyproject.toml", "README.md")  # what the build reads


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """tk's wheel, built offline from a copy of the sources (the build writes build/ and egg-info
    beside them, so not in the working tree)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (built,) = out.glob("tk-*.whl")
    return built


def test_the_wheel_holds_tk_only_and_the_schema(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"tk", next(t for t in tops if t.endswith(".dist-info"))}, sorted(tops)
    assert "tk/toolkit/verify/parity_report.schema.json" in names
    assert "tk/__init__.py" not in names  # tk is a namespace: tk.models, tk.exporters, tk.runtimes, tk.toolkit
    # every module of the four folders, every room included (pyproject.toml lists the packages by name)
    modules = {f"tk/{p.relative_to(ROOT).as_posix()}" for top in ("models", "exporters", "runtimes", "toolkit")
               for p in (ROOT / top).rglob("*.py")}
    assert not sorted(modules - set(names)), "add the missing packages to pyproject.toml"


def test_installed_tk_lives_beside_other_models_and_toolkit_packages(wheel, tmp_path):
    """A fresh venv with pip; its dependencies (click, torch, onnx, ...) are this interpreter's,
    reached through a .pth line (a path line, so this checkout's editable install stays off)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True, text=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for name in ("models", "toolkit"):  # another project's top-level packages of the same names
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"OWNER = 'dummy {name}'\n")
    code = ("import models, toolkit, tk, tk.models.spec.contract, tk.models.spec.manifest, tk.toolkit.cli.main\n"
            "print(models.OWNER, toolkit.OWNER, models.__file__, *tk.__path__, tk.toolkit.cli.main.__file__, sep='\\n')")
    out = subprocess.run([str(python), "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True)
    owner_m, owner_t, models_file, *tk_paths, cli_file = out.stdout.splitlines()
    assert (owner_m, owner_t) == ("dummy models", "dummy toolkit")
    assert Path(models_file) == site / "models" / "__init__.py"
    assert [Path(p) for p in tk_paths] == [site / "tk"], tk_paths  # the wheel's tk, not this checkout
    assert Path(cli_file) == site / "tk" / "toolkit" / "cli" / "main.py"
    version = subprocess.run([str(venv / "bin" / "tk"), "--version"], cwd=tmp_path, check=True, capture_output=True,
                             text=True)
    assert version.stdout.startswith("tk, version 0.1.0")

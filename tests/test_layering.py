"""The import table of DESIGN.md, enforced: models imports nothing of ours; exporters only models;
runtimes only models' standard-library modules (the contract, the artifact, dtypes, errors); and
importing runtimes pulls in neither torch nor tensorrt."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("models", "exporters", "runtimes", "toolkit")
ALLOWED = {
    "models": set(),
    "exporters": {"models"},
    "runtimes": {"models.contract", "models.artifact", "models.dtypes", "models.errors"},
    "toolkit": set(OURS),
}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for a in node.names:  # `from models import contract` imports models.contract
                yield f"{node.module}.{a.name}"


@pytest.mark.parametrize("package", OURS)
def test_import_table(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in OURS or top == package:
                continue
            if not any(name == a or name.startswith(a + ".") or a.startswith(name + ".") or name == a.split(".")[0]
                       for a in ALLOWED[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "; ".join(bad)


STDLIB_ONLY = ("models/contract.py", "models/artifact.py", "models/dtypes.py", "models/errors.py")


@pytest.mark.parametrize("module", STDLIB_ONLY)
def test_models_shared_with_runtimes_use_the_standard_library_only(module):
    third_party = [n for n in _imports(ROOT / module) if n.split(".")[0] not in (*OURS, *sys.stdlib_module_names)]
    assert not third_party, f"{module} imports {third_party}"


def test_no_module_is_over_400_lines():
    long = [f"{p.relative_to(ROOT)} ({n})" for p in sorted(ROOT.glob("[!.]*/*.py")) if p.parts[-2] != "tests"
            and (n := len(p.read_text().splitlines())) > 400]
    assert not long, "split by responsibility: " + ", ".join(long)


def test_runtimes_import_is_light():
    code = ("import sys, runtimes.base, runtimes.generate, runtimes.sampling, runtimes.ort_runtime, "
            "runtimes.torch_runtime, runtimes.trt_runtime, runtimes.cache_layouts; print(sorted(m for m in ('torch', 'tensorrt', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""The house's rules, enforced by reading the code (ast), not by trusting it:

- the import table of docs/design.md: models imports nothing of ours; exporters only models;
  runtimes only models' standard-library modules (the contract, the artifact, dtypes, errors);
  toolkit's rooms only what sits below them (cli on top; serving never reaches verify or the
  export pipeline);
- no import circle among tk's modules, counting imports inside functions (a lazy import hides a
  circle from Python, not from this test);
- importing runtimes pulls in neither torch nor tensorrt; no module is over 400 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("models", "exporters", "runtimes", "toolkit")  # the repository's folders: tk.models, ...
ALLOWED = {
    "models": set(),
    "exporters": {"models"},
    "runtimes": {"models.contract", "models.artifact", "models.dtypes", "models.errors"},
    "toolkit": set(OURS),
}
# toolkit's rooms: what each may import of the others (its own room always; models, exporters and
# runtimes by the table above). The shared base (the backend registry, text) imports no room.
BASE = {"toolkit.backends", "toolkit.textgen"}
ROOMS = {
    "verify": BASE,
    "pipeline": BASE | {"toolkit.verify"},
    "serving": BASE,
    "tools": BASE | {"toolkit.verify", "toolkit.pipeline"},
    "cli": {"toolkit"},
}


def _modules() -> dict[str, Path]:
    """Every module of ours by its dotted name in the repository (models.config, toolkit.cli.main)."""
    mods = {}
    for top in OURS:
        for path in (ROOT / top).rglob("*.py"):
            mods[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return mods


def _imports(path: Path):
    """Every module name an import statement of `path` names, anywhere in it, with tk.'s prefix off."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from tk.models import contract` imports tk.models.contract
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield name[3:] if name.startswith("tk.") else name


def _ours(name: str, mods: dict) -> str | None:
    """The module of ours `name` refers to (a name imported from a module counts as that module)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


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


def test_toolkit_rooms_import_only_what_is_below_them():
    mods, bad = _modules(), []
    for name, path in mods.items():
        parts = name.split(".")
        if parts[0] != "toolkit" or len(parts) < 3 or parts[1] not in ROOMS:
            continue
        allowed = ROOMS[parts[1]] | {f"toolkit.{parts[1]}"}
        for target in filter(None, (_ours(n, mods) for n in _imports(path))):
            if target.startswith("toolkit") and target != "toolkit" and not any(
                    target == a or target.startswith(a + ".") or a == "toolkit" for a in allowed):
                bad.append(f"{name} imports {target}")
    assert not bad, "; ".join(bad)


def test_no_import_circles():
    """Strongly connected components of the import graph (Tarjan): every one must be a single module."""
    mods = _modules()
    graph = {name: {t for t in (_ours(n, mods) for n in _imports(path)) if t and t != name}
             for name, path in mods.items()}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(" <-> ".join(sorted(component)))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, "import circles: " + "; ".join(circles)


def test_the_circle_test_sees_lazy_imports(tmp_path, monkeypatch):
    """The circle check above counts an import inside a function: a planted lazy circle is found."""
    pkg = tmp_path / "runtimes"
    pkg.mkdir()
    (pkg / "a.py").write_text("from tk.runtimes.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from tk.runtimes import a\n")
    for top in OURS[:-1]:
        (tmp_path / top).mkdir(exist_ok=True)
    (tmp_path / "toolkit").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="runtimes.a <-> runtimes.b"):
        test_no_import_circles()


STDLIB_ONLY = ("models/contract.py", "models/artifact.py", "models/dtypes.py", "models/errors.py")


@pytest.mark.parametrize("module", STDLIB_ONLY)
def test_models_shared_with_runtimes_use_the_standard_library_only(module):
    third_party = [n for n in _imports(ROOT / module) if n.split(".")[0] not in (*OURS, *sys.stdlib_module_names)]
    assert not third_party, f"{module} imports {third_party}"


def test_no_module_is_over_400_lines():
    long = [f"{p.relative_to(ROOT)} ({n})" for top in (*OURS, "examples") for p in sorted((ROOT / top).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400]
    assert not long, "split by responsibility: " + ", ".join(long)


def test_runtimes_import_is_light():
    names = ", ".join(f"tk.runtimes.{p.stem}" for p in sorted((ROOT / "runtimes").glob("*.py")) if p.stem != "__init__")
    code = (f"import sys, {names}; "
            "print(sorted(m for m in ('torch', 'tensorrt', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""The house's rules, enforced by reading the code (ast), not by trusting it:

- rooms by folder (docs/design.md's import table): every module belongs to the deepest room of
  `ROOMS` whose folder holds it, and imports only its own room and the rooms the table lists for
  it, whatever the length of the names (`tk.toolkit.backends` is toolkit's ground floor, a room of
  its own; `from tk.models.spec import contract` names tk.models.spec.contract);
- the spec room (`models/spec/`) imports nothing but the standard library, directly or through
  another tk module, followed transitively;
- no import circle among tk's modules, counting imports inside functions (a lazy import hides a
  circle from Python, not from this test);
- importing runtimes' ground, decoding and serving pulls in neither torch, tensorrt nor
  onnxruntime; no module is over 400 lines (one over 350 is reported, so a split is planned
  before it is forced); no class of the serving engine (runtimes/serving/, runtimes/slots.py,
  runtimes/cache_layouts.py, runtimes/cache_runs.py, the OpenAI server) is over 200 lines.
Each rule has a planted violation below that shows it is caught.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("models", "exporters", "runtimes", "toolkit")  # the repository's folders: tk.models, ...
MODELS = {"models.spec", "models.reference", "models.quant", "models.checkpoint"}
RUNTIMES = {"runtimes", "runtimes.backends", "runtimes.decoding", "runtimes.serving"}
# room -> the rooms it may import besides itself. A room is a folder; a module of a folder that has
# sub-rooms (runtimes/base.py, toolkit/backends.py) is that folder's ground floor, the room named
# by the folder alone.
ROOMS: dict[str, set[str]] = {
    "models.spec": set(),  # what an artifact is: standard library only (test_spec_room_is_stdlib)
    "models.reference": {"models.spec"},  # the torch decoder
    "models.quant": {"models.spec"},  # quantizers and calibration
    "models.checkpoint": {"models.spec", "models.reference", "models.quant"},  # Hugging Face folders
    "models.fixtures": MODELS,  # presets and their trainers: the top of models/
    "exporters": MODELS,
    "runtimes": {"models.spec"},  # base, session, cache layouts, errors
    "runtimes.backends": {"runtimes", "models.spec"},  # never decoding or serving
    "runtimes.decoding": {"runtimes", "models.spec"},  # generation loop, rows, sampling, processors
    "runtimes.serving": {"runtimes", "runtimes.decoding", "models.spec"},  # never a backend
    "toolkit": MODELS | {"models.fixtures", "exporters"} | RUNTIMES,  # backend registry, text
}
_BELOW_TOOLKIT = ROOMS["toolkit"] | {"toolkit"}
ROOMS |= {
    "toolkit.verify": _BELOW_TOOLKIT,
    "toolkit.pipeline": _BELOW_TOOLKIT | {"toolkit.verify"},
    "toolkit.serving": _BELOW_TOOLKIT,  # the front end both servers share
    "toolkit.serving.openai": _BELOW_TOOLKIT | {"toolkit.serving"},
    "toolkit.serving.triton": _BELOW_TOOLKIT | {"toolkit.serving"},
    "toolkit.tools": _BELOW_TOOLKIT | {"toolkit.verify", "toolkit.pipeline"},
    "toolkit.cli": _BELOW_TOOLKIT | {"toolkit.verify", "toolkit.pipeline", "toolkit.serving",
                                     "toolkit.serving.openai", "toolkit.serving.triton", "toolkit.tools"},
}
SPEC = "models.spec"


def _modules() -> dict[str, Path]:
    """Every module of ours by its dotted name in the repository (models.spec.config, toolkit.cli.main)."""
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
            # `from tk.models.spec import contract` imports tk.models.spec.contract
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield name[3:] if name.startswith("tk.") else name


def _ours(name: str, mods: dict) -> str | None:
    """The module of ours `name` refers to (a name imported from a module counts as that module)."""
    if name.split(".")[0] not in OURS:
        return None
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def room_of(module: str, mods: dict) -> str:
    """The deepest room whose folder holds `module` (a package's __init__ is its folder's room)."""
    folder = module if (mods.get(module) and mods[module].name == "__init__.py") else module.rpartition(".")[0]
    while folder not in ROOMS:
        folder = folder.rpartition(".")[0]
    return folder


def _edges() -> list[tuple[str, str]]:
    mods = _modules()
    return [(name, target) for name, path in mods.items()
            for target in {t for t in (_ours(n, mods) for n in _imports(path)) if t and t != name}]


def test_rooms_import_only_what_the_table_allows():
    mods, bad = _modules(), []
    for name, target in _edges():
        mine, theirs = room_of(name, mods), room_of(target, mods)
        if theirs != mine and theirs not in ROOMS[mine]:
            bad.append(f"{name} ({mine}) imports {target} ({theirs})")
    assert not bad, "back arrows or skipped floors: " + "; ".join(sorted(bad))


def test_every_folder_is_a_room():
    """A new folder gets a row of ROOMS, so no module falls into a room by accident."""
    mods = _modules()
    folders = {n.rpartition(".")[0] for n, p in mods.items() if p.name != "__init__.py" and "." in n}
    assert not sorted(f for f in folders if f not in ROOMS), "add these folders to ROOMS"


def _third_party(module: str, mods: dict, seen: set[str]) -> list[str]:
    """The non-stdlib modules `module` imports, directly or through the tk modules it imports."""
    if module in seen:
        return []
    seen.add(module)
    found = []
    for name in _imports(mods[module]):
        ours = _ours(name, mods)
        if ours:
            found += [f"{f.split(' (via ')[0]} (via {ours})" for f in _third_party(ours, mods, seen)]
        elif name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] not in OURS:
            found.append(name)
    return found


def test_spec_room_is_stdlib():
    mods = _modules()
    spec = [m for m in mods if m == SPEC or m.startswith(SPEC + ".")]
    assert len(spec) >= 6  # contract, manifest, options, config, dtypes, errors
    bad = {m: found for m in spec if (found := _third_party(m, mods, set()))}
    assert not bad, f"the spec room must be standard library only: {bad}"


def test_no_import_circles():
    """Strongly connected components of the import graph (Tarjan): every one must be a single module."""
    graph = {name: set() for name in _modules()}
    for name, target in _edges():
        graph[name].add(target)
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


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A copy of the house's folders (as empty rooms) to plant violations in."""
    for top in OURS:
        (tmp_path / top).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)

    def plant(rel: str, text: str):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return plant


def test_a_planted_lazy_circle_is_found(planted):
    planted("runtimes/serving/a.py", "from tk.runtimes.serving.b import x\n")
    planted("runtimes/serving/b.py", "def f():\n    from tk.runtimes.serving import a\n")
    with pytest.raises(AssertionError, match="runtimes.serving.a <-> runtimes.serving.b"):
        test_no_import_circles()


@pytest.mark.parametrize("rel, text, arrow", [
    # a ground-floor module with a two-part name reaching up into a room (the old calibrate arrow)
    ("toolkit/backends.py", "def f():\n    from tk.toolkit.pipeline import calibrate\n",
     "toolkit.backends (toolkit) imports toolkit.pipeline.calibrate (toolkit.pipeline)"),
    # serving reaching a backend
    ("runtimes/serving/batching.py", "from tk.runtimes.backends.ort import OrtRuntime\n",
     "runtimes.serving.batching (runtimes.serving) imports runtimes.backends.ort (runtimes.backends)"),
    # a backend reaching the decoding loop
    ("runtimes/backends/ort.py", "import tk.runtimes.decoding.generate\n",
     "runtimes.backends.ort (runtimes.backends) imports runtimes.decoding.generate (runtimes.decoding)"),
    # runtimes reaching torch code in models
    ("runtimes/base.py", "from tk.models.reference import decoder\n",
     "runtimes.base (runtimes) imports models.reference.decoder (models.reference)"),
])
def test_a_planted_back_arrow_is_found(planted, rel, text, arrow):
    for target in ("toolkit/pipeline/calibrate.py", "runtimes/backends/ort.py", "runtimes/decoding/generate.py",
                   "models/reference/decoder.py"):
        planted(target, "")
    planted(rel, text)
    with pytest.raises(AssertionError, match=arrow.replace("(", r"\(").replace(")", r"\)")):
        test_rooms_import_only_what_the_table_allows()


def test_a_planted_non_stdlib_import_through_another_module_is_found(planted):
    for name in ("contract", "manifest", "options", "config", "dtypes"):
        planted(f"models/spec/{name}.py", "import json\n")
    planted("models/spec/errors.py", "def f():\n    from tk.models.quant.quantize import x\n")
    planted("models/quant/quantize.py", "import numpy as np\n")
    with pytest.raises(AssertionError, match=r"numpy \(via models.quant.quantize\)"):
        test_spec_room_is_stdlib()


def test_no_module_is_over_400_lines():
    sizes = {f"{p.relative_to(ROOT)}": len(p.read_text().splitlines())
             for top in (*OURS, "examples") for p in sorted((ROOT / top).rglob("*.py"))}
    near = [f"{p} ({n})" for p, n in sizes.items() if 350 < n <= 400]
    if near:
        warnings.warn("plan a split by responsibility before the 400-line cap: " + ", ".join(near))
    long = [f"{p} ({n})" for p, n in sizes.items() if n > 400]
    assert not long, "split by responsibility: " + ", ".join(long)


SERVING = ("runtimes/serving", "runtimes/slots.py", "runtimes/cache_layouts.py", "runtimes/cache_runs.py",
           "toolkit/serving")


def test_no_serving_class_is_over_200_lines():
    """The engine's classes stay small enough to read whole (issue 45: Batcher, StaticLayout and Server had
    grown past it)."""
    paths = [q for rel in SERVING for q in ([ROOT / rel] if rel.endswith(".py") else sorted((ROOT / rel).rglob("*.py")))
             if q.exists()]
    long = [f"{q.relative_to(ROOT)}: {n.name} ({n.end_lineno - n.lineno + 1})" for q in paths
            for n in ast.walk(ast.parse(q.read_text())) if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno >= 200]
    assert not long, "split by responsibility: " + ", ".join(long)


def test_a_planted_long_serving_class_is_found(planted):
    planted("runtimes/serving/batching.py", "class Batcher:\n" + "    x = 1\n" * 200)
    with pytest.raises(AssertionError, match=r"Batcher \(201\)"):
        test_no_serving_class_is_over_200_lines()


def test_runtimes_import_is_light():
    """Importing runtimes' ground floor, decoding and serving (and the backends' modules, which import
    their libraries on activation) loads neither torch, tensorrt nor onnxruntime."""
    names = ", ".join(f"tk.{n}" for n in _modules() if n.startswith("runtimes"))
    code = (f"import sys, {names}; "
            "print(sorted(m for m in ('torch', 'tensorrt', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

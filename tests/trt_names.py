"""Which `tensorrt` attributes a TensorRT version has, and which ones tk's source uses (tests/test_trt_api.py).

The names a version has come from its `tensorrt-cu12-bindings` wheel (1.2 MB, no GPU, no TensorRT
libraries): pybind11 registers every class, enum member and method under a C string in the
extension's `.rodata`. Splitting the section at NULs is not enough: the linker merges a string into
the tail of a longer one (`INT8` lives inside `UINT8`, `Builder` inside `IExprBuilder`), so the
names are read where the code points: every RIP-relative `lea` in `.text` and every relative
relocation that lands in `.rodata` starts a registered string. The wheel's `__init__.py` adds the
few names bound in Python (`__version__`, `volume`, `nptype`). The names are flat: a member is
found if any class or enum registers it (`BuilderFlag.BF16` passes on 11.x through `DataType.BF16`),
because the code registers an enum's members apart from the enum's own name.

The names tk uses come from its source with `ast`: `trt.X`, `trt.X.Y`, ... on every name bound to
the module (`import tensorrt as trt`, `from tensorrt import X`, `trt = import_tensorrt()`, and a
parameter of that name in such a module). A use counts as behind a version check, required only in
the majors it claims, when it sits in the body (or the else) of an `if` or a conditional
expression whose test compares the TensorRT major with an int (`TRT_MAJOR >= 11`,
`trt_major(v) < 11`, `int(trt.__version__.split(".")[0]) == 10`: a name matching `trt_major` or
`tensorrt_major`, or `__version__` on the module), or in the body of `if hasattr(trt.X, "Y")`,
which exempts `trt.X.Y` there in every version. Tests joined with `and` claim each part in the body;
an else of such a join claims nothing.
"""

from __future__ import annotations

import ast
import operator
import os
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "tensorrt-cu12-bindings"
CACHE_ENV = "TK_TRT_BINDINGS_CACHE"
# one wheel per version whatever Python runs the tests: the cp311 x86-64 build (the `lea` scan reads x86-64)
PLATFORM_ARGS = ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
                 "--platform", "manylinux_2_17_x86_64")
# what pip prints when it cannot reach an index, as opposed to reaching it and not finding the version
UNREACHABLE = re.compile(r"NewConnectionError|ConnectTimeout|ReadTimeout|Max retries|Could not fetch URL|"
                         r"Temporary failure in name resolution|Network is unreachable|ProxyError|SSLError|"
                         r"Connection refused|No route to host")
IDENT = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
MAJOR_NAME = re.compile(r"(trt|tensorrt)_?major", re.IGNORECASE)
SYMBOL = {"Eq": "==", "NotEq": "!=", "Lt": "<", "LtE": "<=", "Gt": ">", "GtE": ">="}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge}
FLIPPED = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE, ast.Eq: ast.Eq, ast.NotEq: ast.NotEq}


class IndexUnreachable(RuntimeError):
    """pip could not reach the package index (the caller skips)."""


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tk-tests" / "trt-bindings"


def bindings_wheel(version: str, cache: Path, timeout: float = 120) -> Path:
    """The bindings wheel of `version`, downloaded once into `cache`. Raises IndexUnreachable."""
    pattern = f"{PACKAGE.replace('-', '_')}-{version}-*.whl"
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    # into a private folder, then renamed: two pytest workers may fetch the same wheel at once
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *PLATFORM_ARGS,
               "--retries", "1", "--timeout", "15", "-d", tmp, f"{PACKAGE}=={version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise IndexUnreachable(f"pip download {PACKAGE}=={version} took over {timeout:.0f} s") from None
        output = done.stdout + done.stderr
        indexes = re.search(r"Looking in indexes: (.*)", output)
        where = f"the package index ({indexes.group(1)})" if indexes else "the configured package index"
        if done.returncode != 0 and UNREACHABLE.search(output):
            raise IndexUnreachable(f"{where} is unreachable for {PACKAGE}=={version}")
        wheels = sorted(Path(tmp).glob(pattern))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {PACKAGE}=={version} from {where} failed:\n{output[-2000:]}")
        target = cache / wheels[0].name
        os.replace(wheels[0], target)
    return target


def _sections(elf: bytes) -> dict[str, tuple[int, int, int]]:
    """name -> (address, file offset, size) of a little-endian ELF64's sections."""
    if elf[:6] != b"\x7fELF\x02\x01":
        raise ValueError("not a little-endian 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * entsize) for i in range(count)]
    strtab = headers[names_at][4]
    out = {}
    for name, _, _, addr, off, size in headers:
        out[elf[strtab + name:elf.index(b"\0", strtab + name)].decode()] = (addr, off, size)
    return out


def so_names(elf: bytes) -> set[str]:
    """The identifiers an x86-64 shared object's code and data point at in `.rodata`."""
    sec = _sections(elf)
    text_addr, text_off, text_size = sec[".text"]
    ro_addr, ro_off, ro_size = sec[".rodata"]
    targets = set()
    text = elf[text_off:text_off + text_size]
    # lea r64, [rip + disp32]: REX.W (or REX.WR) 8D, ModRM with mod 00 and r/m 101; rip is the next instruction
    for m in re.finditer(rb"[\x48\x4c]\x8d[\x05\x0d\x15\x1d\x25\x2d\x35\x3d]", text):
        disp, = struct.unpack_from("<i", text, m.end())
        targets.add(text_addr + m.end() + 4 + disp)
    rela_addr, rela_off, rela_size = sec.get(".rela.dyn", (0, 0, 0))
    for at in range(rela_off, rela_off + rela_size, 24):
        _, info, addend = struct.unpack_from("<QQq", elf, at)
        if info & 0xFFFFFFFF == 8:  # R_X86_64_RELATIVE: a pointer in data tables (pybind11 arrays, docstrings)
            targets.add(addend)
    names = set()
    for t in targets:
        if ro_addr <= t < ro_addr + ro_size:
            start = ro_off + t - ro_addr
            m = IDENT.match(elf, start)
            if m and elf[m.end():m.end() + 1] == b"\0":
                names.add(m.group().decode())
    return names


def _python_names(source: str) -> set[str]:
    """Names the package's `__init__.py` binds: module globals and the attributes it sets on classes
    (a function's locals are not the module's)."""
    names, todo = set(), list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        todo.extend(ast.iter_child_nodes(node))
    return names


def wheel_names(wheel: Path) -> set[str]:
    """Every attribute name the bindings of `wheel` can resolve."""
    with zipfile.ZipFile(wheel) as z:
        members = z.namelist()
        so = next(n for n in members if re.fullmatch(r"tensorrt[^/]*/tensorrt[^/]*\.so", n))
        init = next(n for n in members if re.fullmatch(r"tensorrt[^/]*/__init__\.py", n))
        return so_names(z.read(so)) | _python_names(z.read(init).decode())


@dataclass(frozen=True)
class Use:
    """`trt.<chain>` at file:line; required where every condition (op, major) holds, unless exempt."""

    path: str
    line: int
    chain: tuple[str, ...]
    conditions: tuple[tuple[type, int], ...] = ()
    exempt: bool = False

    def required_in(self, major: int) -> bool:
        return not self.exempt and all(COMPARE[op](major, n) for op, n in self.conditions)

    def __str__(self) -> str:
        claim = " and ".join(f"major {SYMBOL[op.__name__]} {n}" for op, n in self.conditions)
        return f"{self.path}:{self.line} trt.{'.'.join(self.chain)}" + (f" (when {claim})" if claim else "")


@dataclass
class _Scope:
    conditions: tuple = ()
    exempt: frozenset = field(default_factory=frozenset)  # chains a hasattr guard covers


def _aliases(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """Local name -> the tensorrt chain it stands for."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update({a.asname or "tensorrt": () for a in node.names if a.name == "tensorrt"})
        elif isinstance(node, ast.ImportFrom) and node.module == "tensorrt" and not node.level:
            out.update({a.asname or a.name: (a.name,) for a in node.names})
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and getattr(node.value.func, "id", getattr(node.value.func, "attr", None)) == "import_tensorrt"):
            out.update({t.id: () for t in node.targets if isinstance(t, ast.Name)})
    return out


def _chain(node: ast.AST, aliases: dict) -> tuple[str, ...] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return aliases[node.id] + tuple(reversed(parts))
    return None


def _names_major(node: ast.AST, aliases: dict) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and MAJOR_NAME.fullmatch(n.id):
            return True
        if isinstance(n, ast.Attribute) and (MAJOR_NAME.fullmatch(n.attr)
                                             or (n.attr == "__version__" and _chain(n.value, aliases) == ())):
            return True
    return False


def _guard(test: ast.AST, aliases: dict) -> tuple[list, set, bool]:
    """What an if-test claims for its body: (conditions on the major, exempt chains, whether its
    negation is one condition, for the else)."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    conditions, exempt = [], set()
    for part in parts:
        if (isinstance(part, ast.Compare) and len(part.ops) == 1 and type(part.ops[0]) in COMPARE):
            left, op, right = part.left, type(part.ops[0]), part.comparators[0]
            if isinstance(left, ast.Constant):
                left, op, right = right, FLIPPED[op], left
            if isinstance(right, ast.Constant) and type(right.value) is int and _names_major(left, aliases):
                conditions.append((op, right.value))
        elif (isinstance(part, ast.Call) and getattr(part.func, "id", None) == "hasattr" and len(part.args) == 2
              and isinstance(part.args[1], ast.Constant) and isinstance(part.args[1].value, str)):
            base = _chain(part.args[0], aliases)
            if base is not None:
                exempt.add(base + (part.args[1].value,))
    return conditions, exempt, len(parts) == 1 and len(conditions) == 1


NEGATED = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt}


def _use(path: str, node: ast.AST, chain: tuple[str, ...], scope: _Scope) -> Use:
    exempt = any(chain[:len(e)] == e for e in scope.exempt)  # `trt.X.Y.value` under hasattr(trt.X, "Y") too
    return Use(path, node.lineno, chain, scope.conditions, exempt)


def _walk(node: ast.AST, scope: _Scope, aliases: dict, path: str, out: list[Use]) -> None:
    if isinstance(node, (ast.If, ast.IfExp)):
        conditions, exempt, negatable = _guard(node.test, aliases)
        _walk(node.test, scope, aliases, path, out)
        inside = _Scope(scope.conditions + tuple(conditions), scope.exempt | exempt)
        orelse = scope
        if negatable:
            (op, n), = conditions
            orelse = _Scope(scope.conditions + ((NEGATED[op], n),), scope.exempt)
        body = node.body if isinstance(node.body, list) else [node.body]
        other = node.orelse if isinstance(node.orelse, list) else [node.orelse]
        for child in body:
            _walk(child, inside, aliases, path, out)
        for child in other:
            _walk(child, orelse, aliases, path, out)
        return
    if isinstance(node, ast.Attribute):
        chain = _chain(node, aliases)
        if chain:
            out.append(_use(path, node, chain, scope))
            return  # the outermost attribute of a chain is the whole use
    if isinstance(node, ast.Name) and aliases.get(node.id):  # `from tensorrt import X`: X itself
        out.append(_use(path, node, aliases[node.id], scope))
    for child in ast.iter_child_nodes(node):
        _walk(child, scope, aliases, path, out)


def uses_in(source: str, path: str) -> list[Use]:
    """Every `trt.<chain>` of a module that binds the tensorrt module (none when it does not)."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    out: list[Use] = []
    if aliases:
        _walk(tree, _Scope(), aliases, path, out)
    return out


def tk_uses(root: Path, folders=("models", "exporters", "runtimes", "toolkit")) -> list[Use]:
    out = []
    for folder in folders:
        for file in sorted((root / folder).rglob("*.py")):
            out += uses_in(file.read_text(), str(file.relative_to(root)))
    return out


def missing(uses: list[Use], names: set[str], major: int) -> list[str]:
    """The uses required in `major` that name something the version lacks, one line each."""
    return [f"{use}: {', '.join(p for p in use.chain if p not in names)} not in the bindings"
            for use in uses if use.required_in(major) and any(p not in names for p in use.chain)]

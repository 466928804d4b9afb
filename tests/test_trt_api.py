"""tk's TensorRT calls against the real bindings of the oldest supported 10.x and of 11.4.

No GPU and no TensorRT run here, so the fake-TensorRT tests cannot say whether a `trt.X` tk uses
exists. These read it from the `tensorrt-cu12-bindings` wheels themselves (1.2 MB each, cached
under ~/.cache/tk-tests/trt-bindings or $TK_TRT_BINDINGS_CACHE; skipped when the package index is
unreachable): every `trt.X.Y` in tk's source must be registered by each version it can run on, or
sit behind a version check (tests/trt_names.py says which forms count).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

import trt_names
from trt_names import missing, tk_uses, uses_in

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("10.15.1.29", "11.4.0.106")  # the oldest 10.x tk supports, and what `pip install tensorrt` gives


def major(version: str) -> int:
    return int(version.split(".")[0])


@pytest.fixture(scope="module")
def wheels() -> dict[str, Path]:
    try:
        return {v: trt_names.bindings_wheel(v, trt_names.cache_dir()) for v in VERSIONS}
    except trt_names.IndexUnreachable as e:
        pytest.skip(f"needs the package index to download the tensorrt-cu12-bindings wheels (cached after): {e}")


@pytest.fixture(scope="module")
def names(wheels) -> dict[str, set[str]]:
    return {v: trt_names.wheel_names(w) for v, w in wheels.items()}


def test_the_reader_sees_what_each_version_registers(wheels, names):
    new, old = names["11.4.0.106"], names["10.15.1.29"]
    assert {"STRONGLY_TYPED", "BF16", "TF32", "execute_async_v3", "add_kv_cache_update", "__version__"} <= new
    # 11.0 removed weak typing: no FP16 builder flag (fp16 is DataType.HALF) and no implicit-batch flag
    assert "FP16" not in new and "EXPLICIT_BATCH" not in new
    assert {"FP16", "EXPLICIT_BATCH", "STRONGLY_TYPED", "set_flag"} <= old
    # INT8 stays in both as DataType.INT8, a name the linker keeps only as the tail of UINT8: a plain split
    # of the section at NULs would lose it, as it loses Builder (inside IExprBuilder) and Runtime
    for version, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as z:
            strings = set(z.read("tensorrt_bindings/tensorrt.so").split(b"\0"))
        merged = {"INT8", "Builder", "Runtime", "Logger"}
        assert not {n.encode() for n in merged} & strings, version
        assert merged <= names[version], version


def test_every_trt_attribute_tk_uses_exists_where_it_runs(names):
    uses = tk_uses(ROOT)
    # the build and the runtime both use the module: an empty list would mean the collector lost them
    assert {u.path for u in uses} >= {"exporters/trt_build.py", "runtimes/backends/trt.py"}, uses
    problems = [f"TensorRT {v}: {line}" for v in VERSIONS for line in missing(uses, names[v], major(v))]
    assert not problems, "\n".join(problems)


PLANTED = """
import tensorrt as trt

def precision(config):
    config.set_flag(trt.BuilderFlag.FP16)
"""


def test_a_planted_fp16_flag_fails_on_11_and_passes_on_10(names):
    uses = uses_in(PLANTED, "planted.py")
    assert missing(uses, names["10.15.1.29"], 10) == []
    assert missing(uses, names["11.4.0.106"], 11) == [
        "planted.py:5 trt.BuilderFlag.FP16: FP16 not in the bindings"]


# how a version check reads: each source's FP16 is required in the majors listed (10 has it, 11 not)
GUARDED = [
    ("if TRT_MAJOR < 11:\n    trt.BuilderFlag.FP16", {10}),
    ("if 11 > self.trt_major:\n    trt.BuilderFlag.FP16", {10}),
    ("if TRT_MAJOR >= 11:\n    trt.BuilderFlag.FP16", {11}),
    ("if TRT_MAJOR >= 11:\n    pass\nelse:\n    trt.BuilderFlag.FP16", {10}),
    ("if TRT_MAJOR == 10 and strict:\n    trt.BuilderFlag.FP16", {10}),
    ("if TRT_MAJOR == 10 and strict:\n    pass\nelse:\n    trt.BuilderFlag.FP16", {10, 11}),
    ("flag = trt.BuilderFlag.FP16 if int(trt.__version__.split('.')[0]) == 10 else None", {10}),
    ("flag = None if trt_major(trt) > 10 else trt.BuilderFlag.FP16", {10}),
    ("if hasattr(trt.BuilderFlag, 'FP16'):\n    config.set_flag(trt.BuilderFlag.FP16)", set()),
    ("if hasattr(trt.BuilderFlag, 'FP16') or fast:\n    trt.BuilderFlag.FP16", {10, 11}),
    ("if hasattr(trt.BuilderFlag, 'BF16'):\n    trt.BuilderFlag.FP16", {10, 11}),
    ("if cuda_major >= 13:\n    trt.BuilderFlag.FP16", {10, 11}),  # not the TensorRT major
]


@pytest.mark.parametrize("body,required", GUARDED)
def test_a_version_check_limits_a_name_to_the_majors_it_claims(body, required):
    source = "import tensorrt as trt\n" + body + "\n"
    fp16 = [u for u in uses_in(source, "m.py") if u.chain == ("BuilderFlag", "FP16")]
    assert len(fp16) == 1, fp16
    assert {m for m in (10, 11) if fp16[0].required_in(m)} == required
    with_fp16, without = {"BuilderFlag", "FP16", "__version__"}, {"BuilderFlag", "__version__"}
    assert bool(missing(fp16, without, 11)) == (11 in required)
    assert missing(fp16, with_fp16, 10) == []


@pytest.mark.parametrize("source", [
    "from tensorrt import BuilderFlag\nBuilderFlag.FP16\n",
    "from tensorrt import BuilderFlag as F\nflags = [F.FP16]\n",
    "from tk.exporters.trt_build import import_tensorrt\n\n"
    "def f():\n    rt = import_tensorrt()\n    rt.BuilderFlag.FP16\n",
    "import tensorrt\n\ndef f(config):\n    config.set_flag(tensorrt.BuilderFlag.FP16)\n",
    "def load():\n    import tensorrt as trt\n    return trt\n\ndef build(trt):\n    trt.BuilderFlag.FP16\n",
])
def test_every_way_of_naming_the_module_is_followed(source):
    assert [use.chain for use in uses_in(source, "m.py") if "FP16" in use.chain] == [("BuilderFlag", "FP16")]


def test_modules_without_tensorrt_are_not_read():
    assert uses_in("def f(trt):\n    return trt.BuilderFlag.FP16\n", "m.py") == []

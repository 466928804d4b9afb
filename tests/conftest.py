from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# pytest-xdist's workers share the cores: each worker's PyTorch (OpenMP) and the tk commands it
# starts get their share of them. With a team of all the cores in each worker, the teams' spinning
# threads take turns on the same cores: 14 mutation cases of tests/test_parity.py on 2 workers and
# 2 cores took 544 s, 57 s with one thread a worker.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)
    torch.set_num_threads(_SHARE)

from hf_models import ALL, FAMILIES, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def trace_cache(tmp_path_factory):
    """One cache of traced graphs for the run (exporters/trace_cache.py), shared by the xdist workers
    and the tk commands the tests start: a graph is traced once per config, dtype and variant, not
    once per export. Graphs are byte-identical with and without it (tests/test_export.py)."""
    if "TK_TRACE_CACHE" not in os.environ:
        root = tmp_path_factory.getbasetemp()
        root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the run's folder, not the worker's
        os.environ["TK_TRACE_CACHE"] = str(root / "trace-cache")


def assert_close(actual, expected, atol: float, what: str = "") -> None:
    """Like torch.testing.assert_close with only atol, printing max and mean difference on failure."""
    a = torch.as_tensor(np.asarray(actual, dtype=np.float64))
    e = torch.as_tensor(np.asarray(expected, dtype=np.float64))
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    diff = (a - e).abs()
    assert diff.max() <= atol, f"{what}: max |diff| {diff.max():.3g} > {atol} (mean {diff.mean():.3g})"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> folder of a tiny jittered transformers checkpoint (made once per session)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = make_checkpoint(family, tmp_path_factory.mktemp(f"ckpt-{family}"))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory, checkpoints):
    """(family, dtype, opset) -> exported, validated artifact folder (exported once per session)."""
    from tk.toolkit.pipeline.export import export_artifact

    cache: dict[tuple, Path] = {}

    def get(family: str, dtype: str = "fp32", opset: int = 23) -> Path:
        key = (family, dtype, opset)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"art-{family}-{dtype}-{opset}") / "artifact"
            export_artifact(checkpoints(family), out, dtype=dtype, opset=opset)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="module")
def exported(tmp_path_factory, checkpoints):
    """(family, profile or None, export flags) -> its artifact, exported and validated once per module (a module's
    matrix of profiles and flags: tests/test_hybrids.py, tests/test_attention_2026.py)."""
    from tk.toolkit.pipeline.export import export_artifact

    cache = {}

    def get(family: str, profile: str | None = None, **flags):
        key = (family, profile, tuple(sorted(flags.items())))
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp(f"{family}-{profile or 'default'}") / "artifact"
            export_artifact(checkpoints(family), cache[key], profile=profile, **flags)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The built-in tiny preset as a checkpoint folder."""
    from tk.models.fixtures.presets import write_preset

    return write_preset("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def trained_like(tmp_path_factory):
    """The trained-like preset (24 layers, vocab 32768, logits ~30, growing residual stream)."""
    from tk.models.fixtures.presets import write_preset

    return write_preset("trained-like", tmp_path_factory.mktemp("trained-like"))


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny):
    from tk.toolkit.pipeline.export import export_artifact

    out = tmp_path_factory.mktemp("tiny-art") / "artifact"
    export_artifact(tiny, out)
    return out


FAMILY_NAMES = list(FAMILIES)
ALL_NAMES = list(ALL)


@pytest.fixture(scope="session")
def serve_artifact(tmp_path_factory, tiny):
    """The tiny preset with a chat template, exported with a static cache (what serving's slots need)."""
    import shutil

    from chat import add_chat_template
    from tk.toolkit.pipeline.export import export_artifact

    ckpt = tmp_path_factory.mktemp("serve-ckpt") / "checkpoint"
    shutil.copytree(tiny, ckpt)
    add_chat_template(ckpt)
    out = tmp_path_factory.mktemp("serve-art") / "artifact"
    export_artifact(ckpt, out, kv_cache="static", max_seq_len=128)
    return out



@pytest.fixture(scope="session")
def tools_artifact(tmp_path_factory, tiny):
    """The tiny preset with a hermes-format chat template that renders tools (tests/chat.py), static
    cache, a context long enough for tool prompts and calls (tests/test_tool_calling.py, test_fuzz.py)."""
    import shutil

    from chat import TOOLS_TEMPLATE, add_chat_template
    from tk.toolkit.pipeline.export import export_artifact

    ckpt = tmp_path_factory.mktemp("tools-ckpt") / "checkpoint"
    shutil.copytree(tiny, ckpt)
    add_chat_template(ckpt, template=TOOLS_TEMPLATE)
    out = tmp_path_factory.mktemp("tools-art") / "artifact"
    export_artifact(ckpt, out, kv_cache="static", max_seq_len=512, validate=False)
    return out

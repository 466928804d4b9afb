"""Polygraphy's runner check (`config.INTERNAL_CORRECTNESS_CHECKS`): deactivating a runtime puts
back every attribute activating it set, so a runtime is the same object before and after a
`with` and can be activated again. TensorRT's runtime is checked with fake devices in
tests/test_trt_buffers.py."""

from __future__ import annotations

import pytest

from tk.runtimes.decoding.generate import generate

pytestmark = pytest.mark.slow


def _state(rt) -> dict:
    """The runtime's attributes and its cache buffers' (`buffers.x`: what a backend's `_load` sets there)."""
    return {**vars(rt), **{f"buffers.{k}": v for k, v in vars(rt.buffers).items()}}


def unchanged_by_activation(rt) -> dict:
    """Activate and deactivate `rt`; assert its attributes are what they were -> them while active."""
    before = {k: type(v)(v) if type(v) in (dict, list) else v for k, v in _state(rt).items()}  # as they are now
    rt.activate()
    loaded = _state(rt)
    rt.deactivate()
    after = _state(rt)
    assert after.keys() == before.keys(), f"attributes added or dropped: {sorted(after.keys() ^ before.keys())}"
    changed = [k for k in before if not (after[k] is before[k] or after[k] == before[k])]
    assert not changed, f"deactivation left these as activation set them: {changed}"
    return loaded


@pytest.mark.parametrize("kw", [{}, {"swap_sessions": True}, {"prefill_via": "prefill"}])
def test_ort_runtime_is_restored_by_deactivation(tiny_artifact, kw):
    from tk.runtimes.backends.ort import OrtRuntime

    rt = OrtRuntime(tiny_artifact, **kw)
    loaded = unchanged_by_activation(rt)
    assert loaded["buffers.device"] == "cpu" and loaded["_ort"] is not None  # the check saw what loading sets
    with rt:  # and it runs again
        assert len(generate(rt, [[5, 6, 7]], 3, ignore_eos=True).rows[0].tokens) == 3


def test_torch_runtime_is_restored_by_deactivation(tiny, tiny_artifact):
    from tk.models.spec.manifest import Manifest
    from tk.toolkit.backends import torch_reference

    m = Manifest.read(tiny_artifact)
    rt = torch_reference(tiny, m.dims, m.max_context, device="auto")  # loads its decoder on activation
    loaded = unchanged_by_activation(rt)
    assert loaded["model"] is not None and loaded["buffers.device"] in ("cpu", "cuda") and rt.device == "auto"

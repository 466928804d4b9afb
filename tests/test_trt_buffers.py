"""The TensorRT runtime's device-buffer lifetimes, checked without a GPU: TensorRT and Polygraphy's
CUDA wrappers are replaced by fakes that count allocations, and every generation, parity trace,
row that leaves, and deactivation must give back what it took. (Polygraphy's DeviceArray has no
finalizer: a buffer that is dropped without free() stays allocated on the GPU.)"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import types

import numpy as np
import pytest

from tk.models.spec import contract
from tk.models.spec.engine import EngineMeta, Gpu, Limits
from tk.runtimes.backends import trt as trt_runtime
from tk.runtimes.decoding.generate import generate
from tk.toolkit.verify.metrics import run_trace


class FakeDevice:
    """What polygraphy.cuda offers tk: DeviceArray.raw / resize / copy_from / view().copy_to / free, Stream."""

    def __init__(self):
        self.live: dict[int, int] = {}  # ptr -> bytes
        self.allocated = 0
        self._ptrs = itertools.count(1 << 32, 1 << 32)  # far apart: a copy out of bounds lands in no buffer
        device = self

        class DeviceArray:
            @staticmethod
            def raw(shape):
                return DeviceArray(shape[0])

            def __init__(self, nbytes):
                self.ptr, self.nbytes = next(device._ptrs), nbytes
                device.live[self.ptr] = nbytes
                device.allocated += 1

            def resize(self, shape):
                self.nbytes = shape[0]
                device.live[self.ptr] = self.nbytes
                return self

            def copy_from(self, host, stream):
                assert host.nbytes <= self.nbytes

            def view(self, shape, dtype):
                return types.SimpleNamespace(copy_to=lambda host, stream: host.fill(0))

            def free(self):
                assert self.ptr in device.live, "a device buffer was freed twice"
                del device.live[self.ptr]

        class Stream:
            ptr = 1

            def synchronize(self):
                pass

            def free(self):
                pass

        self.module = types.SimpleNamespace(
            DeviceArray=DeviceArray, Stream=Stream, MemcpyKind=types.SimpleNamespace(DeviceToDevice=3),
            wrapper=lambda: types.SimpleNamespace(memcpy=self.memcpy))

    def memcpy(self, dst: int, src: int, n: int, kind, stream) -> None:
        """Both ranges must lie inside one live buffer each (row offsets are checked this way)."""
        for ptr in (dst, src):
            base = ptr - ptr % (1 << 32)
            assert base in self.live and ptr + n <= base + self.live[base], "a copy runs outside its buffer"


def _fake_tensorrt():
    context = types.SimpleNamespace(set_input_shape=lambda name, shape: None,
                                    set_tensor_address=lambda name, ptr: None,
                                    execute_async_v3=lambda stream: True)
    engine = types.SimpleNamespace(create_execution_context=lambda: context)

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, blob):
            return engine

    return types.SimpleNamespace(Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}),
                                 Runtime=Runtime, __version__="10.15.1")


@pytest.fixture(params=["dynamic", "static"])
def fake_trt(request, tiny_artifact, tmp_path, monkeypatch):
    """(artifact with engine.json, the fake device). The static case rewrites the manifest's variant:
    the fake engines never read the graphs."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    meta = EngineMeta(tensorrt_version="10.15.1", gpu=Gpu("fake", "9.0"), precision="float32", strongly_typed=False,
                      limits=Limits(4, 32, 64), profiles={"prefill": {}, "decode": {}}, onnx_sha256={})
    (art / contract.ENGINE_META).write_text(json.dumps(meta.to_dict()))
    for f in contract.ENGINE_FILES.values():
        (art / f).write_bytes(b"engine")
    if request.param == "static":
        manifest = json.loads((art / contract.MANIFEST).read_text())
        manifest["variant"].update(cache="static", capacity=48)
        (art / contract.MANIFEST).write_text(json.dumps(manifest))
    device = FakeDevice()
    import polygraphy

    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt())
    monkeypatch.setitem(sys.modules, "polygraphy.cuda", device.module)
    monkeypatch.setattr(polygraphy, "cuda", device.module, raising=False)
    monkeypatch.setattr(trt_runtime, "trt_environment", lambda: {})
    monkeypatch.setattr(trt_runtime, "engine_problems", lambda meta, artifact, env: [])
    monkeypatch.setattr(trt_runtime, "profile_problem", lambda *a: None)
    return art, device


def test_sessions_give_back_every_device_buffer(fake_trt):
    art, device = fake_trt
    rt = trt_runtime.TrtRuntime(art)
    with rt:
        own = len(device.live)  # the runtime's input and logits buffers
        for _ in range(3):  # before the fix every prefill kept two sets of 2 * layers buffers
            generate(rt, [[1, 2, 3], [4, 5, 6, 7, 8]], 6, ignore_eos=True)
            assert len(device.live) == own
        run_trace(rt, np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), 4)
        assert len(device.live) == own
        # a row that finishes leaves the session: its cache is copied out and the old buffers freed
        result = generate(rt, [[1, 2, 3], [4, 5]], 6, ignore_eos=True, stop=lambda row, toks: row == 0)
        assert [len(r.tokens) for r in result.rows] == [1, 6] and len(device.live) == own
        with pytest.raises(ValueError):  # an error mid-session still closes it
            with rt.start(np.array([[1, 2]]), np.ones((1, 2), np.int64))[1]:
                raise ValueError("the caller failed")
        assert len(device.live) == own
        assert device.allocated > own  # the sessions did allocate on the "GPU"
    assert device.live == {}  # deactivation frees the runtime's own


@pytest.mark.parametrize("fake_trt", ["static"], indirect=True)  # slots live in a static cache
def test_serving_slots_copy_inside_their_buffers_and_give_them_back(fake_trt):
    from tk.runtimes.base import InputError
    from tk.runtimes.serving.batching import Batcher, BatcherLimits, Request, wait_all

    art, device = fake_trt
    with pytest.raises(InputError, match="--slots 4"):
        Batcher(trt_runtime.TrtRuntime(art), limits=BatcherLimits(slots=5)).start()
    assert device.live == {}
    rt = trt_runtime.TrtRuntime(art)
    with Batcher(rt, limits=BatcherLimits(slots=3)) as batcher:
        with pytest.raises(InputError, match="longer than the trt backend's 32"):
            batcher.submit(Request(list(range(1, 34)), 2))
        requests = [batcher.submit(Request(list(range(1, 2 + i * 5)), 3 + i, ignore_eos=True)) for i in range(5)]
        assert wait_all(requests, 30)
        assert [len(r.tokens) for r in requests] == [3, 4, 5, 6, 7]
    assert device.live == {}  # the slots' buffers and the runtime's own, all given back


def test_deactivation_puts_back_what_activation_set(fake_trt):
    from test_runtime_state import unchanged_by_activation

    art, device = fake_trt
    rt = trt_runtime.TrtRuntime(art)
    loaded = unchanged_by_activation(rt)
    assert loaded["engines"] and loaded["buffers.stream"] is not None and device.live == {}
    with rt:  # and it runs again
        assert len(generate(rt, [[1, 2, 3]], 3, ignore_eos=True).rows[0].tokens) == 3

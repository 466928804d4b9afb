"""The TensorRT runtime's device-buffer lifetimes and CUDA error handling, checked without a GPU:
`cuda.bindings.runtime` (cuda-python) and `tensorrt` are replaced by fakes. cuda-python returns a
status instead of raising; the fake returns failing statuses on demand, and every generation,
parity trace, row that leaves, failed call and deactivation must give back what it took, exactly
once. (Device memory has no finalizer: a buffer dropped without cudaFree stays allocated.)"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import shutil
import sys
import types

import numpy as np
import pytest

from tk.models.spec import contract
from tk.models.spec.engine import EngineMeta, Gpu, Limits
from tk.models.spec.manifest import ArtifactError, sha256_file
from tk.runtimes.backends import trt as trt_runtime
from tk.runtimes.backends.cuda import CudaError, driver_cuda_version
from tk.runtimes.base import InputError
from tk.runtimes.decoding.generate import generate
from tk.toolkit.verify.metrics import run_trace


class cudaError_t(enum.IntEnum):  # the statuses cuda-python's calls return (cuda.bindings.runtime's names)
    cudaSuccess = 0
    cudaErrorMemoryAllocation = 2
    cudaErrorInsufficientDriver = 35
    cudaErrorIllegalAddress = 700


MESSAGES = {cudaError_t.cudaErrorMemoryAllocation: b"out of memory",
            cudaError_t.cudaErrorInsufficientDriver: b"CUDA driver version is insufficient for CUDA runtime version",
            cudaError_t.cudaErrorIllegalAddress: b"an illegal memory access was encountered"}


class FakeCudaRuntime:
    """What tk calls of cuda.bindings.runtime, with cuda-python's return convention ((status, *values))
    and bounds checks: every copy must lie inside live allocations, every free must free a live one.
    `fail(call, nth, status)` makes the nth call (0-based, counted from then on) of `call` return `status`."""

    def __init__(self):
        self.live: dict[int, int] = {}  # ptr -> bytes
        self.streams: set[int] = set()
        self.calls: dict[str, int] = {}
        self.failing: dict[str, tuple[int, cudaError_t]] = {}
        self._ptrs = itertools.count(1 << 32, 1 << 32)  # far apart: a copy out of bounds lands in no buffer
        self._streams = itertools.count(1)
        kinds = enum.IntEnum("cudaMemcpyKind", {"cudaMemcpyHostToDevice": 1, "cudaMemcpyDeviceToHost": 2,
                                                "cudaMemcpyDeviceToDevice": 3})
        self.module = types.SimpleNamespace(cudaError_t=cudaError_t, cudaMemcpyKind=kinds, **{
            name: self._counted(name, getattr(self, name)) for name in (
                "cudaMalloc", "cudaFree", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamCreate",
                "cudaStreamDestroy", "cudaStreamSynchronize", "cudaDriverGetVersion", "cudaGetDeviceProperties")},
            cudaGetErrorString=lambda err: (cudaError_t.cudaSuccess, MESSAGES[err]))

    def fail(self, call: str, nth: int, status: cudaError_t) -> None:
        self.failing[call] = (self.calls.get(call, 0) + nth, status)

    def _counted(self, name, fn):
        def call(*args):
            n = self.calls[name] = self.calls.get(name, 0) + 1
            at, status = self.failing.get(name, (None, None))
            if at is not None and n - 1 == at:
                return (status, None) if name in ("cudaMalloc", "cudaStreamCreate") else (status,)
            return fn(*args)
        return call

    def _inside(self, ptr: int, n: int) -> None:
        base = ptr - ptr % (1 << 32)
        assert base in self.live and ptr + n <= base + self.live[base], "a device access runs outside its buffer"

    def cudaMalloc(self, nbytes):
        ptr = next(self._ptrs)
        self.live[ptr] = nbytes
        return cudaError_t.cudaSuccess, ptr

    def cudaFree(self, ptr):
        assert ptr in self.live, "a device buffer was freed twice (or never allocated)"
        del self.live[ptr]
        return (cudaError_t.cudaSuccess,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        assert int(stream) in self.streams
        if kind.name != "cudaMemcpyHostToDevice":
            self._inside(src, n)
        if kind.name == "cudaMemcpyDeviceToHost":
            ctypes.memset(dst, 0, n)  # a real host pointer: the "logits" read back are zeros
        else:
            self._inside(dst, n)
        return (cudaError_t.cudaSuccess,)

    def cudaMemsetAsync(self, ptr, value, n, stream):
        self._inside(ptr, n)
        return (cudaError_t.cudaSuccess,)

    def cudaStreamCreate(self):
        stream = next(self._streams)
        self.streams.add(stream)
        return cudaError_t.cudaSuccess, stream

    def cudaStreamDestroy(self, stream):
        self.streams.remove(stream)
        return (cudaError_t.cudaSuccess,)

    def cudaStreamSynchronize(self, stream):
        assert stream in self.streams
        return (cudaError_t.cudaSuccess,)

    def cudaDriverGetVersion(self):
        return cudaError_t.cudaSuccess, 13000

    def cudaGetDeviceProperties(self, device):
        return cudaError_t.cudaSuccess, types.SimpleNamespace(name=b"Fake GPU\x00", major=9, minor=0)


def fake_tensorrt(version: str = "10.15.1", refuse_shape: bool = False):
    """TensorRT's runtime as tk uses it; set_input_shape/set_tensor_address answer True/False as the real ones."""
    context = types.SimpleNamespace(set_input_shape=lambda name, shape: not refuse_shape,
                                    set_tensor_address=lambda name, ptr: ptr != 0,
                                    execute_async_v3=lambda stream: isinstance(stream, int))
    engine = types.SimpleNamespace(create_execution_context=lambda: context)

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, blob):
            return engine

    return types.SimpleNamespace(Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}),
                                 Runtime=Runtime, __version__=version)


def install_fakes(monkeypatch, device: FakeCudaRuntime, tensorrt) -> None:
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = device.module
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", device.module)
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt)


def engine_meta(art, version: str = "10.15.1") -> EngineMeta:
    return EngineMeta(tensorrt_version=version, gpu=Gpu("Fake GPU", "9.0"), precision="float32",
                      limits=Limits(4, 32, 64), profiles={"prefill": {}, "decode": {}},
                      onnx_sha256={g: sha256_file(art / contract.GRAPH_FILES[g]) for g in contract.GRAPHS})


@pytest.fixture(params=["dynamic", "static"])
def fake_trt(request, tiny_artifact, tmp_path, monkeypatch):
    """(artifact with engine.json, the fake CUDA runtime). The static case rewrites the manifest's
    variant: the fake engines never read the graphs."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    (art / contract.ENGINE_META).write_text(json.dumps(engine_meta(art).to_dict()))
    for f in contract.ENGINE_FILES.values():
        (art / f).write_bytes(b"engine")
    if request.param == "static":
        manifest = json.loads((art / contract.MANIFEST).read_text())
        manifest["variant"].update(cache="static", capacity=48)
        (art / contract.MANIFEST).write_text(json.dumps(manifest))
    device = FakeCudaRuntime()
    install_fakes(monkeypatch, device, fake_tensorrt())
    monkeypatch.setattr(trt_runtime, "profile_problem", lambda *a: None)  # the fake engines have no profiles
    return art, device


def test_sessions_give_back_every_device_buffer(fake_trt):
    art, device = fake_trt
    rt = trt_runtime.TrtRuntime(art)
    with rt:
        generate(rt, [[1, 2, 3]], 2, ignore_eos=True)
        own = len(device.live)  # the runtime's input and logits buffers
        assert own and device.streams
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
        assert device.calls["cudaMalloc"] > own  # the sessions did allocate on the "GPU"
    assert device.live == {} and device.streams == set()  # deactivation frees the runtime's own


def _run_all(rt) -> None:
    """Prefill, decode, a row leaving (take), a parity trace: every kind of device call the backend makes."""
    with rt:
        generate(rt, [[1, 2, 3], [4, 5]], 5, ignore_eos=True, stop=lambda row, toks: row == 0 and len(toks) == 2)
        run_trace(rt, np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), 2)


@pytest.mark.parametrize("call, status, message", [
    ("cudaMalloc", cudaError_t.cudaErrorMemoryAllocation,
     r"CUDA cudaMalloc\(\d+ bytes\) failed: cudaErrorMemoryAllocation \(out of memory\)"),
    ("cudaMemcpyAsync", cudaError_t.cudaErrorIllegalAddress,
     r"CUDA cudaMemcpyAsync\((host to device|device to device|device to host), \d+ bytes\) failed: "
     r"cudaErrorIllegalAddress \(an illegal memory access was encountered\)"),
    ("cudaMemsetAsync", cudaError_t.cudaErrorIllegalAddress, r"CUDA cudaMemsetAsync\(\d+ bytes\) failed"),
    ("cudaStreamSynchronize", cudaError_t.cudaErrorIllegalAddress, r"CUDA cudaStreamSynchronize failed"),
])
def test_every_failing_cuda_call_is_one_line_and_leaks_nothing(fake_trt, call, status, message):
    """The nth call of `call` fails, for every n a full run reaches (sampled for the many copies)."""
    art, device = fake_trt
    _run_all(trt_runtime.TrtRuntime(art))
    total, seen = device.calls[call], set()
    assert total > 0 and device.live == {}
    for nth in range(0, total, max(1, total // 25)):
        device.fail(call, nth, status)
        with pytest.raises(CudaError, match=message) as e:
            _run_all(trt_runtime.TrtRuntime(art))
        assert "\n" not in str(e.value)
        seen.add(str(e.value).split(" failed")[0])
        assert device.live == {}, f"{call} failing at call {nth}: device memory left allocated"
        assert device.streams == set()
        device.failing.clear()
    if call == "cudaMemcpyAsync":  # the sweep reached all three kinds of copy
        assert {s.split("(")[1].split(",")[0] for s in seen} == {"host to device", "device to device",
                                                                  "device to host"}


def test_a_stream_that_cannot_be_created_stops_activation(fake_trt):
    art, device = fake_trt
    device.fail("cudaStreamCreate", 0, cudaError_t.cudaErrorInsufficientDriver)
    rt = trt_runtime.TrtRuntime(art)
    with pytest.raises(CudaError, match=r"^CUDA cudaStreamCreate failed: cudaErrorInsufficientDriver \(CUDA driver "
                                        r"version is insufficient for CUDA runtime version\)$"):
        rt.activate()
    assert not rt.active and device.live == {} and device.streams == set() and rt.buffers.cuda is None
    with rt:  # the next activation starts clean
        assert len(generate(rt, [[1, 2, 3]], 3, ignore_eos=True).rows[0].tokens) == 3


def test_a_refused_input_shape_is_one_clear_line(fake_trt, monkeypatch):
    art, device = fake_trt
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(refuse_shape=True))
    rt = trt_runtime.TrtRuntime(art)
    with rt:
        with pytest.raises(InputError, match=r"^prefill: TensorRT refused shape \[1, 3\] for input input_ids "
                                             r"\(the engine's profile: None to None\); .* rebuild with tk "
                                             r"build-engine .* --force$"):
            generate(rt, [[1, 2, 3]], 3, ignore_eos=True)
        assert len(device.live) == 1  # the staged input_ids: nothing of the failed session stays
    assert device.live == {}


@pytest.mark.parametrize("fake_trt", ["static"], indirect=True)  # slots live in a static cache
def test_serving_slots_copy_inside_their_buffers_and_give_them_back(fake_trt):
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
    assert device.live == {} and device.streams == set()  # the slots' buffers and the runtime's own


def test_deactivation_puts_back_what_activation_set(fake_trt):
    from test_runtime_state import unchanged_by_activation

    art, device = fake_trt
    rt = trt_runtime.TrtRuntime(art)
    loaded = unchanged_by_activation(rt)
    assert loaded["engines"] and loaded["buffers.cuda"] is not None and device.live == {}
    with rt:  # and it runs again
        assert len(generate(rt, [[1, 2, 3]], 3, ignore_eos=True).rows[0].tokens) == 3


@pytest.mark.parametrize("fake_trt", ["dynamic"], indirect=True)
@pytest.mark.parametrize("built, here, match", [
    ("10.15.1.29", "11.4.0.106", r"built with TensorRT 10\.15\.1\.29 \(major 10\) and this machine has TensorRT "
                                 r"11\.4\.0\.106 \(major 11\); plans never load across TensorRT versions"),
    ("11.4.0.106", "10.15.1.29", r"\(major 11\) and this machine has TensorRT 10\.15\.1\.29 \(major 10\)"),
    ("11.4.0.106", "11.5.0.20", r"built with TensorRT 11\.4\.0\.106 and this machine has TensorRT 11\.5\.0\.20; "
                                r"an engine loads only in the version that built it"),
])
def test_engines_of_another_tensorrt_are_refused_before_loading(fake_trt, monkeypatch, built, here, match):
    art, device = fake_trt
    (art / contract.ENGINE_META).write_text(json.dumps(engine_meta(art, built).to_dict()))
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(here))
    rt = trt_runtime.TrtRuntime(art)
    with pytest.raises(ArtifactError, match=match + f".*: rebuild them here with: tk build-engine {art} --force$"):
        rt.activate()
    assert device.calls.get("cudaStreamCreate") is None and device.live == {}  # refused before any CUDA work
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(built))
    with rt:  # the TensorRT that built them loads them
        assert len(generate(rt, [[1, 2]], 2, ignore_eos=True).rows[0].tokens) == 2


# --- tk doctor: TensorRT's wheels, cuda-python and the driver -------------------------------------

def test_driver_cuda_version_comes_from_cuda_python(monkeypatch):
    device = FakeCudaRuntime()
    install_fakes(monkeypatch, device, fake_tensorrt())
    assert driver_cuda_version() == (13, 0)
    monkeypatch.setattr(device.module, "cudaDriverGetVersion", lambda: (cudaError_t.cudaSuccess, 0))
    assert driver_cuda_version() is None  # 0: no driver installed


def test_doctor_says_when_tensorrt_cuda_python_and_the_driver_do_not_fit():
    from tk.toolkit.tools.doctor import fit_problems

    assert fit_problems("11.4.0.106", 13, (13, 0), "13.5.0") == []
    assert fit_problems("10.15.1.29", 12, (12, 8), "12.9.2") == []
    old_driver = fit_problems("11.4.0.106", 13, (12, 8), "13.5.0")
    assert old_driver[0] == (
        "TensorRT 11.4.0.106's wheels are built for CUDA 13, which needs a driver for CUDA 13.0 or newer (R580 or "
        "newer); this driver supports CUDA 12.8: update the driver; or, on this driver, pip install tensorrt-cu12 "
        "'cuda-python>=12.8,<13'")
    assert "cuda-python 13.5.0 needs a driver for CUDA 13.0 or newer" in old_driver[1] and len(old_driver) == 2
    assert fit_problems("11.4.0.106", 12, (12, 8), "13.5.0")[-1] == (
        "cuda-python 13.5.0 is for CUDA 13 and TensorRT's wheels for CUDA 12: pip install 'cuda-python>=12.8,<13'")
    assert fit_problems("12.0.0", None, (13, 0), None) == [
        "TensorRT 12.0.0 is not one tk knows (10.15 or newer, 10.x or 11.x): pip install 'tensorrt>=10.15,<12'"]
    assert len(fit_problems("10.14.1", None, None, None)) == 1


def test_doctor_reports_the_tensorrt_major_and_the_driver(monkeypatch):
    from tk.toolkit.tools import doctor

    device = FakeCudaRuntime()
    install_fakes(monkeypatch, device, fake_tensorrt("11.4.0.106"))
    versions = {"tensorrt-cu13": "11.4.0.106", "cuda-python": "13.5.0"}
    monkeypatch.setattr(doctor, "package_version", versions.get)
    report = doctor.doctor_report()
    assert report["tensorrt"] == {"available": True, "version": "11.4.0.106", "gpu": "Fake GPU",
                                  "compute_capability": "9.0", "major": 11, "wheel_cuda": 13}
    assert report["cuda_driver"] == {"available": True, "version": "13.0", "cuda_python": "13.5.0"}
    monkeypatch.setattr(device.module, "cudaDriverGetVersion", lambda: (cudaError_t.cudaSuccess, 12080))
    assert "update the driver" in doctor.doctor_report()["tensorrt"]["problems"][0]

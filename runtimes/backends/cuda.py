"""The CUDA runtime calls the TensorRT backend makes (device memory, copies, one stream), on cuda-python's
`cuda.bindings.runtime`, and the driver's CUDA version `tk doctor` reports.

cuda-python returns every call's status as the first item of a tuple instead of raising: `check`
turns a failed status into one line (`CudaError`) naming the call and CUDA's own words for it.
Nothing here frees memory on its own (no finalizers): whoever mallocs frees, exactly once, so the
buffer lifetimes stay explicit in runtimes/backends/trt.py. cuda-python is imported when a `Cuda`
is made, never at import time, so machines without it import this module freely.
"""

from __future__ import annotations

import numpy as np

from tk.runtimes.errors import BackendUnavailable, RuntimeProblem

CUDA_PYTHON_MISSING = ("cuda-python is not installed; on a machine with an NVIDIA GPU, pip install 'tk[gpu]' "
                       "(or cuda-python of the CUDA major your TensorRT wheel was built for)")


class CudaError(RuntimeProblem):
    """A CUDA runtime call failed (out of device memory, a driver too old for the runtime, a lost device)."""


def cuda_runtime():
    """cuda-python's runtime module, or BackendUnavailable saying how to install it."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        raise BackendUnavailable(CUDA_PYTHON_MISSING) from None
    return runtime


def check(rt, result: tuple, call: str):
    """What a cuda-python call returned after its status: None, the one value, or a tuple of them.
    A failed status raises CudaError naming `call`, the status's enum name and cudaGetErrorString."""
    err, *values = result
    if int(err) != 0:
        name = getattr(err, "name", None) or f"cudaError {int(err)}"
        ok, text = rt.cudaGetErrorString(err)
        text = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(f"CUDA {call} failed: {name} ({text})" if int(ok) == 0 else f"CUDA {call} failed: {name}")
    return None if not values else values[0] if len(values) == 1 else tuple(values)


class Cuda:
    """The runtime with every status checked, and the one stream every copy and engine run goes on.
    `close()` destroys the stream; the device memory a caller took stays the caller's to free."""

    def __init__(self):
        self.rt = cuda_runtime()
        kind = self.rt.cudaMemcpyKind
        self._h2d, self._d2h, self._d2d = kind.cudaMemcpyHostToDevice, kind.cudaMemcpyDeviceToHost, \
            kind.cudaMemcpyDeviceToDevice
        self.stream = check(self.rt, self.rt.cudaStreamCreate(), "cudaStreamCreate")

    @property
    def stream_handle(self) -> int:
        """The stream as the integer TensorRT's execute_async_v3 takes."""
        return int(self.stream)

    def malloc(self, nbytes: int) -> int:
        return int(check(self.rt, self.rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes} bytes)"))

    def free(self, ptr: int) -> None:
        check(self.rt, self.rt.cudaFree(ptr), "cudaFree")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device, queued on the stream."""
        check(self.rt, self.rt.cudaMemcpyAsync(dst, src, nbytes, self._d2d, self.stream),
              f"cudaMemcpyAsync(device to device, {nbytes} bytes)")

    def zero(self, ptr: int, nbytes: int) -> None:
        """Queued on the stream."""
        check(self.rt, self.rt.cudaMemsetAsync(ptr, 0, nbytes, self.stream), f"cudaMemsetAsync({nbytes} bytes)")

    def to_device(self, ptr: int, host: np.ndarray) -> None:
        """`host` (C-contiguous) into device memory at `ptr`, queued: the caller keeps `host` alive
        until the stream is synchronized."""
        check(self.rt, self.rt.cudaMemcpyAsync(ptr, host.ctypes.data, host.nbytes, self._h2d, self.stream),
              f"cudaMemcpyAsync(host to device, {host.nbytes} bytes)")

    def to_host(self, host: np.ndarray, ptr: int) -> np.ndarray:
        """Device memory at `ptr` into `host` (C-contiguous), after everything queued before it."""
        check(self.rt, self.rt.cudaMemcpyAsync(host.ctypes.data, ptr, host.nbytes, self._d2h, self.stream),
              f"cudaMemcpyAsync(device to host, {host.nbytes} bytes)")
        self.synchronize()
        return host

    def synchronize(self) -> None:
        check(self.rt, self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        check(self.rt, self.rt.cudaStreamDestroy(self.stream), "cudaStreamDestroy")


class Scratch:
    """Device memory reused across steps (an engine input, the logits), reallocated only when a step
    needs more than it has; `free()` gives it back (and leaves it empty, so twice is harmless)."""

    def __init__(self, cuda: Cuda):
        self.cuda, self.ptr, self.nbytes = cuda, 0, 0

    def fit(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            self.free()  # before the malloc: a failed malloc then leaves it empty, never holding a freed ptr
            self.ptr, self.nbytes = self.cuda.malloc(nbytes), nbytes
        return self.ptr

    def free(self) -> None:
        if self.nbytes:
            ptr, self.ptr, self.nbytes = self.ptr, 0, 0
            self.cuda.free(ptr)


def gpu() -> tuple[str, str] | None:
    """(name, compute capability) of device 0 through cuda-python; None without cuda-python or a device."""
    try:
        rt = cuda_runtime()
    except BackendUnavailable:
        return None
    err, props = rt.cudaGetDeviceProperties(0)
    if int(err) != 0:
        return None
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return name.rstrip("\x00"), f"{props.major}.{props.minor}"


def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA the installed driver supports, (major, minor): cudaDriverGetVersion through
    cuda-python, else torch's (private, CUDA builds only) reading of the same call; None when neither
    can tell or no driver is installed (CUDA reports 0 then)."""
    version = 0
    try:
        rt = cuda_runtime()
        err, version = rt.cudaDriverGetVersion()
        version = version if int(err) == 0 else 0
    except BackendUnavailable:
        try:
            import torch

            read = getattr(torch._C, "_cuda_getDriverVersion", None)
            version = read() if read else 0
        except (ImportError, RuntimeError):
            version = 0
    return (version // 1000, version % 1000 // 10) if version else None

"""TensorRT backend over an artifact's prefill.engine and decode.engine (tk build-engine).

Written against the TensorRT 10 runtime API as documented (Runtime.deserialize_cuda_engine,
IExecutionContext.set_input_shape / set_tensor_address / execute_async_v3) with Polygraphy's
CUDA wrappers (DeviceArray, Stream) for memory, so it needs no torch and no cuda-python. The KV
cache stays on the GPU between steps: each cache owns two sets of buffers sized for the engine's
maximum sequence, and every decode step writes its present into the set the past is not in.
A cache handed to `decode` is consumed (its buffers are reused for the result).

`engine_problems` (what stops an engine from loading here) and the profile check are pure and
tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from models import contract
from runtimes.base import ArtifactError, BackendUnavailable, InputError, Runtime, dims_from_manifest, read_manifest

INSTALL = f"TensorRT is not installed; {contract.TRT_INSTALL_HINT}"
_POLY_DTYPES = {"float32": "FLOAT32", "float16": "FLOAT16", "bfloat16": "BFLOAT16", "int64": "INT64"}


class EnginesMissing(ArtifactError, BackendUnavailable):
    """The artifact has no engines yet: the trt backend cannot run until tk build-engine has."""


def read_engine_meta(artifact: Path) -> dict:
    path = Path(artifact) / contract.ENGINE_META
    if not path.is_file():
        raise EnginesMissing(f"{artifact} has no TensorRT engines; build them with: tk build-engine {artifact}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); rebuild with tk build-engine") from None


def engine_problems(meta: dict, artifact: Path, env: dict) -> list[str]:
    """Every reason the engines cannot be used here, each a sentence a user can act on."""
    rebuild = f"rebuild them here with: tk build-engine {artifact} --force"
    problems = []
    if meta.get("contract_version") != contract.CONTRACT_VERSION:
        problems.append(f"the engines follow graph contract version {meta.get('contract_version')} and this tk reads "
                        f"version {contract.CONTRACT_VERSION}; re-export and {rebuild}")
    if meta.get("tensorrt_version") != env["tensorrt_version"]:
        problems.append(f"the engines were built with TensorRT {meta.get('tensorrt_version')} and this machine has "
                        f"TensorRT {env['tensorrt_version']}; an engine loads only in the version that built it: "
                        f"{rebuild}")
    gpu = meta.get("gpu", {})
    if gpu.get("compute_capability") != env["compute_capability"]:
        problems.append(f"the engines were built for {gpu.get('name')} (compute capability "
                        f"{gpu.get('compute_capability')}) and this GPU is {env['gpu_name']} (compute capability "
                        f"{env['compute_capability']}); {rebuild}")
    for graph in contract.GRAPHS:
        onnx_path = Path(artifact) / contract.GRAPH_FILES[graph]
        if onnx_path.is_file() and meta.get("onnx_sha256", {}).get(graph) != contract.sha256_file(onnx_path):
            problems.append(f"{contract.ENGINE_FILES[graph]} was built from a different {onnx_path.name} "
                            f"(the graph was re-exported since); {rebuild}")
        if not (Path(artifact) / contract.ENGINE_FILES[graph]).is_file():
            problems.append(f"{contract.ENGINE_FILES[graph]} is missing; {rebuild}")
    return problems


def profile_problem(graph: str, profile: dict, shapes: dict[str, tuple], limits: dict) -> str | None:
    """The first input shape outside the engine's optimization profile, as advice; None if all fit."""
    if graph == contract.DECODE and "attention_mask" in shapes:
        past = shapes["attention_mask"][1] - 1
        if past > limits["max_seq_len"] - 1:
            return (f"decode: past length {past} is beyond the engine's maximum {limits['max_seq_len'] - 1}; "
                    "rebuild with a larger --max-seq-len")
    for name, shape in shapes.items():
        lo, _, hi = profile[name]
        for axis, (n, a, b) in enumerate(zip(shape, lo, hi)):
            if n > b:
                flag = "--max-batch" if axis == 0 else "--max-input-len" if graph == contract.PREFILL else "--max-seq-len"
                what = "batch" if axis == 0 else f"dim {axis}"
                return f"{graph}: {name} {what} {n} is beyond the engine's maximum {b}; rebuild with a larger {flag}"
            if n < a:
                return f"{graph}: {name} has shape {list(shape)}, below the engine's minimum {lo}"
    return None


def trt_environment() -> dict:
    """TensorRT version and the GPU this process sees (needs tensorrt and cuda-python or torch)."""
    try:
        import tensorrt as trt
    except ImportError:
        raise BackendUnavailable(INSTALL) from None
    name, cc = _gpu()
    return {"tensorrt_version": trt.__version__, "gpu_name": name, "compute_capability": cc}


def _gpu() -> tuple[str, str]:
    try:
        from cuda.bindings import runtime as cudart

        err, props = cudart.cudaGetDeviceProperties(0)
        if int(err) == 0:
            name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
            return name.rstrip("\x00"), f"{props.major}.{props.minor}"
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return torch.cuda.get_device_name(0), f"{major}.{minor}"
    except ImportError:
        pass
    raise BackendUnavailable("no NVIDIA GPU is visible (checked with cuda-python and torch); TensorRT needs one")


class _Cache:
    """Two sets of device buffers per cache (ping-pong): `current` holds the past, `spare` takes the present."""

    def __init__(self, current: list, spare: list, batch: int, length: int):
        self.current, self.spare, self.batch, self.length = current, spare, batch, length


class _StaticCache:
    """One buffer per cache tensor at the engine's capacity, written in place by the decode engine."""

    def __init__(self, buffers: list, mask: np.ndarray, length: int):
        self.buffers, self.mask, self.length, self.batch = buffers, mask, length, mask.shape[0]


class TrtRuntime(Runtime):
    """Over a static-capacity artifact, decode binds each cache buffer as both the past input and the
    present output: TensorRT's KV-cache update layer (from TensorScatter) writes one position in
    place. The loop still sees the dynamic interface."""

    name = "trt"

    def __init__(self, artifact: str | Path):
        self.artifact = Path(artifact)
        self.manifest = read_manifest(self.artifact)
        has_engines = (self.artifact / contract.ENGINE_META).is_file()
        self.meta = read_engine_meta(self.artifact) if has_engines else None
        max_context = self.meta["limits"]["max_seq_len"] if self.meta else self.manifest["config"]["max_position_embeddings"]
        dims = dims_from_manifest(self.manifest)
        self.capacity = dims.kv_capacity
        super().__init__(dataclasses.replace(dims, kv_capacity=None), max_context)  # the loop sees the dynamic contract

    def _load(self) -> None:
        env = trt_environment()  # first: on a machine without TensorRT, that is what the user must fix
        if self.meta is None:
            self.meta = read_engine_meta(self.artifact)
        problems = engine_problems(self.meta, self.artifact, env)
        if problems:
            raise ArtifactError(problems[0])
        import tensorrt as trt
        from polygraphy import cuda
        from polygraphy.datatype import DataType

        self._cuda, self._dt = cuda, DataType
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self._logger)
        self.engines, self.contexts = {}, {}
        for graph in contract.GRAPHS:
            engine = runtime.deserialize_cuda_engine((self.artifact / contract.ENGINE_FILES[graph]).read_bytes())
            if engine is None:
                raise ArtifactError(f"TensorRT could not load {contract.ENGINE_FILES[graph]}; rebuild with "
                                    f"tk build-engine {self.artifact} --force")
            self.engines[graph], self.contexts[graph] = engine, engine.create_execution_context()
        self.stream = cuda.Stream()
        self.inputs = {g: cuda.DeviceArray.raw((0,))
                       for g in ("input_ids", "attention_mask", "position_ids", "write_indices")}
        self.logits = cuda.DeviceArray.raw((0,))

    def _unload(self) -> None:
        for buf in [*self.inputs.values(), self.logits]:
            buf.free()
        self.stream.free()
        self.contexts, self.engines = {}, {}

    def _kv_buffers(self, batch: int) -> list:
        d = self.dims
        nbytes = batch * d.num_kv_heads * self.meta["limits"]["max_seq_len"] * d.head_dim * contract.DTYPE_BYTES[d.kv_dtype]
        return [self._cuda.DeviceArray.raw((nbytes,)) for _ in range(2 * d.num_layers)]

    def _view(self, buf, shape, dtype: str):
        return buf.view(shape=tuple(shape), dtype=getattr(self._dt, _POLY_DTYPES[dtype]))

    def _run(self, graph: str, arrays: dict[str, np.ndarray], past: list | None, present: list,
             past_len: int | None):
        """Run one engine; `past_len` is the sequence dim of the past it reads (None: prefill)."""
        shapes = {n: a.shape for n, a in arrays.items()}
        B = arrays["input_ids"].shape[0]
        if past is not None:
            shapes.update({n: (B, self.dims.num_kv_heads, past_len, self.dims.head_dim)
                           for n in self.past_names})
        problem = profile_problem(graph, self.meta["profiles"][graph], shapes, self.meta["limits"])
        if problem:
            raise InputError(problem)
        ctx = self.contexts[graph]
        for name, array in arrays.items():
            buf = self.inputs[name].resize((array.nbytes,))
            buf.copy_from(np.ascontiguousarray(array).view(np.uint8).reshape(-1), self.stream)
            ctx.set_input_shape(name, array.shape)
            ctx.set_tensor_address(name, buf.ptr)
        for name, buf in zip(self.past_names, past or []):
            ctx.set_input_shape(name, shapes[name])
            ctx.set_tensor_address(name, buf.ptr)
        S = arrays["input_ids"].shape[1]
        if graph == contract.PREFILL and self.dims.prefill_logits == "last":
            S = 1
        logits_shape = (B, S, self.dims.vocab_size)
        self.logits.resize((int(np.prod(logits_shape)) * 4,))
        ctx.set_tensor_address("logits", self.logits.ptr)
        for name, buf in zip(self.present_names, present):
            ctx.set_tensor_address(name, buf.ptr)
        if not ctx.execute_async_v3(self.stream.ptr):
            raise InputError(f"{graph}: TensorRT failed to run the engine for inputs {shapes}")
        host = np.empty(logits_shape, dtype=np.float32)
        self._view(self.logits, logits_shape, "float32").copy_to(host, self.stream)
        self.stream.synchronize()
        return host

    def _prefill(self, input_ids, attention_mask, position_ids):
        B, S = input_ids.shape
        cache = _Cache(self._kv_buffers(B), self._kv_buffers(B), B, S)
        logits = self._run(contract.PREFILL, {"input_ids": input_ids, "attention_mask": attention_mask,
                                              "position_ids": position_ids}, None, cache.current, None)
        if self.capacity is None:
            return logits, cache
        if S >= self.capacity:
            raise InputError(f"prefill: {S} tokens leave no room in the static cache of {self.capacity}; "
                             "export with a larger --max-seq-len")
        self._widen(cache.current, cache.spare, B, S)  # (B, H, S, D) rows into (B, H, capacity, D) buffers
        for buf in cache.current:
            buf.free()
        mask = np.zeros((B, self.capacity), np.int64)
        mask[:, :S] = attention_mask
        return logits, _StaticCache(cache.spare, mask, S)

    def _widen(self, src: list, dst: list, batch: int, length: int) -> None:
        d = self.dims
        row = length * d.head_dim * contract.DTYPE_BYTES[d.kv_dtype]
        stride = self.capacity * d.head_dim * contract.DTYPE_BYTES[d.kv_dtype]
        copy, kind = self._cuda.wrapper().memcpy, self._cuda.MemcpyKind.DeviceToDevice
        for s, t in zip(src, dst):
            for bh in range(batch * d.num_kv_heads):
                copy(t.ptr + bh * stride, s.ptr + bh * row, row, kind, self.stream.ptr)

    def _decode(self, input_ids, attention_mask, position_ids, cache):
        if self.capacity is None:
            logits = self._run(contract.DECODE, {"input_ids": input_ids, "attention_mask": attention_mask,
                                                 "position_ids": position_ids}, cache.current, cache.spare,
                               cache.length)
            cache.current, cache.spare = cache.spare, cache.current
            cache.length += 1
            return logits, cache
        if cache.length >= self.capacity:
            raise InputError(f"decode: the static cache holds {self.capacity} positions and is full; "
                             "export with a larger --max-seq-len")
        cache.mask[:, cache.length] = attention_mask[:, -1]
        arrays = {"input_ids": input_ids, "attention_mask": cache.mask, "position_ids": position_ids,
                  "write_indices": np.full((cache.batch,), cache.length, dtype=np.int64)}
        logits = self._run(contract.DECODE, arrays, cache.buffers, cache.buffers, self.capacity)  # in place
        cache.length += 1
        return logits, cache

    def _buffers(self, cache) -> list:
        return cache.buffers if isinstance(cache, _StaticCache) else cache.current

    def cache_feed(self, cache):
        return (cache.batch, self.dims.num_kv_heads, cache.length, self.dims.head_dim), self.dims.kv_dtype

    def cache_arrays(self, cache):
        d = self.dims
        seq = self.capacity if isinstance(cache, _StaticCache) else cache.length  # the buffer's layout
        shape = (cache.batch, d.num_kv_heads, seq, d.head_dim)
        out = []
        for buf in self._buffers(cache):
            raw = np.empty(int(np.prod(shape)) * contract.DTYPE_BYTES[d.kv_dtype], dtype=np.uint8)
            buf.view(shape=(raw.size,), dtype=self._dt.UINT8).copy_to(raw, self.stream)
            self.stream.synchronize()
            out.append(_to_float32(raw, d.kv_dtype).reshape(shape)[:, :, : cache.length])
        return out


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # numpy has no bfloat16: widen the 16 bits into a float32's high half
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.dtype(dtype)).astype(np.float32)

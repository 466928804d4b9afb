"""TensorRT backend over an artifact's prefill.engine and decode.engine (tk build-engine).

Written against the TensorRT 10.15+ and 11.x runtime API (Runtime.deserialize_cuda_engine,
IExecutionContext.set_input_shape / set_tensor_address / execute_async_v3, the same in both), with
device memory, copies and the stream from cuda-python (runtimes/backends/cuda.py), so it needs no
torch. set_input_shape and set_tensor_address return False rather than raise: each is checked. The
KV cache stays on the GPU between steps. With the dynamic layout each session owns two sets of
buffers sized for the engine's maximum sequence (ping-pong: a decode step writes its present
into the set the past is not in); with the static layout one set at the capacity, written in
place. Device memory has no finalizer here, so every buffer is freed explicitly: when a session
closes or its rows are taken, the runtime's own at deactivation, and what a failed step or copy
had allocated before it raises.

`engine_problems` (what stops an engine from loading here) and the profile check are pure and
tested without a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tk.models.spec import contract
from tk.models.spec.engine import EngineMeta, Limits, tensorrt_major
from tk.models.spec.manifest import ArtifactError, Manifest, sha256_file
from tk.models.spec.dtypes import DTYPES
from tk.models.spec.errors import TRT_MISSING
from tk.runtimes.backends.cuda import Cuda, Scratch, gpu
from tk.runtimes.base import ArtifactRuntime, BackendUnavailable, CacheBuffers, InputError, StepOutput


class EnginesMissing(ArtifactError, BackendUnavailable):
    """The artifact has no engines yet: the trt backend cannot run until tk build-engine has."""


def read_engine_meta(artifact: Path) -> EngineMeta:
    path = Path(artifact) / contract.ENGINE_META
    if not path.is_file():
        raise EnginesMissing(f"{artifact} has no TensorRT engines; build them with: tk build-engine {artifact}")
    try:
        return EngineMeta.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); rebuild with tk build-engine") from None
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{path} is not an engine.json this tk can read ({type(e).__name__}: {e}); rebuild "
                            "with tk build-engine") from None


def engine_problems(meta: EngineMeta, artifact: Path, env: dict) -> list[str]:
    """Every reason the engines cannot be used here, each a sentence a user can act on."""
    rebuild = f"rebuild them here with: tk build-engine {artifact} --force"
    problems = []
    if meta.contract_version not in contract.READS:
        problems.append(f"the engines follow graph contract version {meta.contract_version} and this tk reads "
                        f"version {contract.CONTRACT_VERSION}; re-export and {rebuild}")
    built, here = meta.tensorrt_major, tensorrt_major(env["tensorrt_version"])
    if built != here:
        problems.append(f"the engines were built with TensorRT {meta.tensorrt_version} (major {built}) and this "
                        f"machine has TensorRT {env['tensorrt_version']} (major {here}); plans never load across "
                        f"TensorRT versions: {rebuild}")
    elif meta.tensorrt_version != env["tensorrt_version"]:
        problems.append(f"the engines were built with TensorRT {meta.tensorrt_version} and this machine has "
                        f"TensorRT {env['tensorrt_version']}; an engine loads only in the version that built it: "
                        f"{rebuild}")
    if meta.gpu.compute_capability != env["compute_capability"]:
        problems.append(f"the engines were built for {meta.gpu.name} (compute capability "
                        f"{meta.gpu.compute_capability}) and this GPU is {env['gpu_name']} (compute capability "
                        f"{env['compute_capability']}); {rebuild}")
    for graph in contract.GRAPHS:
        onnx_path = Path(artifact) / contract.GRAPH_FILES[graph]
        engine = Path(artifact) / contract.ENGINE_FILES[graph]
        if onnx_path.is_file() and meta.onnx_sha256.get(graph) != sha256_file(onnx_path):
            problems.append(f"{engine.name} was built from a different {onnx_path.name} "
                            f"(the graph was re-exported since); {rebuild}")
        if not engine.is_file():
            problems.append(f"{engine.name} is missing; {rebuild}")
        elif meta.engine_sha256 is not None and meta.engine_sha256.get(graph) != sha256_file(engine):
            problems.append(f"{engine.name} is not the engine {contract.ENGINE_META} was written with (a rebuild "
                            f"did not finish, or it was replaced); {rebuild}")
    return problems


def profile_problem(graph: str, profile: dict, shapes: dict[str, tuple], limits: Limits) -> str | None:
    """The first input shape outside the engine's optimization profile, as advice; None if all fit."""
    if graph == contract.DECODE and "attention_mask" in shapes:
        past = shapes["attention_mask"][1] - 1
        if past > limits.max_seq_len - 1:
            return (f"decode: past length {past} is beyond the engine's maximum {limits.max_seq_len - 1}; "
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
        raise BackendUnavailable(TRT_MISSING) from None
    name, cc = _gpu()
    return {"tensorrt_version": trt.__version__, "gpu_name": name, "compute_capability": cc}


def _gpu() -> tuple[str, str]:
    found = gpu()
    if found:
        return found
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return torch.cuda.get_device_name(0), f"{major}.{minor}"
    except ImportError:
        pass
    raise BackendUnavailable("no NVIDIA GPU is visible (checked with cuda-python and torch); TensorRT needs one")


class _Buffer:
    """Device memory at `ptr` (cudaMalloc'd by TrtBuffers) and the dense (B, H, S, D) tensor of `dtype`
    it holds now; it has room for `room` positions per row (what it was allocated for)."""

    def __init__(self, ptr: int, shape: tuple, room: int, dtype: str):
        self.ptr, self.shape, self.room, self.dtype = ptr, shape, room, dtype

    @property
    def item(self) -> int:
        return int(DTYPES[self.dtype].bytes)


class TrtBuffers(CacheBuffers):
    """A cache in device memory (`_Buffer`s), copied on the device. Nothing frees device memory on its
    own: every buffer is freed here explicitly, also what a failed allocation or copy had taken.
    `cuda` (runtimes/backends/cuda.py: the checked CUDA calls and the stream every copy runs on) is
    set while the runtime is loaded."""

    row_slices = False  # its buffers view their leading rows only

    def __init__(self):
        self.cuda: Cuda | None = None

    def alloc(self, shape, dtype, room: int | None = None):
        room = shape[2] if room is None else room
        nbytes = shape[0] * shape[1] * room * shape[3] * int(DTYPES[dtype].bytes)
        ptr = self.cuda.malloc(nbytes)
        try:  # zeroed, as CacheBuffers promises: attention reads a static cache's unwritten (masked)
            self.cuda.zero(ptr, nbytes)  # positions too, and 0 * a NaN left in the memory is NaN
        except BaseException:
            self.cuda.free(ptr)
            raise
        return _Buffer(ptr, tuple(shape), room, dtype)

    def alloc_all(self, specs: list[tuple]) -> list[_Buffer]:
        """alloc(*spec) for each spec; if one fails, those already made are freed before it raises."""
        out = []
        try:
            for spec in specs:
                out.append(self.alloc(*spec))
        except BaseException:
            self.release(out)
            raise
        return out

    def release(self, buffers) -> None:
        for buf in buffers or []:
            self.cuda.free(buf.ptr)

    def copy_positions(self, dst: _Buffer, src: _Buffer, count: int, dst_row: int | None = None,
                       src_row: int | None = None, src_at: int = 0, dst_at: int = 0) -> None:
        """`count` positions of `src` (laid out with src.shape's stride) from src_at into `dst` from dst_at,
        on the device: every row, or src's row src_row into dst's row dst_row."""
        d = src.shape[3] * src.item  # bytes per position
        heads = src.shape[1]
        rows = range(src.shape[0]) if src_row is None else [src_row]
        for i, r in enumerate(rows):
            to = i if dst_row is None else dst_row
            for h in range(heads):
                self.cuda.copy(dst.ptr + ((to * heads + h) * dst.shape[2] + dst_at) * d,
                               src.ptr + ((r * heads + h) * src.shape[2] + src_at) * d, count * d)

    def leading(self, buf: _Buffer, n: int) -> _Buffer:
        """A view of the first n rows (same device memory; never released on its own)."""
        return _Buffer(buf.ptr, (n,) + tuple(buf.shape[1:]), buf.room, buf.dtype)

    def to_numpy(self, buf: _Buffer) -> np.ndarray:
        raw = self.cuda.to_host(np.empty(int(np.prod(buf.shape)) * buf.item, dtype=np.uint8), buf.ptr)
        return _to_float32(raw, buf.dtype).reshape(buf.shape)

    def take(self, buffers, rows):
        """Rows of a session's cache, copied on the device into new buffers; the old ones are freed
        (only once every copy is queued: if one fails, the session still owns them and the new are freed)."""
        out = self.alloc_all([((len(rows),) + buf.shape[1:], buf.dtype, buf.room) for buf in buffers])
        try:
            for buf, new in zip(buffers, out):
                per_row = int(np.prod(buf.shape[1:])) * buf.item
                for i, r in enumerate(rows):
                    self.cuda.copy(new.ptr + i * per_row, buf.ptr + int(r) * per_row, per_row)
        except BaseException:
            self.release(out)
            raise
        self.release(buffers)
        return out


class TrtRuntime(ArtifactRuntime):
    name = "trt"

    def __init__(self, artifact: str | Path, manifest: Manifest | None = None):
        has_engines = (Path(artifact) / contract.ENGINE_META).is_file()
        self.meta = read_engine_meta(artifact) if has_engines else None
        max_context = self.meta.limits.max_seq_len if self.meta else None  # None: the manifest's
        super().__init__(artifact, manifest, max_context=max_context, buffers=TrtBuffers())
        if self.meta:  # the limits the engines were built for bound what serving's slots may run
            self.max_batch = self.meta.limits.max_batch
            self.max_prompt = self.meta.limits.max_input_len

    def _at_rest(self) -> None:
        self._logger = self.logits = None
        self.engines, self.contexts, self.inputs = {}, {}, {}
        self.buffers.cuda = None

    def _load(self) -> None:
        env = trt_environment()  # first: on a machine without TensorRT, that is what the user must fix
        if self.meta is None:  # no engines when this runtime was made (its limits come from them)
            read_engine_meta(self.artifact)  # EnginesMissing, while they still are
            raise ArtifactError(f"the engines of {self.artifact} were built after this runtime was opened; "
                                "open it again")
        problems = engine_problems(self.meta, self.artifact, env)
        if problems:
            raise ArtifactError(problems[0])
        import tensorrt as trt

        cuda = self.buffers.cuda = Cuda()  # the stream; nothing is allocated until a step needs it
        self.inputs = {name: Scratch(cuda) for name in ("input_ids", "attention_mask", "position_ids", "write_indices",
                                                         "logits_to_keep")}
        self.logits = Scratch(cuda)
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self._logger)
        for graph in contract.GRAPHS:
            engine = runtime.deserialize_cuda_engine((self.artifact / contract.ENGINE_FILES[graph]).read_bytes())
            if engine is None:
                raise ArtifactError(f"TensorRT could not load {contract.ENGINE_FILES[graph]}; rebuild with "
                                    f"tk build-engine {self.artifact} --force")
            self.engines[graph], self.contexts[graph] = engine, engine.create_execution_context()

    def _unload(self) -> None:
        try:  # also after a load that failed half way: only what it had made is there to free
            for buf in [*self.inputs.values(), self.logits]:
                if buf is not None:
                    buf.free()
            if self.buffers.cuda is not None:
                self.buffers.cuda.close()
        finally:
            self._at_rest()

    def _seq_buffers(self, batch: int) -> list[_Buffer]:
        """A set of cache buffers a dynamic-layout session grows into (the engine's longest sequence)."""
        d, room = self.dims, self.meta.limits.max_seq_len
        return self.buffers.alloc_all([((batch, heads, 0, head_dim), d.kv_dtype, room) for heads, head_dim in self._kv_shapes])

    @property
    def _kv_shapes(self) -> list[tuple[int, int]]:
        """Per cache tensor (contract order), its layer's (kv heads, head dim)."""
        return [self.dims.kv_shape(i) for i, _ in self.dims.cache_kinds()]

    def release_session_state(self, session) -> None:
        self.buffers.release(session.backend)  # the spare set of a dynamic session's ping-pong (Session.backend)

    # --- running an engine ---

    def run(self, graph, feeds, past, session, in_place=False):
        B = feeds["input_ids"].shape[0]
        if graph == contract.PREFILL:
            present = self._seq_buffers(B)
            past_len = None
        elif in_place:
            present, past_len = past, None  # each buffer's own positions (a ring's are fewer)
        else:
            present, session.backend = session.backend or self._seq_buffers(B), None
            past_len = session.length - 1
        try:
            logits = self._execute(graph, feeds, past, present, past_len)
        except BaseException:
            if present is not past:
                self.buffers.release(present)
            raise
        if not in_place:  # what the engine wrote: dense (B, H, T, D)
            T = feeds["input_ids"].shape[1] if past_len is None else past_len + 1
            for buf, (heads, head_dim) in zip(present, self._kv_shapes):
                buf.shape = (B, heads, T, head_dim)
        if graph == contract.DECODE and not in_place:
            session.backend = past  # ping-pong: the next step writes where this past was
        return StepOutput(logits), present

    def _execute(self, graph: str, arrays: dict[str, np.ndarray], past: list | None, present: list,
                 past_len: int | None) -> np.ndarray:
        """Run one engine; `past_len` is the sequence dim of the past it reads (None: prefill, or a
        static cache, whose buffers each have their own)."""
        shapes = {n: a.shape for n, a in arrays.items()}
        B = arrays["input_ids"].shape[0]
        if past is not None:
            shapes.update({n: (B, heads, past_len if past_len is not None else buf.shape[2], head_dim)
                           for n, buf, (heads, head_dim) in zip(self.past_names, past, self._kv_shapes)})
        problem = profile_problem(graph, self.meta.profiles[graph], shapes, self.meta.limits)
        if problem:
            raise InputError(problem)
        ctx, cuda = self.contexts[graph], self.buffers.cuda
        staged = [np.ascontiguousarray(a) for a in arrays.values()]  # alive until to_host's synchronize
        for name, host in zip(arrays, staged):
            ptr = self.inputs[name].fit(host.nbytes)
            cuda.to_device(ptr, host)
            self._bind(graph, name, ptr, host.shape)
        for name, buf in zip(self.past_names, past or []):
            self._bind(graph, name, buf.ptr, shapes[name])
        S = arrays["input_ids"].shape[1]
        if graph == contract.PREFILL and self.dims.variant.prefill_logits == "last":
            S = 1
        elif "logits_to_keep" in arrays:  # the decode graph returns the positions it names
            S = arrays["logits_to_keep"].shape[0]
        host = np.empty((B, S, self.dims.vocab_size), dtype=np.float32)
        self._bind(graph, "logits", self.logits.fit(host.nbytes))
        for name, buf in zip(self.present_names, present):
            self._bind(graph, name, buf.ptr)
        if not ctx.execute_async_v3(cuda.stream_handle):
            raise InputError(f"{graph}: TensorRT failed to run the engine for inputs {shapes}")
        return cuda.to_host(host, self.logits.ptr)

    def _bind(self, graph: str, name: str, ptr: int, shape: tuple | None = None) -> None:
        """Set an input's shape (when given) and a tensor's address; TensorRT answers False, not an
        exception, when it refuses either."""
        ctx, rebuild = self.contexts[graph], f"rebuild with tk build-engine {self.artifact} --force"
        if shape is not None and not ctx.set_input_shape(name, tuple(shape)):
            lo, _, hi = self.meta.profiles[graph].get(name, (None, None, None))
            raise InputError(f"{graph}: TensorRT refused shape {list(shape)} for input {name} (the engine's profile: "
                             f"{lo} to {hi}); if engine.json does not describe this engine, {rebuild}")
        if not ctx.set_tensor_address(name, ptr):
            raise ArtifactError(f"{graph}: TensorRT refused the device address of {name} (the engine has no "
                                f"such tensor, or another layout than this artifact's manifest); {rebuild}")


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # numpy has no bfloat16: widen the 16 bits into a float32's high half
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.dtype(dtype)).astype(np.float32)

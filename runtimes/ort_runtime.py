"""ONNX Runtime backend over an artifact's prefill.onnx and decode.onnx.

Uses the CUDA execution provider when onnxruntime-gpu and a GPU are present, else CPU. Runs with
IO binding: the present cache comes back as OrtValues that are bound straight into the next
decode step, so the loop never copies the cache through numpy.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from models import contract
from runtimes import hugepages
from runtimes.base import (ArtifactError, BackendUnavailable, InputError, Runtime, dims_from_manifest, dtype_name,
                           read_manifest)

_ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
               "tensor(int64)": "int64"}


def verify_graph_files(artifact: Path, manifest: dict) -> dict[str, Path]:
    """Graph paths by name, after checking each exists and matches the manifest's sha256."""
    paths = {}
    for graph in contract.GRAPHS:
        entry = manifest["graphs"][graph]
        path = artifact / entry["file"]
        if not path.is_file():
            raise ArtifactError(f"{artifact} is missing {entry['file']}; re-export the artifact")
        if contract.sha256_file(path) != entry["sha256"]:
            raise ArtifactError(f"{path} does not match the sha256 in {contract.MANIFEST}; it was changed "
                                "after export: re-export the artifact")
        data = artifact / entry["data_file"] if entry.get("data_file") else None
        if data is not None and (not data.is_file() or data.stat().st_size != entry["data_bytes"]):
            raise ArtifactError(f"{data} is missing or has the wrong size; re-export the artifact")
        paths[graph] = path
    return paths


_SHARED_POOL: dict = {"wanted": False, "threads": None}  # ORT's own process-wide state, mirrored


def use_shared_thread_pool() -> None:
    """Run every tk ORT session of this process on ORT's process-wide thread pool, sized by the
    first runtime's thread count. Call it before any ORT session exists, and only in a process
    where every ORT session is tk's: ORT then refuses sessions that keep a pool of their own."""
    _SHARED_POOL["wanted"] = True


class OrtRuntime(Runtime):
    name = "ort"

    def __init__(self, artifact: str | Path, threads: int | None = None, provider: str = "auto",
                 profile: bool = False, huge_pages: bool = True):
        self.artifact = Path(artifact)
        self.manifest = read_manifest(self.artifact)
        super().__init__(dims_from_manifest(self.manifest), self.manifest["config"]["max_position_embeddings"])
        self.threads, self.provider, self.profile, self.huge_pages = threads, provider, profile, huge_pages
        self.huge_page_bytes = 0  # how much of what the sessions allocated now sits on huge pages

    def _load(self) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise BackendUnavailable("onnxruntime is not installed; pip install onnxruntime "
                                     "(or onnxruntime-gpu on a machine with an NVIDIA GPU)") from None
        paths = verify_graph_files(self.artifact, self.manifest)
        available = ort.get_available_providers()
        if self.provider == "cuda" and "CUDAExecutionProvider" not in available:
            raise BackendUnavailable("ONNX Runtime has no CUDA provider here; pip install onnxruntime-gpu "
                                     "on a machine with an NVIDIA GPU, or use --provider cpu")
        use_cuda = self.provider != "cpu" and "CUDAExecutionProvider" in available
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if use_cuda else ["CPUExecutionProvider"]
        self.device = "cuda" if use_cuda else "cpu"
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        # Prefill and decode each have a session. With a thread pool each, the spinning threads of
        # one steal the cores the other needs (55M model, 2 cores: time to first token 57 ms).
        # Without spinning: 30 ms. Sharing ORT's process-wide pool is faster still (28 ms, and
        # decode 3.8 instead of 4.1 ms/token) but binds every ORT session in the process to it,
        # so only a process that is tk's own opts in (the tk command does).
        if _SHARED_POOL["wanted"]:
            if _SHARED_POOL["threads"] is None:
                ort.set_global_thread_pool_sizes(self.threads or 0, 1)  # 0: ORT chooses
                _SHARED_POOL["threads"] = self.threads or 0
            opts.use_per_session_threads = False
        else:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            if self.threads:
                opts.intra_op_num_threads = self.threads
        if self.profile:  # ORT's own trace of every run and kernel (tk bench --profile)
            opts.enable_profiling = True
            opts.profile_file_prefix = str(Path(tempfile.gettempdir()) / "tk-ort-profile")
        before = hugepages.anonymous_regions() if self.huge_pages and not use_cuda else None
        try:
            self.sessions = {g: ort.InferenceSession(str(p), opts, providers=providers) for g, p in paths.items()}
        except Exception as e:  # ORT raises its own pybind types (NotImplemented, Fail, ...)
            kernel = "NOT_IMPLEMENTED" in str(e)
            hint = (f"ONNX Runtime's {self.device.upper()} provider lacks a kernel this {self.dims.kv_dtype} graph "
                    "needs" if kernel else "ONNX Runtime could not load the graphs")
            raise BackendUnavailable(f"{hint}: {str(e).split(' : ')[-1].strip()}") from None
        self.output_names = {g: [o.name for o in s.get_outputs()] for g, s in self.sessions.items()}
        if before is not None:  # the prepacked weights: a decode step streams them all (runtimes/hugepages.py)
            new = hugepages.mapped_since(before, hugepages.anonymous_regions())
            self.huge_page_bytes = hugepages.back_with_huge_pages(new)

    def end_profiling(self) -> dict[str, Path]:
        """Stop ORT's profiler; the trace file of each graph's session."""
        return {g: Path(s.end_profiling()) for g, s in self.sessions.items()}

    def _unload(self) -> None:
        self.sessions = {}

    def _run(self, graph: str, arrays: dict[str, np.ndarray], cache: list | None = None):
        session = self.sessions[graph]
        binding = session.io_binding()
        for name, value in arrays.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name, value in zip(self.past_names, cache or []):
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names[graph]:
            binding.bind_output(name, self.device)
        session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        n_kv = 2 * self.dims.num_layers
        self.hidden = [h.numpy() for h in outs[1 + n_kv:]] or None  # debug exports only
        return outs[0].numpy(), list(outs[1 : 1 + n_kv])

    def _prefill(self, input_ids, attention_mask, position_ids):
        return self._run(contract.PREFILL, {"input_ids": input_ids, "attention_mask": attention_mask,
                                            "position_ids": position_ids})

    def _decode(self, input_ids, attention_mask, position_ids, cache):
        return self._run(contract.DECODE, {"input_ids": input_ids, "attention_mask": attention_mask,
                                           "position_ids": position_ids}, cache)

    def cache_feed(self, cache):
        return tuple(cache[0].shape()), _ORT_DTYPES.get(cache[0].data_type(), cache[0].data_type())

    def cache_arrays(self, cache):
        return [v.numpy().astype(np.float32) for v in cache]


class _StaticCache:
    """A static-capacity cache and the binding that updates it in place, one per generation."""

    def __init__(self, arrays: list[np.ndarray], values: list, mask: np.ndarray, length: int):
        self.arrays, self.values, self.mask, self.length = arrays, values, mask, length
        B = mask.shape[0]
        self.ids = np.zeros((B, 1), np.int64)
        self.pos = np.zeros((B, 1), np.int64)
        self.write = np.zeros((B,), np.int64)
        self.binding = None
        self.logits = None


class OrtStaticRuntime(OrtRuntime):
    """ONNX Runtime over a static-capacity artifact (tk export --kv-cache static).

    Prefill runs the ordinary graph; its present is copied once into buffers of the exported
    capacity. Each decode step then binds those buffers as both past input and present output,
    so TensorScatter writes the new position in place: no cache copy per step, and the step's
    cost does not grow with the past. Inputs are numpy arrays bound once and rewritten in place.
    The interface stays the dynamic one: the loop passes the growing mask as usual.
    """

    def __init__(self, artifact: str | Path, threads: int | None = None, provider: str = "auto",
                 profile: bool = False, huge_pages: bool = True):
        super().__init__(artifact, threads, provider, profile, huge_pages)
        self.graph_dims = self.dims
        self.capacity = self.dims.kv_capacity
        self.dims = dataclasses.replace(self.dims, kv_capacity=None)  # what the loop sees: the dynamic contract
        self.max_context = self.capacity

    def _load(self) -> None:
        super()._load()
        if self.device != "cpu":
            raise BackendUnavailable("static-capacity artifacts run on ONNX Runtime's CPU provider only for now; "
                                     "use --provider cpu or export without --kv-cache static")
        import onnxruntime as ort

        self._ortvalue = ort.OrtValue.ortvalue_from_numpy  # on CPU the OrtValue shares the array's memory

    def _prefill(self, input_ids, attention_mask, position_ids):
        logits, present = super()._prefill(input_ids, attention_mask, position_ids)
        B, T = input_ids.shape
        if T >= self.capacity:
            raise InputError(f"prefill: {T} tokens leave no room in the static cache of {self.capacity}; "
                             "export with a larger --max-seq-len")
        arrays = []
        for value in present:
            src = value.numpy()
            buf = np.zeros(src.shape[:2] + (self.capacity,) + src.shape[3:], dtype=src.dtype)
            buf[:, :, :T] = src
            arrays.append(buf)
        mask = np.zeros((B, self.capacity), np.int64)
        mask[:, :T] = attention_mask
        cache = _StaticCache(arrays, [self._ortvalue(a) for a in arrays], mask, T)
        self._bind(cache)
        return logits, cache

    def _bind(self, cache: _StaticCache) -> None:
        binding = self.sessions[contract.DECODE].io_binding()
        cache.logits = np.zeros((cache.mask.shape[0], 1, self.dims.vocab_size), np.float32)
        for name, array in (("input_ids", cache.ids), ("attention_mask", cache.mask), ("position_ids", cache.pos),
                            ("write_indices", cache.write)):
            binding.bind_ortvalue_input(name, self._ortvalue(array))
        binding.bind_ortvalue_output("logits", self._ortvalue(cache.logits))
        for past, present, value in zip(self.past_names, self.present_names, cache.values):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)  # the same buffer: updated in place
        cache.binding = binding

    def _decode(self, input_ids, attention_mask, position_ids, cache: _StaticCache):
        if cache.length >= self.capacity:
            raise InputError(f"decode: the static cache holds {self.capacity} positions and is full; "
                             "export with a larger --max-seq-len")
        cache.ids[:] = input_ids
        cache.pos[:] = position_ids
        cache.write[:] = cache.length
        cache.mask[:, cache.length] = attention_mask[:, -1]
        self.sessions[contract.DECODE].run_with_iobinding(cache.binding)
        cache.length += 1
        return cache.logits.copy(), cache

    def cache_feed(self, cache: _StaticCache):
        shape = cache.arrays[0].shape[:2] + (cache.length,) + cache.arrays[0].shape[3:]
        return shape, dtype_name(cache.arrays[0].dtype)

    def cache_arrays(self, cache: _StaticCache):
        return [a[:, :, : cache.length].astype(np.float32) for a in cache.arrays]


def open_ort(artifact: str | Path, threads: int | None = None, provider: str = "auto",
             profile: bool = False, huge_pages: bool = True) -> OrtRuntime:
    """The ORT runtime for an artifact, static-capacity or not."""
    static = read_manifest(Path(artifact))["dims"].get("kv_capacity") is not None
    return (OrtStaticRuntime if static else OrtRuntime)(artifact, threads, provider, profile, huge_pages)

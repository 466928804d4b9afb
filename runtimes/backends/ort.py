"""ONNX Runtime backend over an artifact's prefill.onnx and decode.onnx.

`provider` "auto" takes the CUDA execution provider when onnxruntime-gpu and a GPU are present,
"cpu" or "cuda" insist. Runs with IO binding: the present cache comes back as OrtValues bound
straight into the next decode step, so the loop never copies the cache through numpy. Over a
static-capacity artifact the cache buffers are bound as both past input and present output
once per session, so TensorScatter writes each new position in place (on the CPU provider the
buffers are tk's own numpy arrays; on CUDA, device OrtValues). Where the decode graph also
prefills (dims.decode_prefills) and is the fused one (--target ort), the CPU provider loads
decode.onnx alone (`prefill_via` "decode"): one session, one packed copy of the weights, prompts
run through it row by row. A portable decode graph that prefills takes the rest of a prompt part
way in (serving's chunks and cached prefixes: runtimes/serving/slots.py); whole prompts go through prefill.onnx.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from tk.models.spec import contract
from tk.models.spec.manifest import Manifest
from tk.models.spec.dtypes import DTYPES
from tk.runtimes.backends import hugepages
from tk.runtimes.base import BackendUnavailable, artifact_identity, PrefillVia, Runtime, StepOutput

_SHARED_POOL: dict = {"wanted": False, "threads": None}  # ORT's own process-wide state, mirrored


QUANT_COMPUTE = {"int8": "4", "float": "1"}  # MatMulNBits accuracy level of each
QUANTIZED_SUFFIXES = (".quant", ".scale")  # a quantized weight's initializers (exporters/weights.py)
BINDINGS_PER_BATCH = 4  # logits arrays a static session's steps rotate through (_run_in_place)


def session_options(ort, threads: int | None = None, spin: bool = False):
    """SessionOptions for a tk session: full graph optimization, quiet, and on the process-wide
    pool when the process opted in (use_shared_thread_pool), else on a pool of its own, whose
    threads spin between kernels only with `spin` (a runtime with one session: no other pool's
    threads to take the cores from)."""
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
            ort.set_global_thread_pool_sizes(threads or 0, 1)  # 0: ORT chooses
            _SHARED_POOL["threads"] = threads or 0
        opts.use_per_session_threads = False
    else:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        if threads:
            opts.intra_op_num_threads = threads
    return opts


def use_shared_thread_pool() -> None:
    """Run every tk ORT session of this process on ORT's process-wide thread pool, sized by the
    first runtime's thread count. Call it before any ORT session exists, and only in a process
    where every ORT session is tk's: ORT then refuses sessions that keep a pool of their own."""
    _SHARED_POOL["wanted"] = True


class OrtRuntime(Runtime):
    name = "ort"

    def __init__(self, artifact: str | Path, threads: int | None = None, provider: str = "auto",
                 profile: bool = False, huge_pages: bool = True, prepack: bool = False, swap_sessions: bool = False,
                 quant_compute: str = "int8", prefill_via: PrefillVia | None = None):
        """prepack: let each session repack its MatMul weights for the CPU's kernels (faster decode,
        a private copy per session); without it both sessions read the artifact's one weights file,
        which ONNX Runtime memory-maps: one copy in memory (each session maps it, so RSS, which counts
        a page once per mapping, shows it twice once both graphs ran; PSS shows it once).
        swap_sessions: the two graphs' sessions take turns: one at a time, created when its graph runs
        (cheap over the mapped file) in place of the other, and the present cache handed back as
        numpy (an output OrtValue would keep its session's map of the weights): export validation,
        whose teacher-forced decode steps need no prefill in between, then peaks at one mapping.
        quant_compute (quantized artifacts, whose MatMuls ONNX Runtime fuses into MatMulNBits, always
        prepacked: the packed int4/int8 copy is what its kernels read): "int8" quantizes each block
        of activations to int8 (accuracy level 4, the fast path), "float" dequantizes the weights
        to float and multiplies in float (level 1, several times slower): what the quantized
        reference computes, so the graphs can be judged with float tolerances.
        prefill_via: which graph a static cache's prompts run through. None: the decode graph where
        the export lets it (dims.decode_prefills), the graphs are the fused ones (--target ort) and
        the provider is the CPU's, which then loads only decode.onnx (one session, so one packed
        copy of the weights), else prefill.onnx;
        "prefill": prefill.onnx always; "decode": insist (export validation judges both ways)."""
        if quant_compute not in QUANT_COMPUTE:
            raise ValueError(f"quant_compute must be one of {', '.join(QUANT_COMPUTE)}, not {quant_compute!r}")
        if prefill_via not in (None, "decode", "prefill"):
            raise ValueError(f"prefill_via must be None, 'decode' or 'prefill', not {prefill_via!r}")
        self.artifact = Path(artifact)
        self.manifest = Manifest.read(self.artifact)
        super().__init__(self.manifest.dims, self.manifest.max_context)
        self.threads, self.provider, self.profile, self.huge_pages = threads, provider, profile, huge_pages
        self.prepack = prepack or self.manifest.precision.quantized
        self.swap_sessions, self.quant_compute, self._prefill_via = swap_sessions, quant_compute, prefill_via
        self._at_rest()

    @property
    def identity(self) -> str:
        return artifact_identity(self.name, self.artifact)

    def _at_rest(self) -> None:
        """What `_load` sets, as it is before loading and after unloading."""
        self._ort = self._map = self.device = None
        self.sessions, self.output_names, self._shared, self._paths, self._providers = {}, {}, {}, {}, []
        self.huge_page_bytes = 0  # how much of what the sessions allocated now sits on huge pages

    @property
    def row_views(self) -> bool:
        return self.device != "cuda"  # a device OrtValue has no view of its first rows

    @property
    def row_slices(self) -> bool:
        return self.device != "cuda"

    @property
    def prefill_via(self) -> PrefillVia:
        """"decode" (each row through the decode graph, into its row of the cache: needs row views)
        where the export and the provider allow it and it was not declined, by default for the fused
        graphs only (one session; a portable decode graph attends over the whole cache, its prefill
        graph over the prompt); else "prefill"."""
        if not (self.dims.decode_prefills and self.row_views) or self._prefill_via == "prefill":
            return "prefill"
        return "decode" if self._prefill_via == "decode" or self.manifest.variant.target.value == "ort" else "prefill"

    def _load(self) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise BackendUnavailable("onnxruntime is not installed; pip install onnxruntime "
                                     "(or onnxruntime-gpu on a machine with an NVIDIA GPU)") from None
        paths = self.manifest.verify_files(self.artifact)
        available = ort.get_available_providers()
        if self.provider == "cuda" and "CUDAExecutionProvider" not in available:
            raise BackendUnavailable("ONNX Runtime has no CUDA provider here; pip install onnxruntime-gpu "
                                     "on a machine with an NVIDIA GPU, or use --provider cpu")
        use_cuda = self.provider != "cpu" and "CUDAExecutionProvider" in available
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if use_cuda else ["CPUExecutionProvider"]
        self.device = "cuda" if use_cuda else "cpu"
        if self._prefill_via == "decode" and self.prefill_via != "decode":
            raise BackendUnavailable("prompts run through the decode graph only where it also prefills (tk export "
                                     "--target ort --kv-cache static --prefill-logits last) on the CPU provider")
        self._ort = ort
        self._shared = self._shared_initializers()
        self._paths, self._providers = paths, providers
        if self.swap_sessions:
            return
        before = hugepages.anonymous_regions() if self.huge_pages and not use_cuda else None
        for graph in (contract.DECODE,) if self.prefill_via == "decode" else contract.GRAPHS:
            self._session(graph)
        if before is not None:  # the prepacked weights: a decode step streams them all (runtimes/backends/hugepages.py)
            new = hugepages.mapped_since(before, hugepages.anonymous_regions())
            self.huge_page_bytes = hugepages.back_with_huge_pages(new)

    def _options(self, graph: str):
        opts = session_options(self._ort, self.threads, spin=self.prefill_via == "decode")
        if not self.prepack:  # both sessions use the memory-mapped weights file as it is
            opts.add_session_config_entry("session.disable_prepacking", "1")
        if self.manifest.precision.quantized:
            opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", QUANT_COMPUTE[self.quant_compute])
        if self.profile:  # ORT's own trace of every run and kernel (tk bench --profile)
            opts.enable_profiling = True
            opts.profile_file_prefix = str(Path(tempfile.gettempdir()) / "tk-ort-profile")
        for name in (n for n in self._shared if graph in self.manifest.weights[n][4]):
            opts.add_initializer(name, self._shared[name])  # used in place, shared by the sessions
        return opts

    def _shared_initializers(self) -> dict:
        """Both sessions read the float tensors of the weights file through one read-only memory
        map (SessionOptions.add_external_initializers with OrtValues over it): one mapping, so the
        weights count once in RSS too, and a session that prepacks its MatMuls copies only what it
        packs. Quantized weights are left to ONNX Runtime, which packs them for MatMulNBits and
        frees what it read. Artifacts without the manifest's weights table: ORT maps per session."""
        table = {n: e for n, e in self.manifest.weights.items()
                 if e[2] in ("float32", "float16") and not n.endswith(QUANTIZED_SUFFIXES)}
        if not table:
            return {}
        self._map = np.memmap(self.artifact / next(iter(self.manifest.graphs.values())).data_file, dtype=np.uint8,
                              mode="r")  # kept as long as the sessions
        return {name: self._ort.OrtValue.ortvalue_from_numpy(self._map[o:o + n].view(np.dtype(d)).reshape(shape))
                for name, (o, n, d, shape, _) in table.items()}

    def _session(self, graph: str):
        """The graph's session, created on first use (with swap_sessions, in place of the other's)."""
        if graph not in self.sessions:
            if self.swap_sessions:
                self.sessions.clear()  # unmaps the other graph's view of the weights
            try:
                self.sessions[graph] = self._ort.InferenceSession(str(self._paths[graph]), self._options(graph),
                                                                  providers=self._providers)
            except Exception as e:  # ORT raises its own pybind types (NotImplemented, Fail, ...)
                kernel = "NOT_IMPLEMENTED" in str(e)
                hint = (f"ONNX Runtime's {self.device.upper()} provider lacks a kernel this {self.dims.kv_dtype} "
                        "graph needs" if kernel else "ONNX Runtime could not load the graphs")
                raise BackendUnavailable(f"{hint}: {str(e).split(' : ')[-1].strip()}") from None
            self.output_names[graph] = [o.name for o in self.sessions[graph].get_outputs()]
        return self.sessions[graph]

    def end_profiling(self) -> dict[str, Path]:
        """Stop ORT's profiler; the trace file of each graph's session."""
        return {g: Path(s.end_profiling()) for g, s in self.sessions.items()}

    def _unload(self) -> None:
        self._at_rest()

    def _value(self, array: np.ndarray):
        """An OrtValue over `array`'s own memory on the CPU provider, a device copy on CUDA."""
        if self.device == "cpu":
            return self._ort.OrtValue.ortvalue_from_numpy(array)
        return self._ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0)

    def _run(self, graph, feeds, past, session, in_place=False):
        if in_place:
            return self._run_in_place(feeds, past, session)
        session = self._session(graph)
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name, value in zip(self.past_names, past or []):
            if isinstance(value, np.ndarray):  # rows taken from a session (Session.keep)
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        for name in self.output_names[graph]:
            binding.bind_output(name, self.device)
        session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        n_kv = 2 * self.dims.num_layers
        hidden = [h.numpy() for h in outs[1 + n_kv:]] or None  # debug exports only
        present = list(outs[1 : 1 + n_kv])
        if self.swap_sessions:  # an output OrtValue keeps its session, and so that session's map of the weights
            present = [v.numpy() for v in present]
        return StepOutput(outs[0].numpy(), hidden), present

    def _run_in_place(self, feeds, past, session):
        """A static-capacity decode step: bindings are made once per session (and batch size: slots
        run their first rows) over the layout's feed arrays (rewritten in place each step) and the
        cache buffers (past and present at once). Without a session (a prompt prefilled through the
        decode graph, its feeds of its own length) the binding is made for this run alone.

        ORT writes the logits into an array the step then hands out as it is (copying 128 KB of
        logits out of a just-run step cost ~20 us of a 1.2 ms step on the 55M model): each batch
        size keeps a few bindings that differ only in that array, and a step takes the first
        whose array nobody holds any more (its reference count, a CPython fact, is back to the
        pool's own), so what a caller keeps is never overwritten. A caller that keeps every step's
        logits (a parity trace) finds none free once there are BINDINGS_PER_BATCH: the oldest then
        writes into a new array (the caller keeps the old one), so the pool stays that size."""
        B, width = feeds["input_ids"].shape[0], feeds["attention_mask"].shape[1]
        if session is None:
            pool = []
        else:  # per batch size, the bindings of one mask width (a narrow mask's: the last one asked)
            pools = session.backend if session.backend is not None else self._new_pools(session)
            if B not in pools or pools[B][0] != width:
                pools[B] = (width, [])
            pool = pools[B][1]
        for entry in pool:
            if sys.getrefcount(entry[1]) <= entry[2]:
                break
        else:
            if len(pool) < BINDINGS_PER_BATCH:
                entry = self._bind_in_place(feeds, past)
                pool.append(entry)
            else:
                entry = pool.pop(0)
                self._new_logits(entry)
                pool.append(entry)
            entry[2] = sys.getrefcount(entry[1])  # what the pool itself holds (+1: this call's argument)
        self._session(contract.DECODE).run_with_iobinding(entry[0])
        return StepOutput(entry[1]), past

    @staticmethod
    def _new_pools(session) -> dict:
        session.backend = {}  # batch size -> (mask width, its bindings) (Session.backend: ORT's)
        return session.backend

    def _new_logits(self, entry: list) -> None:
        """Bind the entry's logits output to a new array (the old one stays its holder's)."""
        entry[1] = np.empty_like(entry[1])
        entry[3][0]["logits"] = value = self._ort.OrtValue.ortvalue_from_numpy(entry[1])
        entry[0].bind_ortvalue_output("logits", value)

    def _bind_in_place(self, feeds, past) -> list:
        """[binding, logits array, its free reference count (set by the caller), the OrtValues kept alive]"""
        binding = self._session(contract.DECODE).io_binding()
        logits = np.zeros((feeds["input_ids"].shape[0], 1, self.dims.vocab_size), np.float32)
        host = self._ort.OrtValue.ortvalue_from_numpy  # a CPU OrtValue over the array's own memory
        values = {name: host(np.ascontiguousarray(array)) for name, array in feeds.items()}  # later writes are seen
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        values["logits"] = host(logits)
        binding.bind_ortvalue_output("logits", values["logits"])
        cache = [b if not isinstance(b, np.ndarray) else self._value(b) for b in past]
        for name, out, value in zip(self.past_names, self.present_names, cache):
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(out, value)  # the same buffer: updated in place
        return [binding, logits, 0, (values, cache)]

    def _alloc_cache(self, shape, dtype):
        array = np.zeros(shape, dtype=DTYPES[dtype].numpy)
        return array if self.device == "cpu" else self._value(array)

    def _copy_positions(self, dst, src, count, dst_row=None, src_row=None, src_at=0, dst_at=0):
        if isinstance(dst, np.ndarray):
            return super()._copy_positions(dst, src, count, dst_row, src_row, src_at, dst_at)
        host = dst.numpy()  # a device OrtValue (CUDA): through the host
        super()._copy_positions(host, src, count, dst_row, src_row, src_at, dst_at)
        dst.update_inplace(host)

    def _to_numpy(self, buf):
        return buf if isinstance(buf, np.ndarray) else buf.numpy()

    def _from_numpy(self, array):
        return array if self.device == "cpu" else self._value(array)


def open_ort(artifact: str | Path, threads: int | None = None, provider: str = "auto",
             profile: bool = False, huge_pages: bool = True, prepack: bool = False) -> OrtRuntime:
    """The ORT runtime for an artifact (either cache layout)."""
    return OrtRuntime(artifact, threads, provider, profile, huge_pages, prepack)

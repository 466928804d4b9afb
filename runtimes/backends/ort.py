"""ONNX Runtime backend over an artifact's prefill.onnx and decode.onnx.

`provider` "auto" takes the CUDA execution provider when onnxruntime-gpu and a GPU are present,
"cpu" or "cuda" insist. Runs with IO binding: the present cache comes back as OrtValues bound
straight into the next decode step, so the loop never copies the cache through numpy. Over a
static-capacity artifact the cache buffers are bound as both past input and present output
once per session, so TensorScatter writes each new position in place (on the CPU provider the
buffers are tk's own numpy arrays; on CUDA, device OrtValues). Where the decode graph also
prefills (dims.variant.decode_prefills) and is the fused one (--target ort), the CPU provider loads
decode.onnx alone (`prefill_via` "decode"): one session, one packed copy of the weights, prompts
run through it row by row. A portable decode graph that prefills takes the rest of a prompt part
way in (serving's chunks and cached prefixes); whole prompts go through prefill.onnx. The static
decode step's bindings are runtimes/backends/ort_bindings.py's; the weights both sessions share,
runtimes/backends/ort_weights.py's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from tk.models.spec import contract
from tk.models.spec.manifest import Manifest
from tk.runtimes.backends import hugepages
from tk.runtimes.backends.ort_bindings import StaticBindings
from tk.runtimes.backends.ort_pool import session_options
from tk.runtimes.backends.ort_probes import VNNI_CPUS, W8A8_SATURATES, integer_gemm_saturates, one_row_apart
from tk.runtimes.backends.ort_weights import integer_extremes, shared_initializers
from tk.runtimes.base import ArtifactRuntime, BackendUnavailable, CacheBuffers, PrefillVia, StepOutput

QUANT_COMPUTE = {"int8": "4", "float": "1"}  # MatMulNBits accuracy level of each


class OrtBuffers(CacheBuffers):
    """A static cache's buffers: tk's own numpy arrays on the CPU provider (ORT binds their memory),
    device OrtValues on CUDA, which have no view of their first rows. `ort` and `device` are set
    while the runtime is loaded."""

    def __init__(self):
        self.ort = self.device = None

    @property
    def row_views(self) -> bool:
        return self.device != "cuda"

    @property
    def row_slices(self) -> bool:
        return self.device != "cuda"

    def value(self, array: np.ndarray):
        """An OrtValue over `array`'s own memory on the CPU provider, a device copy on CUDA."""
        if self.device == "cpu":
            return self.ort.OrtValue.ortvalue_from_numpy(array)
        return self.ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0)

    def alloc(self, shape, dtype):
        array = super().alloc(shape, dtype)
        return array if self.device == "cpu" else self.value(array)

    def copy_positions(self, dst, src, count, dst_row=None, src_row=None, src_at=0, dst_at=0):
        if isinstance(dst, np.ndarray):
            return super().copy_positions(dst, src, count, dst_row, src_row, src_at, dst_at)
        host = dst.numpy()  # a device OrtValue (CUDA): through the host
        super().copy_positions(host, src, count, dst_row, src_row, src_at, dst_at)
        dst.update_inplace(host)

    def to_numpy(self, buf):
        return buf if isinstance(buf, np.ndarray) else buf.numpy()

    def from_numpy(self, array):
        return array if self.device == "cpu" else self.value(array)


class OrtRuntime(ArtifactRuntime):
    name = "ort"

    def __init__(self, artifact: str | Path, manifest: Manifest | None = None, *, threads: int | None = None,
                 provider: str = "auto", profile: bool = False, huge_pages: bool = True, prepack: bool = False,
                 swap_sessions: bool = False, quant_compute: str = "int8", prefill_via: PrefillVia | None = None,
                 arena: bool = True):
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
        the export lets it (dims.variant.decode_prefills), the graphs are the fused ones (--target ort) and
        the provider is the CPU's, which then loads only decode.onnx (one session, so one packed
        copy of the weights), else prefill.onnx;
        "prefill": prefill.onnx always; "decode": insist (export validation judges both ways)."""
        if quant_compute not in QUANT_COMPUTE:
            raise ValueError(f"quant_compute must be one of {', '.join(QUANT_COMPUTE)}, not {quant_compute!r}")
        if prefill_via not in (None, "decode", "prefill"):
            raise ValueError(f"prefill_via must be None, 'decode' or 'prefill', not {prefill_via!r}")
        super().__init__(artifact, manifest, buffers=OrtBuffers())
        self.threads, self.provider, self.profile, self.huge_pages = threads, provider, profile, huge_pages
        self.prepack = bool(prepack) or self.manifest.precision.quantized
        self.swap_sessions, self.quant_compute, self._prefill_via = swap_sessions, quant_compute, prefill_via
        self.arena = arena

    def _at_rest(self) -> None:
        self._ort = self._map = self._bindings = None
        self.sessions, self.output_names, self._shared, self._paths, self._providers = {}, {}, {}, {}, []
        self.huge_page_bytes = 0  # how much of what the sessions allocated now sits on huge pages
        self.lone_row_apart = False
        self.buffers.ort = self.buffers.device = None

    @property
    def device(self) -> str | None:
        """Where the cache and the graphs run once loaded: "cpu" or "cuda"."""
        return self.buffers.device

    @property
    def prefill_via(self) -> PrefillVia:
        """"decode" (each row through the decode graph, into its row of the cache: needs row views)
        where the export and the provider allow it and it was not declined, by default for the fused
        graphs (one session) and for standard graphs that pad their queries (Variant.pad_queries: a row's
        prompt then computes alike alone, in any group and in any chunks, as its steps and verify runs
        do, and one session holds the weights); else "prefill". A hybrid's only graph is decode.onnx."""
        if self.dims.stateful:
            return "decode"
        if not (self.dims.variant.decode_prefills and self.row_views) or self._prefill_via == "prefill":
            return "prefill"
        return "decode" if self._prefill_via == "decode" or self.manifest.variant.prefills_through_decode else "prefill"

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
        self.buffers.ort, self.buffers.device = ort, "cuda" if use_cuda else "cpu"
        if self.dims.stateful and not self.row_views:
            raise BackendUnavailable("this model's recurrent layers take prompts through its decode graph one row at a "
                                     "time, which ONNX Runtime's CUDA provider cannot do over its device buffers here; "
                                     "use --provider cpu")
        if self._prefill_via == "decode" and self.prefill_via != "decode":
            raise BackendUnavailable("prompts run through the decode graph only where it also prefills (tk export "
                                     "--target ort --kv-cache static --prefill-logits last) on the CPU provider")
        # (MatMulIntegerToFloat runs on the CPU whatever the provider)
        if self.manifest.precision.mixed == "lm-head-w8a8" and integer_gemm_saturates():  # (7-bit tables: exact)
            lo, hi = integer_extremes(self.artifact, self.manifest)
            if integer_gemm_saturates(max(hi, -lo - 1)):
                raise BackendUnavailable(f"{W8A8_SATURATES}; re-export it with this tk (7-bit weights, exact on "
                                         f"every CPU), or run it on {VNNI_CPUS}")
        self._ort = ort
        # a lone row's MatMulNBits (4-bit, int8 compute) sums apart on this CPU (ort_probes; 8-bit does not), and
        # the graphs compute a row alike in any other run (Variant.pad_queries): asked now, not at the first step
        self.lone_row_apart = (self.dims.variant.pad_queries and self.manifest.precision.weights == "int4"
                               and self.quant_compute == "int8" and not use_cuda and one_row_apart())
        self._map, self._shared = shared_initializers(ort, self.artifact, self.manifest)  # the map: kept with the sessions
        self._paths, self._providers = paths, providers
        self._bindings = StaticBindings(ort, self.buffers.value, self.past_names, self.present_names,
                                        self.dims.vocab_size)
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
        if not self.arena:
            opts.enable_cpu_mem_arena = False
        if not self.prepack:  # both sessions use the memory-mapped weights file as it is
            opts.add_session_config_entry("session.disable_prepacking", "1")
        if self.manifest.precision.quantized:
            opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", QUANT_COMPUTE[self.quant_compute])
        if self.profile:  # ORT's own trace of every run and kernel (tk bench --profile)
            opts.enable_profiling = True
            opts.profile_file_prefix = str(Path(tempfile.gettempdir()) / "tk-ort-profile")
        for name in (n for n in self._shared if graph in self.manifest.weights[n].graphs):
            opts.add_initializer(name, self._shared[name])  # used in place, shared by the sessions
        return opts

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

    def run(self, graph, feeds, past, session, in_place=False):
        if in_place:  # a static cache's decode step (ort_bindings.StaticBindings)
            return StepOutput(self._bindings.run(self._session(contract.DECODE), feeds, past, session)), past
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
        n_kv = len(self.past_names)
        hidden = [h.numpy() for h in outs[1 + n_kv:]] or None  # debug exports only
        present = list(outs[1 : 1 + n_kv])
        if self.swap_sessions:  # an output OrtValue keeps its session, and so that session's map of the weights
            present = [v.numpy() for v in present]
        return StepOutput(outs[0].numpy(), hidden), present

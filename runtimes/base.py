"""The runtime interface every backend implements: a backend owns decode sessions.

A runtime is cheap to construct, loads on `activate()` (or `__enter__`; running an inactive one
is refused, as Polygraphy's runners refuse), and offers

    start(input_ids, attention_mask) -> (StepOutput, Session)   # prefill a left-padded batch
    step(session, tokens) -> StepOutput                         # one token per row

The session (runtimes/session.py) holds each row's positions, the mask and the cache (torch
tensors, OrtValues, device buffers: opaque to callers), so the loop, parity, the probes and a
server never build masks or positions; `session.keep(rows)` lets finished rows leave. How the
cache grows is the export's cache layout (runtimes/cache_layouts.py), written once for every
backend and bound to the runtime's `CacheBuffers` (runtimes/buffers.py) when it is built: a
backend implements only `_load`, `_unload` (which puts back what `_load` set), `run` (one graph,
contract-named numpy feeds) and, for a cache it keeps off the host, a `CacheBuffers` of its own.
`ArtifactRuntime` is the shared start of the backends over an exported artifact. Serving's slots
are not the runtime's: serving's `Slots` opens them over a runtime and its static layout.
Imports nothing heavy.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Literal

import numpy as np

from tk.models.spec import contract
from tk.models.spec.manifest import ArtifactError, Manifest
from tk.runtimes.buffers import CacheBuffers
from tk.runtimes.cache_layouts import layout_for
from tk.runtimes.errors import BackendUnavailable, InputError, RuntimeProblem
from tk.runtimes.session import Session, StepOutput

# the interface's own names, and what backends raise (ArtifactError from the artifact's checks)
__all__ = ["ArtifactError", "ArtifactRuntime", "BackendUnavailable", "CacheBuffers", "InputError", "PrefillVia",
           "Runtime", "RuntimeProblem", "Session", "StepOutput", "check_inputs", "check_token_ids"]

PrefillVia = Literal["decode", "prefill"]  # which graph a static cache's prompts run through


def check_inputs(graph: str, dims: contract.GraphDims, feeds: dict[str, tuple[tuple, str]]) -> None:
    """Check named (shape, dtype) pairs against the contract (Polygraphy's check_inputs), once per
    session at its start: the decode feeds are built by the cache layout, not by callers.

    Symbolic dims must agree wherever they recur. Messages name the tensor and both shapes.
    """
    bound: dict[str, int] = {}
    for spec in dims.inputs(graph):
        if spec.name not in feeds:
            raise InputError(f"{graph}: input {spec.name} is missing")
        shape, dtype = feeds[spec.name]
        if dtype != spec.dtype:
            raise InputError(f"{graph}: {spec.name} has dtype {dtype}, expected {spec.dtype}")
        if len(shape) != len(spec.dims):
            raise InputError(f"{graph}: {spec.name} has shape {list(shape)}, expected {list(spec.dims)}")
        for got, want in zip(shape, spec.dims):
            ok = got == want if isinstance(want, int) else bound.setdefault(want, got) == got
            if not ok or got <= 0:
                raise InputError(f"{graph}: {spec.name} has shape {list(shape)}, expected {list(spec.dims)} "
                                 f"with {', '.join(f'{k}={v}' for k, v in bound.items())}")


def check_token_ids(input_ids: np.ndarray, vocab_size: int) -> None:
    # A decode step's few ids are checked as Python ints: two numpy reductions cost ~8 us each step.
    ids = input_ids.ravel().tolist() if input_ids.size <= 64 else (input_ids.min(), input_ids.max())
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = int(input_ids[(input_ids < 0) | (input_ids >= vocab_size)][0])
        raise InputError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def shape_and_dtype(array: np.ndarray) -> tuple[tuple, str]:
    return array.shape, str(array.dtype)


class Runtime(ABC):
    """One backend. Subclasses implement `_load`, `_unload`, `run` and, for caches they keep off
    the host, pass a `CacheBuffers` of their own (the default holds numpy arrays)."""

    name = "base"
    # A static cache's prompts run through prefill.onnx; a backend whose decode graph can also
    # prefill them (dims.variant.decode_prefills) may say "decode" (ORT on the CPU: one session).
    prefill_via: PrefillVia = "prefill"
    # a run returns every position's logits whatever the graphs return (the torch model computes them all)
    computes_every_position = False
    # a run of one position (one row, one token) computes other bits than the same position among others, on
    # graphs whose rows are otherwise the same bits in any run (ORT's MatMulNBits on a CPU without VNNI:
    # OrtRuntime): the static layout then never runs one position alone (cache_runs.Runs.paired)
    lone_row_apart = False

    @property
    def all_prefill_logits(self) -> bool:
        """A prefill's output holds every position's logits (not the last only: dims.variant.prefill_logits)."""
        return self.prefill_via == "prefill" and self.dims.variant.prefill_logits == "all"

    def __init__(self, dims: contract.GraphDims, max_context: int, buffers: CacheBuffers | None = None):
        self.dims = dims  # the graphs this runtime runs, always
        self.buffers = CacheBuffers() if buffers is None else buffers
        self.layout = layout_for(dims, self.buffers)
        self.past_names = dims.past_names()
        self.present_names = dims.present_names()
        self.max_context = min(max_context, dims.kv_capacity or max_context)
        self.max_batch: int | None = None  # the most rows one run may take (TensorRT: its engines' profiles)
        self.max_prompt: int | None = None  # the longest prefill (the same)
        self.active = False

    @property
    def row_views(self) -> bool:
        """A cache buffer's leading rows run alone (serving's slots compute only up to the last busy one)."""
        return self.buffers.row_views

    @property
    def row_slices(self) -> bool:
        """Any one row of a cache buffer runs alone (chunked prefill, cached prefixes)."""
        return self.buffers.row_slices

    @property
    def identity(self) -> str:
        """What this runtime's keys and values come from: equal only for the same weights and graphs
        (a prefix cache is keyed by it). The default names this object; backends over an artifact
        name the artifact's files."""
        return f"{self.name}:{id(self)}"

    def activate(self) -> "Runtime":
        if not self.active:
            try:
                self._load()
            except BaseException:  # what a load that failed half way had set goes back too
                self._unload()
                raise
            self.active = True
        return self

    def deactivate(self) -> None:
        if self.active:
            self._unload()
            self.active = False

    def __enter__(self) -> "Runtime":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def _require_active(self) -> None:
        if not self.active:
            raise RuntimeError(f"the {self.name} runtime is not active; use `with runtime:` or runtime.activate()")

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, room: int = 64) -> tuple[StepOutput, Session]:
        """Prefill a left-padded batch; `room`: decode steps to reserve mask space for (it grows past it)."""
        self._require_active()
        feeds = {"input_ids": shape_and_dtype(input_ids), "attention_mask": shape_and_dtype(attention_mask),
                 "position_ids": shape_and_dtype(input_ids)}
        check_inputs(contract.PREFILL, self.dims, feeds)
        check_token_ids(input_ids, self.dims.vocab_size)
        return self.layout.start(self, input_ids, attention_mask, room)

    def step(self, session: Session, tokens) -> StepOutput:
        """One token per row of the session -> logits (B, 1, V)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        if tokens.shape[0] != session.batch:
            raise InputError(f"decode: {tokens.shape[0]} tokens for a session of {session.batch} rows")
        check_token_ids(tokens, self.dims.vocab_size)
        return self.layout.step(session, tokens)

    @property
    def verify_problem(self) -> str | None:
        """Why this runtime cannot verify speculated tokens in one decode run (None: it can)."""
        d = self.dims
        if d.stateful:
            return ("speculative decoding keeps a verify run's accepted tokens and rewinds the rest, and this model's "
                    "recurrent layers carry a state that cannot be rewound to a position: run it without "
                    "--lookup/--draft")
        if d.kv_capacity is None:
            return ("speculative decoding verifies in one run of a static-capacity decode graph: re-export with "
                    "tk export MODEL -o OUT --for ort-cpu (or --for serve)")
        if not d.variant.decode_prefills:
            return "this artifact's decode graph takes one token a step (a portable graph with rings); it cannot verify a run"
        if not (d.keeps_logits or self.computes_every_position):
            return ("this artifact's decode graph returns one position's logits a run (an export before tk could "
                    "verify runs); re-export it with tk export")
        if not self.row_slices:
            return f"the {self.name} backend cannot run a multi-token verify step (its decode takes one token a row)"
        return None

    @property
    def max_verify(self) -> int:
        """The most tokens one verify run takes per row (the last kept token and the guesses after it)."""
        return self.dims.max_run or self.max_context

    def verify(self, session: Session, tokens) -> np.ndarray:
        """Each row's next n tokens (B, n) in one decode run -> each position's logits (B, n, V); then
        `rewind` keeps what was accepted (StaticLayout.verify)."""
        problem = self.verify_problem
        if problem:
            raise InputError(problem)
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 2 or tokens.shape[0] != session.batch:
            raise InputError(f"verify: tokens of shape {list(tokens.shape)} for a session of {session.batch} rows")
        check_token_ids(tokens, self.dims.vocab_size)
        return self.layout.verify(session, tokens)

    def rewind(self, session: Session, lengths) -> None:
        """Each row keeps its cache's first `lengths[b]` positions (StaticLayout.rewind)."""
        self.layout.rewind(session, lengths)

    def cache_arrays(self, session: Session) -> list[np.ndarray]:
        """The session's cache as float32 arrays in contract order: (B, Hkv, length, D) for keys and
        values, a recurrent layer's state as it is (B, ...) (copies; for parity and probes, not the loop)."""
        return self.layout.arrays(session)

    def cache_held(self, session: Session) -> list[np.ndarray | None]:
        """Per cache tensor, the (B, length) positions of `cache_arrays` it holds (a sliding layer's
        ring keeps its last slots only), or None where it holds them all."""
        return self.layout.held(session)

    # --- what a backend implements ---

    @abstractmethod
    def _load(self) -> None: ...

    def _unload(self) -> None:
        """Undo `_load`: every attribute it set goes back to what it was before (Polygraphy's
        runners are checked for this; tests/test_runtime_state.py checks tk's)."""

    @abstractmethod
    def run(self, graph: str, feeds: dict[str, np.ndarray], past: list | None, session: Session | None,
            in_place: bool = False) -> tuple[StepOutput, list]:
        """Run one graph on contract-named numpy feeds and the past cache (decode): what the layouts
        call, on an active runtime. Returns the step's output and the present cache; with `in_place`
        (a static cache) the present is written into `past`'s own buffers, and the same `feeds` arrays
        come back every step."""

    def release_session_state(self, session: Session) -> None:
        """Free what the backend keeps in `session.backend` (on close and when rows leave; the
        session then sets it to None)."""


class ArtifactRuntime(Runtime):
    """A backend over an exported artifact's files: its manifest (read here unless the caller has it)
    gives the dims; `_at_rest` sets what `_load` sets, as it is before loading and after unloading."""

    def __init__(self, artifact: str | Path, manifest: Manifest | None = None, *, max_context: int | None = None,
                 buffers: CacheBuffers | None = None):
        self.artifact = Path(artifact)
        self.manifest = Manifest.read(self.artifact) if manifest is None else manifest
        super().__init__(self.manifest.dims, self.manifest.max_context if max_context is None else max_context, buffers)
        self._at_rest()

    @property
    def identity(self) -> str:
        """The artifact's manifest (which records every graph's and weight file's sha256) and where it
        lies, so a re-export in place is another identity."""
        manifest = self.artifact.resolve() / contract.MANIFEST
        return f"{self.name}:{manifest.parent}:{hashlib.sha256(manifest.read_bytes()).hexdigest()}"

    @abstractmethod
    def _at_rest(self) -> None: ...

    def _unload(self) -> None:
        self._at_rest()

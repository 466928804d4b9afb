"""ONNX Runtime's IO bindings of a static-capacity decode step, made once per session and reused.

A static cache's decode step runs on bindings made over the layout's feed arrays (rewritten in
place each step) and the cache buffers (bound as past input and present output at once, so the
graph writes each new position in place). Without a session (a prompt prefilled through the
decode graph, its feeds of its own length) a binding is made for that run alone.

ORT writes the logits into an array the step then hands out as it is (copying 128 KB of logits
out of a just-run step cost ~20 us of a 1.2 ms step on the 55M model): each batch size keeps a
few bindings that differ only in that array, and a step takes the first whose array nobody holds
any more (its reference count, a CPython fact, is back to the pool's own), so what a caller keeps
is never overwritten. A caller that keeps every step's logits (a parity trace) finds none free
once there are BINDINGS_PER_BATCH: the oldest then writes into a new array (the caller keeps the
old one), so the pool stays that size.
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np

BINDINGS_PER_BATCH = 4  # logits arrays a static session's steps rotate through


class Binding:
    """One IO binding of the decode graph and the logits array it writes."""

    __slots__ = ("io", "logits", "free_refs", "values")

    def __init__(self, io, logits: np.ndarray, values: tuple):
        self.io = io  # the onnxruntime IOBinding
        self.logits = logits  # (B, 1, V) float32 (a verify run's: (B, K, V)): what the step returns
        self.free_refs = 0  # the logits' reference count when only the pool holds them (set by the pool)
        self.values = values  # (the feeds' and logits' OrtValues by name, the cache's): kept alive with it


class StaticBindings:
    """A loaded runtime's static decode steps; `value(array)` is the OrtValue a cache buffer is bound
    as (over a numpy array's own memory on the CPU provider)."""

    def __init__(self, ort, value: Callable, past_names: list[str], present_names: list[str], vocab_size: int):
        self.ort, self.value = ort, value
        self.past_names, self.present_names, self.vocab_size = past_names, present_names, vocab_size

    def run(self, decode, feeds: dict[str, np.ndarray], past: list, session) -> np.ndarray:
        """Run one in-place step of the `decode` InferenceSession (or a prompt's run, without a
        `session`) -> its logits."""
        B, width = feeds["input_ids"].shape[0], feeds["attention_mask"].shape[1]
        if session is None:
            pool = []
        else:  # per batch size, the bindings of one mask width (a narrow mask's: the last one asked)
            pools = session.backend
            if pools is None:
                pools = session.backend = {}  # batch size -> (mask width, its bindings) (Session.backend: ORT's)
            if B not in pools or pools[B][0] != width:
                pools[B] = (width, [])
            pool = pools[B][1]
        for binding in pool:
            if sys.getrefcount(binding.logits) <= binding.free_refs:
                break
        else:
            if len(pool) < BINDINGS_PER_BATCH:
                binding = self._bind(decode, feeds, past)
                pool.append(binding)
            else:
                binding = pool.pop(0)
                self._new_logits(binding)
                pool.append(binding)
            binding.free_refs = sys.getrefcount(binding.logits)  # what the pool itself holds (+1: this call's argument)
        decode.run_with_iobinding(binding.io)
        return binding.logits

    def _new_logits(self, binding: Binding) -> None:
        """Bind the binding's logits output to a new array (the old one stays its holder's)."""
        binding.logits = np.empty_like(binding.logits)
        binding.values[0]["logits"] = value = self.ort.OrtValue.ortvalue_from_numpy(binding.logits)
        binding.io.bind_ortvalue_output("logits", value)

    def _bind(self, decode, feeds: dict[str, np.ndarray], past: list) -> Binding:
        io = decode.io_binding()
        keep = feeds.get("logits_to_keep")  # the run's positions whose logits come back (one without it)
        logits = np.zeros((feeds["input_ids"].shape[0], 1 if keep is None else len(keep), self.vocab_size), np.float32)
        host = self.ort.OrtValue.ortvalue_from_numpy  # a CPU OrtValue over the array's own memory
        values = {name: host(np.ascontiguousarray(array)) for name, array in feeds.items()}  # later writes are seen
        for name, value in values.items():
            io.bind_ortvalue_input(name, value)
        values["logits"] = host(logits)
        io.bind_ortvalue_output("logits", values["logits"])
        cache = [b if not isinstance(b, np.ndarray) else self.value(b) for b in past]
        for name, out, value in zip(self.past_names, self.present_names, cache):
            io.bind_ortvalue_input(name, value)
            io.bind_ortvalue_output(out, value)  # the same buffer: updated in place
        return Binding(io, logits, (values, cache))

"""The graph contract: names, order, dtypes and symbolic dims of the prefill and decode graphs.

This module is data (and the one array function every caller shares), read by the exporter (to name and check what it writes), by the runtimes
(to feed and check what they run) and by the parity harness. Nobody spells "present.0.key" by
hand. It imports nothing but the standard library so that `runtimes` may depend on it without
pulling in torch.

Any change to names, order, dtypes or dims bumps CONTRACT_VERSION.
"""

from __future__ import annotations

import functools
import math
from dataclasses import KW_ONLY, dataclass

from tk.models.spec.dtypes import DTYPES
from tk.models.spec.errors import TkError
from tk.models.spec.variant import PrefillLogits, Variant

# 2: the static-capacity decode variant (write_indices, fixed-capacity cache); 3: a sliding layer's static
# cache may be a ring of fewer positions (GraphDims.ring); 4: a static decode graph's attention_mask may be
# narrower than the cache (GraphDims.narrow_mask: it attends over that many positions); 5: a static decode
# graph that takes runs may take logits_to_keep (Variant.verify_logits: the run's positions whose logits it
# returns); 6: a layer's state may be other than a KV cache: a convolution's carry and a recurrent matrix
# (GraphDims.layers), and such an artifact's one graph is decode.onnx, which prefills in runs; 7: a layer's keys
# and values may have their own head sizes (LayerState.kv_heads, head_dim: Gemma 4's wider full-attention layers),
# and a layer may keep no cache and read another's (LayerState.reads: Gemma 4's KV-shared layers), in the dynamic
# cache's graphs too. Each version's artifacts are the next one's without the new feature, so all are read (READS).
CONTRACT_VERSION = 7
READS = (2, 3, 4, 5, 6, 7)
RING_RUN = 128  # with rings, the most new tokens per row a decode graph that also prefills takes (changing it bumps the version)
# with recurrent layers, the most new tokens per row one run of a portable decode graph takes: the delta rule
# inverts a unit triangular matrix of at most this size (models/reference/recurrent.py; changing it bumps the version)
STATE_RUN = 64

PREFILL = "prefill"
DECODE = "decode"
GRAPHS = (PREFILL, DECODE)

# Symbolic dims (Optimum / onnxruntime-genai spelling).
BATCH = "batch_size"
SEQ = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "total_sequence_length"
KEEP = "kept_sequence_length"  # logits_to_keep's length: the positions of a run whose logits come back

KV_DTYPE = "kv"  # placeholder in the table: the precision the graph was exported in
# what a layer carries from one run to the next (LayerState): a KV cache, a convolution's last inputs, a
# recurrent matrix per head (kept in float32, as transformers keeps it: the recurrence runs in float32)
KV, CONV, RECURRENT = "kv", "conv", "recurrent"
STATE_DTYPES = {CONV: KV_DTYPE, RECURRENT: "float32"}


class ContractError(TkError, ValueError):
    """A graph, artifact or input does not follow the contract."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "int64", "float32", or KV_DTYPE
    dims: tuple[str | int, ...]  # symbolic names, or ints for fixed sizes ("num_kv_heads" etc. resolved later)

    def resolve(self, kv_dtype: str, num_kv_heads: int, head_dim: int, vocab_size: int) -> "TensorSpec":
        fixed = {"num_kv_heads": num_kv_heads, "head_dim": head_dim, "vocab_size": vocab_size}
        dims = tuple(fixed.get(d, d) if isinstance(d, str) else d for d in self.dims)
        return TensorSpec(self.name, kv_dtype if self.dtype == KV_DTYPE else self.dtype, dims)


@dataclass(frozen=True)
class LayerState:
    """What one layer carries between runs: a KV cache (`kv`; of its own kv_heads x head_dim where they are set,
    else the model's), the tensors of a recurrent layer, each (name, per-row shape): "conv" (channels,
    conv_kernel - 1), "recurrent" (heads, d_k, d_v); or nothing: a KV-shared layer, which attends over the keys
    and values layer `reads` wrote in the same run."""

    kv: bool = True
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()
    kv_heads: int | None = None
    head_dim: int | None = None
    reads: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return ("key", "value") if self.kv else tuple(n for n, _ in self.tensors)

    @property
    def recurrent(self) -> bool:
        return bool(self.tensors)

    @classmethod
    def of(cls, config, i: int) -> "LayerState":
        """Layer i of `config` (a DecoderConfig): its recurrent state, its own cache's sizes, or whose it reads."""
        state, kind = config.layer_state(i), config.layer(i)
        if state:
            return cls(False, state)
        if kind.reads is not None:
            return cls(False, reads=kind.reads)
        return cls(True, kv_heads=kind.kv_heads, head_dim=kind.head_dim)


def kv_names(layer: int, prefix: str) -> tuple[str, str]:
    return f"{prefix}.{layer}.key", f"{prefix}.{layer}.value"


def state_names(prefix: str, num_layers: int, layers: tuple[LayerState, ...] | None = None) -> list[str]:
    """Every cache tensor's name in contract order: each layer's key and value, or its recurrent tensors."""
    if layers is None:
        return [n for i in range(num_layers) for n in kv_names(i, prefix)]
    return [f"{prefix}.{i}.{n}" for i, layer in enumerate(layers) for n in layer.names]


def past_names(num_layers: int, layers: tuple[LayerState, ...] | None = None) -> list[str]:
    return state_names("past_key_values", num_layers, layers)


def present_names(num_layers: int, layers: tuple[LayerState, ...] | None = None) -> list[str]:
    return state_names("present", num_layers, layers)


def hidden_names(num_layers: int) -> list[str]:
    """Debug outputs (tk export --debug-outputs): each layer's output hidden state, float32."""
    return [f"hidden.{i}" for i in range(num_layers)]


def _kv(names: list[str], seq_dim: str | int, heads: int | None = None, head_dim: int | None = None) -> list[TensorSpec]:
    return [TensorSpec(n, KV_DTYPE, (BATCH, heads or "num_kv_heads", seq_dim, head_dim or "head_dim")) for n in names]


def ring_sizes(windows: list[int | None], capacity: int, run: int) -> tuple[int | None, ...] | None:
    """Per layer, how many positions a sliding layer's static cache holds when that is fewer than the
    capacity: a ring of window + run - 1 slots, where `run` is the most new tokens per row one decode
    step writes (1; RING_RUN where the decode graph also prefills), so that no slot a query of the step
    still needs is overwritten by the step (models/decoder.ring_mask). None for every other layer, and
    None when no layer's cache is a ring."""
    sizes = tuple(None if w is None or w + run - 1 >= capacity else w + run - 1 for w in windows)
    return sizes if any(s is not None for s in sizes) else None


def _layer_kv(num_layers: int, prefix: str, sizes, layers: tuple[LayerState, ...] | None = None) -> list[TensorSpec]:
    """Each layer's cache tensors: its key and value of sizes[i] positions (a sequence dim, or one size for
    every layer), its recurrent state, or none (a KV-shared layer)."""
    specs = []
    for i in range(num_layers):
        layer = LayerState() if layers is None else layers[i]
        size = sizes if isinstance(sizes, str) else sizes[i]
        if layer.kv:
            specs += _kv(list(kv_names(i, prefix)), size, layer.kv_heads, layer.head_dim)
        else:
            specs += [TensorSpec(f"{prefix}.{i}.{n}", STATE_DTYPES[n], (BATCH, *shape)) for n, shape in layer.tensors]
    return specs


def inputs(graph: str, num_layers: int, capacity: int | None = None, decode_prefills: bool = False,
           ring: tuple[int | None, ...] | None = None, narrow_mask: bool = False,
           keep: bool = False, layers: tuple[LayerState, ...] | None = None) -> list[TensorSpec]:
    """Graph inputs, in order.

    With `capacity` the decode graph has a static-capacity cache: past and present are
    [batch, kv_heads, capacity, head_dim] buffers updated in place at `write_indices` (one cache
    index per row), and `attention_mask` covers the whole buffer (0 beyond what is written).
    With `decode_prefills` that graph takes a run of new tokens per row (sequence_length >= 1,
    written from `write_indices` on) and returns the last one's logits: a prompt can be prefilled
    through it, so one session (one packed copy of the weights) serves both phases. Its rows are
    never padded: row b holds its tokens at 0 .. write_indices[b] - 1, so the graph attends to
    exactly those and the new ones, and reads `attention_mask` for nothing but its width (the
    runtimes still keep it, 1 exactly there). With `ring` (ring_sizes) a sliding layer's past and
    present hold its ring's slots instead: position p at slot p % slots. With `narrow_mask` the
    decode graph's attention_mask may cover only the cache's first total_sequence_length positions
    (<= capacity, at least every row's write index plus its new tokens): it attends over those alone,
    so a step costs what the rows hold, not the capacity (the cache is still written in place whole).
    With `keep` (a decode graph that takes runs) `logits_to_keep` follows write_indices: the positions
    of the run (0 .. sequence_length - 1, the same for every row) whose logits the graph returns, as
    transformers' `logits_to_keep` tensor: [S - 1] for a prompt's run, 0 .. k for a verify step.
    With `layers` (LayerState per layer), a layer's keys and values have its own head sizes, a recurrent
    layer's past and present are its carry and matrix state (fixed in size), and a KV-shared layer has none.
    """
    if graph == DECODE and capacity is not None:
        new = SEQ if decode_prefills else 1
        return [
            TensorSpec("input_ids", "int64", (BATCH, new)),
            TensorSpec("attention_mask", "int64", (BATCH, TOTAL if narrow_mask else capacity)),
            TensorSpec("position_ids", "int64", (BATCH, new)),
            TensorSpec("write_indices", "int64", (BATCH,)),
            *([TensorSpec("logits_to_keep", "int64", (KEEP,))] if keep and decode_prefills else []),
            *_layer_kv(num_layers, "past_key_values", layer_capacities(num_layers, capacity, ring), layers),
        ]
    if graph == PREFILL:
        return [
            TensorSpec("input_ids", "int64", (BATCH, SEQ)),
            TensorSpec("attention_mask", "int64", (BATCH, SEQ)),
            TensorSpec("position_ids", "int64", (BATCH, SEQ)),
        ]
    if graph == DECODE:
        return [
            TensorSpec("input_ids", "int64", (BATCH, 1)),
            TensorSpec("attention_mask", "int64", (BATCH, TOTAL)),
            TensorSpec("position_ids", "int64", (BATCH, 1)),
            *_layer_kv(num_layers, "past_key_values", PAST, layers),
        ]
    raise ContractError(f"unknown graph {graph!r}; expected one of {', '.join(GRAPHS)}")


def layer_capacities(num_layers: int, capacity: int, ring: tuple[int | None, ...] | None) -> list[int]:
    """Each layer's static cache positions: its ring's slots, or the capacity."""
    return [capacity if ring is None or ring[i] is None else ring[i] for i in range(num_layers)]


def outputs(graph: str, num_layers: int, capacity: int | None = None, prefill_last: bool = False,
            ring: tuple[int | None, ...] | None = None, keep: bool = False,
            layers: tuple[LayerState, ...] | None = None) -> list[TensorSpec]:
    """Graph outputs, in order. Logits are float32 in every precision.

    With `prefill_last` the prefill graph returns the logits of the last position only (B, 1, V):
    all that generation needs, and the LM head then costs one position instead of S. The
    present cache still covers every position. With `keep` the static decode graph returns the logits
    of the positions its logits_to_keep names (inputs).
    """
    if graph == DECODE and capacity is not None:
        return [TensorSpec("logits", "float32", (BATCH, KEEP if keep else 1, "vocab_size")),
                *_layer_kv(num_layers, "present", layer_capacities(num_layers, capacity, ring), layers)]
    if graph == PREFILL:
        return [TensorSpec("logits", "float32", (BATCH, 1 if prefill_last else SEQ, "vocab_size")),
                *_layer_kv(num_layers, "present", SEQ, layers)]
    if graph == DECODE:
        return [TensorSpec("logits", "float32", (BATCH, 1, "vocab_size")), *_layer_kv(num_layers, "present", TOTAL, layers)]
    raise ContractError(f"unknown graph {graph!r}; expected one of {', '.join(GRAPHS)}")


@dataclass(frozen=True)
class GraphDims:
    """The sizes an artifact fixes, and the variant its graphs were exported as: enough to resolve
    every spec above. The variant's flags are read from `variant`, never copied here."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str  # "float32", "float16" or "bfloat16"
    _: KW_ONLY
    kv_capacity: int | None = None  # set: the decode graph has a static-capacity cache of this many positions
    ring: tuple[int | None, ...] | None = None  # per layer, its static cache's ring slots (ring_sizes) or None
    hidden_size: int | None = None  # the width of the debug outputs hidden.{i} (variant.debug_outputs)
    variant: Variant = Variant()
    layers: tuple[LayerState, ...] | None = None  # per layer, what it carries (None: a KV cache in every layer)

    @classmethod
    def of(cls, config, precision, variant: Variant) -> "GraphDims":
        """The contract's sizes for graphs of `config` (a DecoderConfig) in `precision` (its kv dtype),
        exported as `variant`: with a static cache, a sliding layer whose window (plus the decode step's
        run) is shorter than the capacity keeps a ring (ring_sizes)."""
        c, v = config, variant
        ring = None
        if v.capacity is not None:
            ring = ring_sizes(c.windows, v.capacity, RING_RUN if v.decode_prefills else 1)
        layers = None
        if not c.uniform_cache:  # a recurrent state, per-layer head sizes or a KV-shared layer somewhere
            layers = tuple(LayerState.of(c, i) for i in range(c.num_layers))
        return cls(c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size, precision.kv, kv_capacity=v.capacity,
                   ring=ring, hidden_size=c.hidden_size, variant=v, layers=layers)

    @property
    def stateful(self) -> bool:
        """Some layer carries a recurrent state, not a KV cache: the artifact's one graph is decode.onnx."""
        return self.layers is not None and any(layer.recurrent for layer in self.layers)

    @property
    def graphs(self) -> tuple[str, ...]:
        """The graphs an artifact of these dims has: both, or decode.onnx alone where a layer carries a
        recurrent state (its decode graph takes prompts in runs, from a zero state)."""
        return (DECODE,) if self.stateful else GRAPHS

    def layer_states(self) -> tuple[LayerState, ...]:
        return self.layers or (LayerState(),) * self.num_layers

    def cache_kinds(self) -> list[tuple[int, str]]:
        """Per cache tensor in contract order, (its layer, its kind: KV, CONV or RECURRENT)."""
        return [(i, KV if layer.kv else n) for i, layer in enumerate(self.layer_states()) for n in layer.names]

    def group(self, flat: list) -> list[tuple]:
        """The cache tensors in contract order -> one tuple per layer (key, value) or its recurrent tensors."""
        out, at = [], 0
        for layer in self.layer_states():
            n = len(layer.names)
            out.append(tuple(flat[at:at + n]))
            at += n
        return out

    def past_names(self) -> list[str]:
        return past_names(self.num_layers, self.layers)

    def present_names(self) -> list[str]:
        return present_names(self.num_layers, self.layers)

    @property
    def narrow_mask(self) -> bool:
        """The static decode graph attends over its attention_mask's width (see inputs): the variant's
        choice, which a cache with rings does not take (a ring's mask reads positions by index)."""
        return self.variant.narrow_mask and self.ring is None

    @property
    def keeps_logits(self) -> bool:
        """The static decode graph takes logits_to_keep (inputs): it takes runs and was exported to verify them."""
        return self.kv_capacity is not None and self.variant.decode_prefills and self.variant.verify_logits

    @property
    def max_run(self) -> int | None:
        """The most new tokens per row one static decode step takes (None: any number; prompts longer
        than this go through the decode graph in runs of it)."""
        if not self.variant.decode_prefills:
            return 1
        runs = [RING_RUN if self.ring is not None else None,
                STATE_RUN if self.stateful and self.variant.target.value == "portable" else None]
        return min((r for r in runs if r is not None), default=None)

    def opset(self, graph: str) -> int:
        """The opset `graph` is written in (Variant.decode_opset for the decode graph)."""
        return self.variant.decode_opset(self.ring is not None) if graph == DECODE else self.variant.opset

    def capacities(self) -> list[int]:
        """Each layer's static cache positions (its ring's slots or kv_capacity)."""
        return layer_capacities(self.num_layers, self.kv_capacity, self.ring)

    def inputs(self, graph: str) -> tuple[TensorSpec, ...]:
        return _resolved_inputs(self, graph)  # cached: runtimes check inputs against this every step

    def outputs(self, graph: str) -> tuple[TensorSpec, ...]:
        return _resolved_outputs(self, graph)

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head dim) of layer `layer`'s keys and values (the model's, or the layer's own)."""
        state = self.layer_states()[layer]
        return state.kv_heads or self.num_kv_heads, state.head_dim or self.head_dim

    def kv_position_bytes(self, layer: int, batch: int = 1) -> int:
        """A key and a value of one position of layer `layer` (0: it keeps no cache)."""
        heads, head_dim = self.kv_shape(layer)
        return int(2 * batch * heads * head_dim * DTYPES[self.kv_dtype].bytes) if self.layer_states()[layer].kv else 0

    def kv_bytes_per_token(self, batch: int = 1) -> int:
        """2 (key and value) * kv_heads * head_dim * bytes of every layer that keeps a cache, per token of
        context per row."""
        return sum(self.kv_position_bytes(i, batch) for i in range(self.num_layers))

    def state_bytes(self, layer: int, batch: int = 1) -> int:
        """A recurrent layer's state per `batch` rows (0 for an attention layer), whatever the context."""
        state = self.layer_states()[layer]
        sizes = {CONV: DTYPES[self.kv_dtype].bytes, RECURRENT: DTYPES["float32"].bytes}
        return int(sum(batch * math.prod(shape) * sizes[n] for n, shape in state.tensors))

    def static_cache_bytes(self, batch: int = 1) -> int:
        """What a static cache's buffers hold for `batch` rows: each attention layer's capacity (or ring)
        positions, and every recurrent layer's state."""
        kv = sum(n * self.kv_position_bytes(i, batch) for i, n in enumerate(self.capacities()))
        return int(kv + sum(self.state_bytes(i, batch) for i in range(self.num_layers)))


@functools.lru_cache(maxsize=64)
def _resolved_inputs(dims: GraphDims, graph: str) -> tuple[TensorSpec, ...]:
    return tuple(s.resolve(dims.kv_dtype, dims.num_kv_heads, dims.head_dim, dims.vocab_size)
                 for s in inputs(graph, dims.num_layers, dims.kv_capacity, dims.variant.decode_prefills, dims.ring,
                                 dims.narrow_mask, dims.keeps_logits, dims.layers))


@functools.lru_cache(maxsize=64)
def _resolved_outputs(dims: GraphDims, graph: str) -> tuple[TensorSpec, ...]:
    last = dims.variant.prefill_logits is PrefillLogits.LAST
    specs = [s.resolve(dims.kv_dtype, dims.num_kv_heads, dims.head_dim, dims.vocab_size)
             for s in outputs(graph, dims.num_layers, dims.kv_capacity, last, dims.ring, dims.keeps_logits,
                              dims.layers)]
    if dims.variant.debug_outputs:
        seq = SEQ if graph == PREFILL else 1
        specs += [TensorSpec(n, "float32", (BATCH, seq, dims.hidden_size)) for n in hidden_names(dims.num_layers)]
    return tuple(specs)


def shape(spec: TensorSpec, sizes: dict[str, int]) -> tuple[int, ...]:
    """A resolved spec's shape with its symbolic dims given `sizes` ({BATCH: b, SEQ: s, PAST: p, TOTAL: t}):
    the exporter's example inputs and the TensorRT profiles are both read off the contract this way."""
    return tuple(sizes[d] if isinstance(d, str) else d for d in spec.dims)


# Manifest file names shared by exporter and runtimes.
MANIFEST = "manifest.json"
GRAPH_FILES = {PREFILL: "prefill.onnx", DECODE: "decode.onnx"}
ENGINE_FILES = {PREFILL: "prefill.engine", DECODE: "decode.engine"}  # TensorRT engines (tk build-engine)
ENGINE_META = "engine.json"


def position_ids_from_mask(mask):
    """Position ids the caller computes from a 2D mask: cumsum(mask) - 1, clamped at 0.

    Works on numpy arrays (and on torch tensors, which share the methods used here).
    """
    return (mask.cumsum(-1) - 1).clip(0)

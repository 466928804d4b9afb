"""What an export is, beside its precision: the `Variant` (target, cache layout, prefill logits, debug
outputs, opset) and the opset each graph is written in. Read by the contract (the graphs' shapes follow
the variant), the manifest (which records it), the exporter and the runtimes. Standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum


class Target(str, Enum):
    PORTABLE = "portable"  # standard ONNX: ONNX Runtime and TensorRT
    ORT = "ort"  # ONNX Runtime's fused contrib kernels, ONNX Runtime only


class CacheLayout(str, Enum):
    DYNAMIC = "dynamic"  # past in, a present one position longer out
    STATIC = "static"  # a fixed-capacity buffer written in place at per-row write indices


class PrefillLogits(str, Enum):
    ALL = "all"
    LAST = "last"  # the last position only: what generation needs


MIN_OPSET, DEFAULT_OPSET, MAX_OPSET = 18, 23, 23
STATIC_OPSET = 24  # TensorScatter: a static decode graph's cache write


@dataclass(frozen=True, kw_only=True)
class Variant:
    """What changes the graphs but not the contract's tensor names."""

    target: Target = Target.PORTABLE
    cache: CacheLayout = CacheLayout.DYNAMIC
    capacity: int | None = None  # the static cache's positions
    prefill_logits: PrefillLogits = PrefillLogits.ALL
    debug_outputs: bool = False  # each layer's hidden state as an extra output (hidden.{i})
    opset: int = DEFAULT_OPSET
    # the static decode graph also prefills (S >= 1 new tokens per row, contract.inputs): set for
    # --target ort --kv-cache static --prefill-logits last, where ONNX Runtime then runs one session
    decode_prefills: bool = False
    # the static decode graph attends over its attention_mask's width, not the whole cache (contract.inputs):
    # set for the portable target's static cache without rings (a ring's mask reads positions by index)
    narrow_mask: bool = False
    # the static decode graph that takes runs also takes `logits_to_keep` (contract.inputs): the run's
    # positions whose logits it returns, so one run verifies k speculated tokens (k + 1 rows of logits)
    # while a prompt's run still returns one row; set wherever decode_prefills is (artifacts before it: off)
    verify_logits: bool = False
    # no attention GEMM has one row: GQA's query heads are stacked per kv head (attention.attend, every export),
    # and an attention without that (multi-head, softcap or sinks) takes its run's queries and a copy of the last
    # one (whose output it drops). ONNX Runtime's CPU GEMM (MLAS) sums a lone row in a kernel of its own, whose
    # last bits differ from its several-row kernel's, and int8 compute then rounds the difference into logits
    # 0.2 apart; with it a row's logits are bit for bit alike in a one-token step and in a verify run (README
    # "Speculative decoding"). Set with verify_logits on the standard graphs, but TensorRT's (--for trt; the
    # fused ones attend in GroupQueryAttention, which takes a run over a past one row a batch: no query more)
    pad_queries: bool = False

    def __post_init__(self):  # accept the plain strings of the CLI and of manifest.json
        object.__setattr__(self, "target", Target(self.target))
        object.__setattr__(self, "cache", CacheLayout(self.cache))
        object.__setattr__(self, "prefill_logits", PrefillLogits(self.prefill_logits))

    @property
    def prefills_through_decode(self) -> bool:
        """ONNX Runtime on the CPU prefills through the decode graph by default (OrtRuntime.prefill_via): the
        fused graphs (one session) and the standard graphs that pad their queries (a row's prompt then computes
        alike alone, grouped and in chunks); other exports prefill through prefill.onnx."""
        return self.decode_prefills and (self.target is Target.ORT or self.pad_queries)

    def decode_opset(self, rings: bool) -> int:
        """The opset the decode graph is written in: a static cache is written with TensorScatter
        (STATIC_OPSET) unless ONNX Runtime's fused attention writes it, which it does for caches
        without rings (`rings`: some layer's static cache is a ring, contract.ring_sizes); else `opset`."""
        static = self.cache is CacheLayout.STATIC
        return STATIC_OPSET if static and (self.target is not Target.ORT or rings) else self.opset

    def to_dict(self) -> dict:
        return {k: v.value if isinstance(v, Enum) else v for k, v in dataclasses.asdict(self).items()}

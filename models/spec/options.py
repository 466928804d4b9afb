"""`tk export`'s options, checked before any weight is read: the export profiles (`--for NAME`: the
variant one deployment takes, `PROFILES`) and `ExportOptions`, built from the flags (`from_flags`),
completed from the model (`for_model`) and checked against it (`check`). What they produce, the
`Precision` and `Variant`, are models/spec/manifest.py's and variant.py's. Standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tk.models.spec.manifest import BLOCK_SIZES, DEFAULT_BLOCK, DEFAULT_METHOD, METHODS, MIXED, QUANTIZED, Precision
from tk.models.spec.variant import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET, CacheLayout, PrefillLogits, Target, Variant
from tk.models.spec import contract
from tk.models.spec.dtypes import canonical_dtype
from tk.models.spec.limits import fused_unsupported, layer_ks
from tk.models.spec.errors import UsageProblem


@dataclass(frozen=True)
class Profile:
    """`tk export --for NAME`: the variant for one deployment. Another value of a flag it sets is a
    usage error; --dtype, --weights and --block-size compose with it, within what it runs (`note`)."""

    target: Target
    cache: CacheLayout
    prefill_logits: PrefillLogits
    why: str  # one line: what the profile is for
    dtype: str = "fp32"  # --dtype when not given
    dtypes: tuple[str, ...] = ()  # the only activation dtypes the deployment runs (empty: any)
    weights: tuple[str, ...] = QUANTIZED  # the --weights it takes
    block_sizes: tuple[int, ...] = ()  # the quantization blocks it takes, preferred first (empty: any, default 32)
    note: str = ""  # why dtypes, weights or block sizes are limited
    symmetric: bool = False  # quantized blocks without zero points, and a float embedding
    # the standard graphs' attention has no GEMM of one row, so a row computes alike stepped and verified on ONNX
    # Runtime's CPU kernels (Variant.pad_queries); TensorRT picks its kernels by shape, where it would buy nothing
    pad_queries: bool = True

    def flags(self) -> dict[str, str]:
        return {"target": self.target.value, "kv-cache": self.cache.value, "prefill-logits": self.prefill_logits.value}


_MAX_SEQ_LEN_ALONE = "--max-seq-len sets the capacity of a static cache; add --kv-cache static"
# A profile's static cache holds the model's context, at most this many positions (--max-seq-len
# overrides): attention runs over the whole buffer and each row's cache is allocated up front, so a
# 128k-context model must not get a 128k cache by default. tk build-engine caps its default alike.
PROFILE_CAPACITY = 2048
ORT_FAST = (Target.ORT, CacheLayout.STATIC, PrefillLogits.LAST)  # decode_prefills: one CPU session
PORTABLE_STATIC = (Target.PORTABLE, CacheLayout.STATIC, PrefillLogits.LAST)
PROFILES: dict[str, Profile] = {
    # README "Faster graphs for ONNX Runtime": fused kernels, in-place cache, a decode graph that prefills
    "ort-cpu": Profile(*ORT_FAST, "ONNX Runtime on CPUs: fused kernels, in-place cache, one session"),
    # ORT's CUDA GroupQueryAttention kernel is registered for fp16 and bf16 only (a float32 graph would
    # run it on the CPU); on CUDA, OrtRuntime prefills through prefill.onnx
    "ort-cuda": Profile(*ORT_FAST, "ONNX Runtime's CUDA provider: fused kernels, in-place cache, fp16",
                        dtype="fp16", dtypes=("float16", "bfloat16"),
                        note="ONNX Runtime's CUDA GroupQueryAttention runs fp16 and bf16 only"),
    # the static cache maps to TensorRT's in-place KV-cache update layer and fixes every decode shape
    # but the batch (opset 23's RMSNormalization needs TensorRT 10.15 with either cache)
    "trt": Profile(*PORTABLE_STATIC, "TensorRT: standard ONNX, in-place cache", weights=("int4",),
                   block_sizes=(128, 64), symmetric=True, pad_queries=False,
                   note="TensorRT documents int4 weight-only quantization (symmetric blocks of 64 or 128, no zero "
                        "points) and no int8 weight-only path"),
    # the static cache's rows are the slots; standard ONNX serves on every backend (ort, trt, torch) and
    # in Triton's own onnxruntime and tensorrt models (tk triton --native)
    "serve": Profile(*PORTABLE_STATIC, "tk serve and tk triton: slots of a static cache, every backend"),
}


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    precision: Precision = Precision()
    variant: Variant = Variant()
    validate: bool = True
    force: bool = False
    profile: str | None = None  # tk export --for: capacity and block size may wait for the model (for_model)
    calibration: Path | None = None  # --calibration: the text whose statistics weight the search (Precision records them)
    cache_given: bool = False  # --kv-cache (or a profile) chose the cache layout: for_model keeps it

    @classmethod
    def from_flags(cls, *, profile: str | None = None, dtype: str | None = None, opset: int = DEFAULT_OPSET,
                   kv_cache: str | None = None, max_seq_len: int | None = None, target: str | None = None,
                   prefill_logits: str | None = None, debug_outputs: bool = False, validate: bool = True,
                   force: bool = False, weights: str | None = None, block_size: int | None = None,
                   quantize_lm_head: bool = True, quant_method: str | None = None, zero_points: bool | None = None,
                   mixed_precision: str | None = None, quantize_embedding: bool | None = None,
                   calibration=None, lm_head_block_size: int | None = None) -> "ExportOptions":
        """The options of `tk export`, each checked alone and in combination (usage errors, exit 2).
        A flag left None takes its default, or the profile's value."""
        if profile is not None and profile not in PROFILES:
            raise UsageProblem(f"unknown profile {profile!r}; use one of {', '.join(PROFILES)}")
        prof = PROFILES.get(profile)
        if weights is not None and weights not in QUANTIZED:
            raise UsageProblem(f"unknown --weights {weights!r}; use one of {', '.join(QUANTIZED)} (or leave it out "
                               "for weights in --dtype)")
        quant_flags = {"block-size": block_size, "quant-method": quant_method, "zero-points": zero_points,
                       "mixed-precision": mixed_precision, "quantize-embedding": quantize_embedding,
                       "calibration": calibration, "lm-head-block-size": lm_head_block_size}
        if weights is None and any(v is not None for v in quant_flags.values()):
            flag = next(f for f, v in quant_flags.items() if v is not None)
            raise UsageProblem(f"--{flag} is about quantized weights; add --weights int4 or int8")
        if weights is not None and opset < 21:
            raise UsageProblem(f"--weights {weights} needs --opset 21 or later (blocked DequantizeLinear, INT4)")
        if weights is not None and block_size is None and not (prof and prof.block_sizes):
            block_size = DEFAULT_BLOCK  # a profile's own blocks wait for the model's K (for_model)
        if lm_head_block_size is not None and lm_head_block_size not in BLOCK_SIZES:
            raise UsageProblem(f"--lm-head-block-size {lm_head_block_size} is not one ONNX Runtime's MatMulNBits "
                               f"takes; use one of {', '.join(map(str, BLOCK_SIZES))}")
        if block_size is not None and block_size not in BLOCK_SIZES:
            raise UsageProblem(f"--block-size {block_size} is not one ONNX Runtime's MatMulNBits takes; use one of "
                               f"{', '.join(map(str, BLOCK_SIZES))}")
        given = {"target": target, "kv-cache": kv_cache, "prefill-logits": prefill_logits}
        for value, kind in zip(given.values(), (Target, CacheLayout, PrefillLogits)):
            if value is not None and value not in {k.value for k in kind}:
                raise UsageProblem(f"unknown {kind.__name__} {value!r}; use one of "
                                   f"{', '.join(k.value for k in kind)}")
        if prof is not None:
            cls._check_profile(profile, prof, {**given, "dtype": dtype, "weights": weights, "block-size": block_size,
                                               "zero-points": zero_points, "quantize-embedding": quantize_embedding},
                               debug_outputs)
            target, kv_cache, prefill_logits = prof.flags().values()
            dtype = dtype or prof.dtype
        target, kv_cache, prefill_logits = target or "portable", kv_cache or "dynamic", prefill_logits or "all"
        if mixed_precision == "lm-head-w8a8":
            _check_w8a8(target, dtype, lm_head_block_size)
        if kv_cache == "static" and (2 if prof and max_seq_len is None else max_seq_len or 0) < 2:
            raise UsageProblem("--kv-cache static needs --max-seq-len N (N >= 2): the capacity of the cache")
        if kv_cache == "dynamic" and max_seq_len is not None and given["kv-cache"] is not None:
            raise UsageProblem(_MAX_SEQ_LEN_ALONE)
        if max_seq_len is not None and max_seq_len < 2:
            raise UsageProblem("--max-seq-len must be at least 2: the capacity of the static cache")
        if not MIN_OPSET <= opset <= MAX_OPSET:
            raise UsageProblem(f"opset {opset} is not supported; use {MIN_OPSET}..{MAX_OPSET} (default {DEFAULT_OPSET})")
        if debug_outputs and (kv_cache == "static" or target != "portable"):
            raise UsageProblem("--debug-outputs works with the dynamic cache and the portable target; drop "
                               "--kv-cache static and --target for a debug export")
        # a static decode graph takes a run of new tokens per row (contract.inputs): serving's chunked
        # prefill and cached prefixes continue a prompt through it; the fused one where it prefills too
        prefills = kv_cache == "static" and (target != Target.ORT.value or prefill_logits == "last")
        narrow = kv_cache == "static"  # (the fused graph's batched first runs need it: Runs.prefill_first)
        variant = Variant(target=target, cache=kv_cache, capacity=max_seq_len, prefill_logits=prefill_logits,
                          debug_outputs=debug_outputs, opset=opset, decode_prefills=prefills, narrow_mask=narrow,
                          verify_logits=prefills, pad_queries=prefills and pads_queries(target, prof))
        precision = Precision.of(dtype or "fp32")
        if weights is not None:
            precision = dataclasses.replace(precision, weights=weights, block_size=block_size,
                                            quantized_lm_head=quantize_lm_head, head_block=lm_head_block_size,
                                            **_quant_choices(prof, quantize_lm_head, quant_method, zero_points,
                                                             mixed_precision, quantize_embedding, lm_head_block_size))
        return cls(precision=precision, variant=variant, validate=validate, force=force, profile=profile,
                   calibration=None if calibration is None else Path(calibration),
                   cache_given=prof is not None or given["kv-cache"] is not None)

    @staticmethod
    def _check_profile(name: str, prof: Profile, given: dict, debug_outputs: bool) -> None:
        """Refuse a flag the profile sets, given another value, and a precision its deployment does not run."""
        if debug_outputs:
            raise UsageProblem(f"--for {name} conflicts with --debug-outputs: a debug export has the dynamic cache "
                               "and the portable target; drop one of them")
        fits = {"dtype": lambda v: not prof.dtypes or canonical_dtype(v) in prof.dtypes,
                "zero-points": lambda v: not (v and prof.symmetric),
                "quantize-embedding": lambda v: not (v and prof.symmetric),
                "weights": lambda v: v in prof.weights,
                "block-size": lambda v: not prof.block_sizes or v in prof.block_sizes}
        for flag, value in given.items():
            if value is not None and not fits.get(flag, lambda v: v == prof.flags()[flag])(value):
                why = prof.note if flag in fits else f"the profile exports --{flag} {prof.flags()[flag]}"
                raise UsageProblem(f"--for {name} conflicts with --{flag} {value}: {why}; drop one of them")

    def for_model(self, config) -> "ExportOptions":
        """These options with what a profile leaves to the model (a DecoderConfig) filled in: the
        static cache's capacity (the model's context, at most PROFILE_CAPACITY), the first of the
        profile's quantization blocks that divides every K, and a portable decode graph with rings
        taking one token a step."""
        v, p = self.variant, self.precision
        if config.stateful:
            v = self._stateful(config, v)
        elif v.cache is CacheLayout.DYNAMIC and v.capacity is not None:  # --max-seq-len alone: a hybrid's static cache
            raise UsageProblem(_MAX_SEQ_LEN_ALONE)
        if v.cache is CacheLayout.STATIC and v.capacity is None:
            v = dataclasses.replace(v, capacity=min(config.max_position_embeddings, PROFILE_CAPACITY))
        if v.decode_prefills and v.target is Target.PORTABLE and contract.ring_sizes(config.windows, v.capacity, 1):
            # a ring written by runs of tokens wraps around (a circular TensorScatter), which TensorRT's
            # KV-cache update cannot do: a portable ring takes one token a step (linear, at index mod slots)
            v = dataclasses.replace(v, decode_prefills=False, verify_logits=False, pad_queries=False)
        if p.quantized and p.quantized_embedding is None:
            # the embedding goes with the LM head: a tied one is its table, an untied one is stored in the same
            # scheme (tk's own quantization: a GPTQ/AWQ checkpoint's float embedding is kept). Measured on a real
            # untied checkpoint (README "Quantized weights"): half the file, 0.7% more KL divergence
            own = config.tie_embeddings or p.method in METHODS
            p = dataclasses.replace(p, quantized_embedding=own and p.quantized_lm_head
                                    and not (p.weights == "int4" and config.vocab_size % 2))
        if p.quantized and p.block_size is None:

            prof, ks = PROFILES[self.profile], layer_ks(config)  # only a profile leaves the block to the model
            fits = [b for b in prof.block_sizes if all(k % b == 0 for k in ks.values())]
            if not fits:
                layer, k = next((layer, k) for layer, k in ks.items() if k % min(prof.block_sizes))
                raise UsageProblem(f"--for {self.profile} --weights {p.weights}: blocks of "
                                   f"{' or '.join(map(str, prof.block_sizes))} rows are what it takes, and neither "
                                   f"divides the K of {layer}, {k}; leave out --weights")
            p = dataclasses.replace(p, block_size=fits[0])
        return dataclasses.replace(self, variant=v, precision=p)

    def _stateful(self, config, v: Variant) -> Variant:
        """A hybrid's variant (some layer carries a recurrent state): its one graph is a static decode graph
        that takes runs of tokens from a zero state, prompts included (contract.GraphDims.graphs), so the
        default cache is static, and a dynamic one asked for is refused."""
        if v.cache is CacheLayout.DYNAMIC and self.cache_given:
            raise UsageProblem(f"{config.architecture} carries a recurrent state in its "
                               f"{sum(config.mixer(i) != 'attention' for i in range(config.num_layers))} "
                               "non-attention layers, which tk exports in one static decode graph that also takes "
                               "prompts; drop --kv-cache dynamic (or use --kv-cache static)")
        if v.debug_outputs:
            raise UsageProblem(f"--debug-outputs works with the dynamic cache, and {config.architecture}'s recurrent "
                               "layers are exported with a static one; drop --debug-outputs")
        narrow = v.target is Target.PORTABLE
        return dataclasses.replace(v, cache=CacheLayout.STATIC, prefill_logits=PrefillLogits.LAST, decode_prefills=True,
                                   verify_logits=True, narrow_mask=narrow,
                                   pad_queries=pads_queries(v.target.value, PROFILES.get(self.profile)))

    def prequantized(self, pq, source: str) -> "ExportOptions":
        """These options for a GPTQ/AWQ checkpoint (models/checkpoint/prequantized.py `PreQuant`): its integers
        exported as they are, so no quantization flag may ask for other ones."""
        p = self.precision
        what = f"{source} is already quantized ({pq.method.upper()}, {pq.bits}-bit, groups of {pq.group})"
        if p.quantized:
            raise UsageProblem(f"{what}: tk exports its integers as they are; drop --weights and the other "
                               "quantization flags")
        if self.profile is not None and PROFILES[self.profile].symmetric:
            raise UsageProblem(f"{what}, with zero points, and --for {self.profile} takes symmetric blocks only; "
                               "export it for ONNX Runtime")
        return dataclasses.replace(self, precision=dataclasses.replace(
            p, weights=pq.weights, block_size=pq.group, method=pq.method, zero_points=True))

    def check(self, config, has_cuda_provider: Callable[[], bool] = lambda: False) -> None:
        """Refusals that depend on the model (a DecoderConfig), all before any weight is read.
        `has_cuda_provider` is asked only where it matters (validating bf16)."""
        v = self.variant
        if v.capacity is not None and v.capacity > config.max_position_embeddings:
            raise UsageProblem(f"--max-seq-len ({v.capacity}) is beyond the model's context of "
                               f"{config.max_position_embeddings}")
        if v.target is Target.ORT:

            problems = fused_unsupported(config)
            if problems:
                raise UsageProblem(f"--target ort does not support {' or '.join(problems)} ({config.architecture}); "
                                   "export with --target portable")
        p = self.precision
        if p.quantized:
            if p.quantized_embedding and config.tie_embeddings and not p.quantized_lm_head:
                raise UsageProblem("a tied embedding is quantized as the LM head's table; drop --no-quantize-lm-head "
                                   "or add --no-quantize-embedding")
            if p.quantized_embedding and p.weights == "int4" and config.vocab_size % 2:
                raise UsageProblem(f"an int4 embedding is gathered two columns a byte, and the vocabulary "
                                   f"({config.vocab_size}) is odd; add --no-quantize-embedding")
            if p.activations == "bfloat16" and not has_cuda_provider():
                raise UsageProblem(f"{p.weights} weights with bf16 activations have no ONNX Runtime CPU kernel "
                                   "(MatMulNBits takes fp32 or fp16); use --dtype fp32 or fp16")
        if self.validate and self.precision.activations == "bfloat16" and not has_cuda_provider():
            raise UsageProblem("bf16 graphs cannot be validated here: ONNX Runtime's CPU provider has no bf16 "
                               "MatMul; export with --no-validate and check on a GPU (tk parity), or use --dtype fp16")


# the quantization flags' checks (ExportOptions.from_flags)
def _quant_choices(prof: Profile | None, lm_head: bool, method: str | None, zero_points: bool | None,
                   mixed: str | None, embedding: bool | None, head: int | None) -> dict:
    """The quantization flags with their defaults (a profile's symmetric blocks, else zero
    points; the search; the embedding quantized with the LM head: for_model),
    checked together."""
    method, mixed = method or DEFAULT_METHOD, mixed or "none"
    if method not in METHODS:
        raise UsageProblem(f"unknown --quant-method {method!r}; use one of {', '.join(METHODS)}")
    if mixed not in MIXED:
        raise UsageProblem(f"unknown --mixed-precision {mixed!r}; use one of {', '.join(MIXED)}")
    symmetric = prof is not None and prof.symmetric
    zero_points = (not symmetric) if zero_points is None else zero_points
    if symmetric and embedding is None:
        embedding = False  # else for_model decides: a tied table is quantized with the LM head
    if not lm_head and head is not None:
        raise UsageProblem("--lm-head-block-size sets the quantized LM head's block; drop --no-quantize-lm-head")
    if mixed != "none" and not lm_head:
        raise UsageProblem(f"--mixed-precision {mixed} keeps the LM head in int8; drop --no-quantize-lm-head")
    return {"method": method, "zero_points": zero_points, "mixed": mixed, "quantized_embedding": embedding}


def pads_queries(target: str, prof: Profile | None) -> bool:
    """Whether the graphs of a decode graph that verifies runs pad their queries (Variant.pad_queries): the
    standard ones, but TensorRT's (--for trt)."""
    return target == Target.PORTABLE.value and (prof is None or prof.pad_queries)


def _check_w8a8(target: str, dtype: str | None, head_block: int | None) -> None:
    """--mixed-precision lm-head-w8a8: ONNX Runtime's integer GEMM, on float32 activations, one scale a column."""
    flag = "--mixed-precision lm-head-w8a8"
    if target != Target.ORT.value:
        raise UsageProblem(f"{flag} runs on ONNX Runtime's integer GEMM (MatMulIntegerToFloat); export with "
                           "--for ort-cpu (or --target ort), or use --mixed-precision lm-head")
    if dtype is not None and canonical_dtype(dtype) != "float32":
        raise UsageProblem(f"{flag} takes float32 activations, not {dtype}; drop --dtype {dtype}")
    if head_block is not None:
        raise UsageProblem(f"{flag} gives the LM head one scale a column; drop --lm-head-block-size")

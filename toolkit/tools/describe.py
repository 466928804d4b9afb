"""`tk inspect`: what a checkpoint or an artifact holds, and what it will cost in memory.
(Named describe, not inspect, so that it does not shadow the standard library's module.)"""

from __future__ import annotations

import math
from pathlib import Path

from tk.models.spec import contract
from tk.models.spec.manifest import Manifest, Precision
from tk.models.spec.variant import Variant
from tk.models.spec.options import PROFILES, pads_queries
from tk.models.spec.config import DecoderConfig
from tk.models.spec.dtypes import DTYPES
from tk.models.checkpoint.loading import read_config
from tk.models.checkpoint.names import hf_shapes, weight_map


def parameter_count(cfg: DecoderConfig) -> int:
    return sum(math.prod(s) for s in hf_shapes(cfg).values())


def active_parameter_count(cfg: DecoderConfig) -> int:
    """The parameters one token runs through: all of them, less, in a mixture of experts, the experts
    it does not take ((num_experts - experts_per_token) / num_experts of every routed expert)."""
    shapes = hf_shapes(cfg)

    def size(p) -> int:  # a part's rows times the rest of one row (one expert's matrix: rows last where transposed)
        one = shapes[p.name][1:] if p.experts else shapes[p.name]
        return p.rows * math.prod(one[:-1] if p.transposed else one[1:])

    experts = sum(size(p) for ours, parts in weight_map(cfg).items() if ".experts." in ours for p in parts)
    idle = experts * (cfg.num_experts - cfg.experts_per_token) // cfg.num_experts if cfg.moe else 0
    return sum(math.prod(s) for s in shapes.values()) - idle


def memory_plan(cfg: DecoderConfig, precision: Precision, batch: int, seq_len: int,
                weights_bytes: int | None = None, dims: contract.GraphDims | None = None) -> dict:
    """Weights + KV bytes (in the cache's dtype). A dynamic cache holds every position of every layer:
    KV = 2 * layers * batch * seq * kv_heads * head_dim * bytes; a static one (an artifact's `dims`)
    holds each layer's capacity, a sliding layer's ring only its slots. Weights: `weights_bytes` (an
    artifact's, counted from its graphs), else the checkpoint's parameters in the weights' dtype."""
    dims = dims or contract.GraphDims.of(cfg, precision, Variant())
    weights = weights_bytes if weights_bytes is not None else int(parameter_count(cfg) * DTYPES[precision.weights].bytes)
    static = dims.kv_capacity is not None
    kv = dims.static_cache_bytes(batch) if static else dims.kv_bytes_per_token(batch) * seq_len
    # TensorRT: prefill.engine and decode.engine each embed the weights; refit only replaces an
    # engine's own weights, and no documented TensorRT API lets two engines read one device copy
    # (README, "Memory"), so on the GPU the weights are there twice.
    kv_layers = [i for i, layer in enumerate(dims.layer_states()) if layer.kv]
    plan = {"dtype": precision.activations, "weights_dtype": precision.weights, "kv_dtype": precision.kv,
            "batch": batch, "seq_len": dims.kv_capacity if static else seq_len, "weights_bytes": weights,
            "trt_weights_bytes": 2 * weights, "kv_bytes_per_token": dims.kv_bytes_per_token(1), "kv_bytes": kv,
            "total_bytes": weights + kv, "kv_cache": "static" if static else "dynamic",
            "kv_positions": [(dims.capacities() if static else [seq_len] * dims.num_layers)[i] for i in kv_layers],
            "rings": [dims.ring is not None and dims.ring[i] is not None for i in kv_layers]}
    if dims.stateful:
        plan["state"] = state_plan(cfg, dims, seq_len)
    elif dims.layers is not None:
        plan["caches"] = cache_plan(dims)
    return plan


def cache_plan(dims: contract.GraphDims) -> list[dict]:
    """Per layer, its cache where layers differ (Gemma 4): kv heads and head dim, or the layer whose cache it reads."""
    return [{"layer": i, "reads": layer.reads} if layer.reads is not None else
            {"layer": i, "kv_heads": dims.kv_shape(i)[0], "head_dim": dims.kv_shape(i)[1]}
            for i, layer in enumerate(dims.layer_states())]


def state_plan(cfg: DecoderConfig, dims: contract.GraphDims, seq_len: int) -> dict:
    """A hybrid's memory per slot: each layer's state (a recurrent layer's tensors, whatever the context; an
    attention layer's keys and values at `seq_len` positions), and, beside it, what a model of the same
    size with attention in every layer would hold at that context."""
    per_position = 2 * dims.num_kv_heads * dims.head_dim * DTYPES[dims.kv_dtype].bytes
    layers = []
    for i, layer in enumerate(dims.layer_states()):
        if layer.kv:
            layers.append({"layer": i, "mixer": "attention", "kv_positions": seq_len,
                           "bytes": dims.kv_position_bytes(i) * seq_len})
        else:
            layers.append({"layer": i, "mixer": cfg.mixer(i), "bytes": dims.state_bytes(i),
                           "tensors": [{"name": n, "shape": list(shape)} for n, shape in layer.tensors]})
    return {"seq_len": seq_len, "layers": layers, "bytes_per_slot": sum(x["bytes"] for x in layers),
            "recurrent_bytes_per_slot": sum(x["bytes"] for x in layers if x["mixer"] != "attention"),
            "all_attention_bytes_per_slot": per_position * seq_len * dims.num_layers}


def weight_bytes_by_dtype(artifact: Path, manifest) -> dict[str, int]:
    """Bytes of the weights file by data type, from the manifest's table (a 4-bit table's bytes
    counted once, as its 4-bit type, not again as the uint8 view an embedding's Gather reads)."""
    by_offset: dict[int, tuple[int, str]] = {}
    for offset, length, dtype, *_ in sorted(manifest.weights.values(), key=lambda e: e.dtype not in ("int4", "uint4")):
        by_offset.setdefault(offset, (length, dtype))
    out: dict[str, int] = {}
    for length, dtype in by_offset.values():
        out[dtype] = out.get(dtype, 0) + length
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def matching_profiles(variant: Variant, precision: Precision) -> list[str]:
    """The profiles (tk export --for) whose graphs a variant and precision are, whatever the capacity."""
    return [name for name, p in PROFILES.items()
            if (p.target, p.cache, p.prefill_logits) == (variant.target, variant.cache, variant.prefill_logits)
            and not variant.debug_outputs and (not p.dtypes or precision.activations in p.dtypes)
            and variant.pad_queries == (variant.verify_logits and pads_queries(p.target.value, p))
            and (not precision.quantized or precision.weights in p.weights
                 and (not p.block_sizes or precision.block_size in p.block_sizes))]


def describe_profile(profile: str | None, same: list[str]) -> str:
    """Which profile an artifact is (tk inspect, tk bench): the one it was exported --for, else none,
    naming the profiles (`same`, from matching_profiles) whose graphs its explicit flags wrote."""
    if profile is not None:
        return f"{profile} (tk export --for {profile})"
    same_as = " or ".join(f"--for {name}" for name in same)
    return f"none (explicit flags{'; the same graphs as ' + same_as if same else ''})"


def _io_table(path: Path) -> tuple[list[dict], int, dict]:
    import onnx

    from tk.exporters.contract_check import describe_value, op_histogram
    from tk.exporters.onnx_util import opset_of

    model = onnx.load(str(path), load_external_data=False)
    rows = [{"kind": kind, "name": n, "dtype": d, "dims": list(s)}
            for kind, values in (("input", model.graph.input), ("output", model.graph.output))
            for n, d, s in map(describe_value, values)]
    return rows, opset_of(model), op_histogram(model)


def validation_summary(manifest: Manifest) -> dict:
    """manifest.json's validation record without its per-case comparisons."""
    v = manifest.validation
    return {"skipped": True} if v is None else {k: x for k, x in v.to_dict().items() if k != "comparisons"}


def inspect_path(path: str | Path, batch: int = 1, seq_len: int | None = None) -> dict:
    path = Path(path)
    if (path / contract.MANIFEST).is_file():
        manifest = Manifest.read(path)
        cfg = manifest.config
        precision = manifest.precision
        graphs = {}
        for graph in manifest.dims.graphs:
            io, opset, ops = _io_table(path / manifest.graphs[graph].file)
            graphs[graph] = {"io": io, "opset": opset, "ops": ops}
        v = manifest.variant
        by_dtype = weight_bytes_by_dtype(path, manifest)
        info = {"kind": "artifact", "precision": precision.describe(), "weights_by_dtype": by_dtype, "path": str(path), "source": manifest.source.path, "graphs": graphs,
                "profile": manifest.profile, "same_graphs_as": matching_profiles(v, precision),
                "target": v.target.value, "kv_cache": v.cache.value,
                "capacity": v.capacity, "prefill_logits": v.prefill_logits.value,
                "decode_prefills": v.decode_prefills, "verify_logits": v.verify_logits, "pad_queries": v.pad_queries,
                "trt_lint": manifest.trt_lint,
                "validation": validation_summary(manifest)}
    else:
        cfg = read_config(path)
        precision = Precision()
        info = {"kind": "checkpoint", "path": str(path)}
    seq_len = seq_len or cfg.max_position_embeddings
    info.update({
        "architecture": cfg.architecture,
        "parameters": parameter_count(cfg),
        "active_parameters": active_parameter_count(cfg),
        "config": cfg.to_dict(),
        "memory": memory_plan(cfg, precision, batch, seq_len, sum(info["weights_by_dtype"].values())
                              if "weights_by_dtype" in info else None, manifest.dims if "graphs" in info else None),
    })
    return info


def _positions(m: dict) -> str:
    """Each layer's cache positions, grouped: '8 (ring) x2, 64 x1'."""
    groups: dict[tuple, int] = {}
    for n, ring in zip(m["kv_positions"], m["rings"]):
        groups[(n, ring)] = groups.get((n, ring), 0) + 1
    return ", ".join(f"{n}{' (ring)' if ring else ''} x{count}" for (n, ring), count in groups.items())


def _cache_lines(caches: list[dict]) -> list[str]:
    """Each layer's cache by its sizes, and the KV-shared layers with whose cache each reads."""
    sizes: dict[tuple[int, int], list[int]] = {}
    for c in caches:
        if "reads" not in c:
            sizes.setdefault((c["kv_heads"], c["head_dim"]), []).append(c["layer"])
    groups = [f"layer{'s' * (len(layers) > 1)} {', '.join(map(str, layers))}: {h} kv heads x head_dim {d}"
              for (h, d), layers in sizes.items()]
    lines = ["KV caches per layer: " + "; ".join(groups)]
    reads = [f"layer {c['layer']} reads layer {c['reads']}'s" for c in caches if "reads" in c]
    if reads:
        lines.append(f"KV-shared layers (no cache of their own): {', '.join(reads)}")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _state_lines(st: dict) -> list[str]:
    """A hybrid's state per slot, by kind of layer, against attention in every layer at the same context."""
    kinds: dict[str, list[dict]] = {}
    for layer in st["layers"]:
        kinds.setdefault(layer["mixer"], []).append(layer)
    lines = [f"state per slot at {st['seq_len']:,} positions: {_mib(st['bytes_per_slot'])} "
             f"({_mib(st['recurrent_bytes_per_slot'])} of it recurrent, the same at any length); attention in "
             f"every layer would hold {_mib(st['all_attention_bytes_per_slot'])}"]
    for mixer, layers in kinds.items():
        shapes = "; ".join(f"{t['name']} {'x'.join(map(str, t['shape']))}" for t in layers[0].get("tensors", []))
        what = shapes or f"keys and values of {layers[0]['kv_positions']:,} positions"
        lines.append(f"  {mixer} layers {', '.join(str(x['layer']) for x in layers)}: {what}, "
                     f"{_mib(layers[0]['bytes'])} each")
    return lines


def format_info(info: dict) -> str:
    c, m = info["config"], info["memory"]
    active = info["active_parameters"]
    lines = [
        f"{info['kind']}: {info['path']}",
        f"architecture: {info['architecture']}  parameters: {info['parameters']:,}"
        + (f" ({active:,} active per token)" if active != info["parameters"] else ""),
        f"layers {c['num_layers']}  hidden {c['hidden_size']}  heads {c['num_heads']}  kv heads {c['num_kv_heads']}  "
        f"head_dim {c['head_dim']}  vocab {c['vocab_size']}  context {c['max_position_embeddings']}",
        f"memory (weights {m['weights_dtype']}, KV {m['kv_dtype']}, batch {m['batch']}, seq {m['seq_len']}): "
        f"weights {_mib(m['weights_bytes'])} + "
        f"KV {_mib(m['kv_bytes'])} = {_mib(m['total_bytes'])}  (KV per token {m['kv_bytes_per_token']:,} B; "
        f"{m['kv_cache']} cache, positions per layer: {_positions(m)})",
    ]
    if "state" not in m:  # (a hybrid has one graph, and no TensorRT engines)
        lines.append(f"on ONNX Runtime both graphs share one memory-mapped copy of the weights; TensorRT's two engines "
                     f"hold one each: {_mib(m['trt_weights_bytes'])} of weights on the GPU")
    if "state" in m:
        lines += _state_lines(m["state"])
    if "caches" in m:
        lines += _cache_lines(m["caches"])
    if "target" in info:
        lines.append(f"profile: {describe_profile(info['profile'], info['same_graphs_as'])}")
        cache = info["kv_cache"] + (f" ({info['capacity']} positions)" if info.get("capacity") else "")
        lines.append(f"target {info['target']}  kv cache {cache}  prefill logits {info['prefill_logits']}"
                     + ("  decode graph also prefills (ONNX Runtime on the CPU runs one session)"
                        if info.get("decode_prefills") else "")
                     + ("; it verifies speculated tokens in one run" if info.get("verify_logits") else "")
                     + (", bit for bit as its steps (no attention GEMM of one row)" if info.get("pad_queries") else ""))
        lines.append(f"precision: {info['precision']}; weights by dtype: " +
                     ", ".join(f"{k} {_mib(v)}" for k, v in info["weights_by_dtype"].items()))
    for graph, g in info.get("graphs", {}).items():
        lines.append(f"\n{graph} graph (opset {g['opset']}):")
        lines += [f"  {r['kind']:6} {r['name']:28} {r['dtype']:8} {r['dims']}" for r in g["io"]]
        lines.append("  ops: " + ", ".join(f"{k} {v}" for k, v in g["ops"].items()))
    if info.get("trt_lint"):
        lint = info["trt_lint"]
        lines.append(f"\nTensorRT lint: {'ok' if lint['ok'] else 'FAILED'}; needs TensorRT >= {lint['min_tensorrt']}")
        lines += [f"  {p['graph']}: [{p['rule']}] {p['message']}" for p in lint["problems"]]
    if "validation" in info:
        v = info["validation"]
        lines.append("\nvalidation: " + ("skipped" if v.get("skipped") else "passed" if v["passed"] else "FAILED"))
    return "\n".join(lines)

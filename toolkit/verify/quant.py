"""What a quantized artifact must also pass, after its graphs matched the quantized reference:

- every quantized MatMul fused: ONNX Runtime turns `MatMul(x, DequantizeLinear(...))` into
  MatMulNBits at session creation, and an unfused pair still runs, 56-120x slower per matmul; the
  optimized graph ORT writes (`optimized_model_filepath`) is counted, and an unfused one named;
- quantization error, measured and recorded: ORT as users run it ("int8" compute) against the
  full-precision float32 reference, top-1 agreement, top-5 overlap and KL, with no bound on the
  logits themselves (quantization moves them by far more than rounding), against a token table.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from tk.models.spec import contract
from tk.models.spec.errors import CheckFailed
from tk.toolkit.verify.compare import ReferenceRun
from tk.toolkit.verify.metrics import StepMetrics, measure_traces, run_trace

# weights -> (least mean top-1 agreement, least mean top-5 overlap, largest mean of each step's
# worst KL), over every position of the validation cases. Calibrated on the `trained` preset (a
# model really trained, models/fixtures/presets.py), int8 compute, block 32: int4 measured 0.996 / 0.935 /
# 0.0047, int8 1.000 / 0.992 / 5.4e-5; the table leaves about 2x (10x for KL) of room. Random
# models lose far more (trained-like: int8 keeps 0.67 of its top-1, int4 0.02): they amplify any
# perturbation, so on them the record says "more than the table expects" and export goes on.
QUANT_TABLE = {"int4": (0.9, 0.8, 0.05), "int8": (0.98, 0.95, 0.001)}


def fused_matmuls(artifact: Path, manifest) -> dict[str, tuple[int, list[str]]]:
    """graph -> (MatMulNBits nodes in ONNX Runtime's optimized graph, names of the quantized
    MatMuls it left unfused)."""
    import onnx
    import onnxruntime as ort

    from tk.runtimes.backends.ort_pool import session_options

    out = {}
    paths = manifest.verify_files(artifact)
    for graph in manifest.dims.graphs:
        with tempfile.TemporaryDirectory() as tmp:
            opts = session_options(ort)
            opts.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
            opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
            opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            ort.InferenceSession(str(paths[graph]), opts, providers=["CPUExecutionProvider"])
            model = onnx.load(str(Path(tmp) / "optimized.onnx"), load_external_data=False)
        dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
        fused = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
        unfused = [n.name or n.output[0] for n in model.graph.node if n.op_type == "MatMul" and set(n.input) & dq]
        out[graph] = (fused, unfused)
    return out


def expected_quantized(manifest) -> int:
    """The quantized MatMuls ONNX Runtime fuses into MatMulNBits: all but a W8A8 one (MatMulIntegerToFloat)."""
    from tk.models.quant.plan import quant_plan

    return sum(name != "embed.weight" and not scheme.int8_inputs
               for name, scheme in quant_plan(manifest.config, manifest.precision).items())


def check_fused(artifact: Path, manifest) -> dict[str, int]:
    """Raise CheckFailed, naming it, when ONNX Runtime left a quantized MatMul unfused; -> the
    MatMulNBits count of each graph."""
    want = expected_quantized(manifest)
    fused = fused_matmuls(artifact, manifest)
    for graph, (count, unfused) in fused.items():
        if unfused or count != want:
            name = f": {unfused[0]} is a MatMul of a dequantized weight" if unfused else ""
            raise CheckFailed(f"ONNX Runtime fused {count} of the {want} quantized MatMuls of the {graph} graph "
                              f"into MatMulNBits{name}; unfused they run 56-120x slower. Re-export, and report "
                              "this with the ONNX Runtime version")
    return {g: f[0] for g, f in fused.items()}


def quantization_error(artifact: Path, manifest, full_reference: ReferenceRun, cases: dict,
                       steps: int) -> tuple[dict, str]:
    """ORT as users run it ("int8" compute) against the full-precision float32 reference, teacher-
    forced and measured, not gated (quantization moves the logits by far more than any rounding
    bound): the record (means over the cases' steps, and whether they are within QUANT_TABLE) and
    a printable table. Quantization error is the model's and the method's, not an export bug: the
    caller reports it; `tk eval` measures what it costs on the user's text."""
    from tk.runtimes.backends.ort import OrtRuntime

    measured: dict[str, list[StepMetrics]] = {}
    with OrtRuntime(artifact, swap_sessions=True, quant_compute="int8") as ort:
        backend = ort.name
        for case, (ids, mask) in cases.items():
            ref = full_reference.traces[case]
            measured[case] = measure_traces(ref, run_trace(ort, ids, mask, steps, forced=ref.tokens,
                                                           keep_present=False), mask)
    steps_all = [s for ms in measured.values() for s in ms]
    min_top1, min_top5, max_kl = QUANT_TABLE[manifest.precision.weights]
    means = {"top1_mean": float(np.mean([s.top1 for s in steps_all])),
             "top5_mean": float(np.mean([s.top5 for s in steps_all])),
             "kl_max_mean": float(np.mean([s.kl_max for s in steps_all])),
             "max_abs": max(s.max_abs for s in steps_all)}
    within = means["top1_mean"] >= min_top1 and means["top5_mean"] >= min_top5 and means["kl_max_mean"] <= max_kl
    record = {"within_table": bool(within), "reference": "torch float32, full-precision weights",
              "compute": "int8 (MatMulNBits accuracy level 4)",
              "table": {"top1_mean_min": min_top1, "top5_mean_min": min_top5, "kl_max_mean_max": max_kl},
              **means, "comparisons": [{"backend": backend, "reference": full_reference.backend, "case": case,
                                        "steps": [asdict(s) for s in ms]} for case, ms in measured.items()]}
    label = (f"quantization error ({manifest.precision.weights}, int8 compute) vs the full-precision reference: "
             f"top-1 {means['top1_mean']:.3f}, top-5 {means['top5_mean']:.3f}, KL {means['kl_max_mean']:.3g} "
             f"(table: >= {min_top1}, >= {min_top5}, <= {max_kl})")
    return record, label + "\n" + _table(backend, measured)


def _table(backend: str, measured: dict[str, list[StepMetrics]]) -> str:
    """One row per case: the worst of each metric over its steps."""
    lines = [f"{'backend':8} {'case':20} {'steps':>5} {'max_abs':>9} {'mean_abs':>9} {'max_rel':>9} {'cos_min':>9} "
             f"{'top1':>5} {'top5':>5} {'kl_max':>8}"]
    for case, s in measured.items():
        lines.append(f"{backend:8} {case:20} {len(s):>5} {max(x.max_abs for x in s):9.3g} "
                     f"{max(x.mean_abs for x in s):9.3g} {max(x.max_rel for x in s):9.3g} "
                     f"{min(x.cosine_min for x in s):9.6f} {min(x.top1 for x in s):5.2f} "
                     f"{min(x.top5 for x in s):5.2f} {max(x.kl_max for x in s):8.2g}")
    return "\n".join(lines)

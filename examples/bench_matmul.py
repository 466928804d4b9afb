"""What one weight MatMul costs on ONNX Runtime's CPU kernels as its rows grow: an artifact's
projections and LM head as an fp32 MatMul, as MatMulNBits int4 (what a `--weights int4` export
runs: block 32 and 128, accuracy level 4 = int8 compute, 1 = float compute) and as int8 weights
times activations quantized to int8 per tensor (DynamicQuantizeMatMul: MLAS's integer GEMM, which
uses AMX or VNNI where the CPU has them; not what tk exports: its activations' scale is the whole
batch's, so a row's result depends on the others). Each contender is a session of its own, the
contenders alternate round by round, and the table reports medians and each one's ratio to fp32.
Why a quantized server's batches cost what they do (README, "Serving").

    python examples/bench_matmul.py ARTIFACT [--rows 1,16,512] [--threads 2] [--rounds 5]

ARTIFACT: any tk export (its manifest's config gives the shapes; the weights are random).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tk.models.spec.manifest import Manifest

# name -> (block size, accuracy level) of MatMulNBits int4; "fp32" and "int8" are the other two
CONTENDERS = {"fp32": None, "int4 b32 L4": (32, 4), "int4 b32 L1": (32, 1), "int4 b128 L4": (128, 4), "int8 q8": None}


def shapes(config) -> dict[str, tuple[int, int]]:
    """Each weight's (K, N): a layer's fused projections and the LM head."""
    h, hd = config.hidden_size, config.head_dim
    return {"qkv": (h, (config.num_heads + 2 * config.num_kv_heads) * hd), "o": (config.num_heads * hd, h),
            "gate_up": (h, 2 * config.intermediate_size), "down": (config.intermediate_size, h),
            "lm_head": (h, config.vocab_size)}


def graph(kind: str, k: int, n: int, rows: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    domain = "com.microsoft"
    if kind == "fp32":
        inits = [numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, "W")]
        node = helper.make_node("MatMul", ["A", "W"], ["Y"])
    elif kind == "int8 q8":
        inits = [numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), "W"),
                 numpy_helper.from_array(rng.random(n, dtype=np.float32) * 1e-3, "S"),
                 numpy_helper.from_array(np.zeros(n, np.int8), "Z")]
        node = helper.make_node("DynamicQuantizeMatMul", ["A", "W", "S", "Z"], ["Y"], domain=domain)
    else:
        block, level = CONTENDERS[kind]
        blocks = -(-k // block)
        inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8), "W"),
                 numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) * 1e-2, "S"),
                 numpy_helper.from_array(rng.integers(0, 256, n * -(-blocks // 2), dtype=np.uint8), "Z")]
        node = helper.make_node("MatMulNBits", ["A", "W", "S", "Z"], ["Y"], domain=domain, K=k, N=n, bits=4,
                                block_size=block, accuracy_level=level)
    g = helper.make_graph([node], kind, [helper.make_tensor_value_info("A", TensorProto.FLOAT, [rows, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [rows, n])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
    return model.SerializeToString()


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--rows", default="1,16,512", help="comma-separated rows (tokens) per MatMul")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="runs a contender makes in a round")
    args = ap.parse_args()
    config = Manifest.read(args.artifact).config
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.log_severity_level = 3
    rng = np.random.default_rng(1)
    print(f"{args.artifact}: {config.num_layers} layers; ms per MatMul, median of {args.rounds} rounds "
          f"(ratio to fp32), {args.threads} threads")
    print(f"{'weight':8} {'K x N':>14} {'rows':>5}  " + "  ".join(f"{c:>18}" for c in CONTENDERS))
    for name, (k, n) in shapes(config).items():
        for rows in (int(r) for r in args.rows.split(",")):
            sessions = {c: ort.InferenceSession(graph(c, k, n, rows), opts, providers=["CPUExecutionProvider"])
                        for c in CONTENDERS}
            a = {"A": rng.standard_normal((rows, k), dtype=np.float32)}
            for s in sessions.values():
                s.run(None, a)
            times = {c: [] for c in sessions}
            for _ in range(args.rounds):
                for c, s in sessions.items():
                    tick = time.perf_counter()
                    for _ in range(args.repeats):
                        s.run(None, a)
                    times[c].append((time.perf_counter() - tick) / args.repeats * 1e3)
            med = {c: statistics.median(t) for c, t in times.items()}
            print(f"{name:8} {f'{k} x {n}':>14} {rows:>5}  "
                  + "  ".join(f"{med[c]:8.2f} ({med[c] / med['fp32']:4.2f}x)" for c in CONTENDERS), flush=True)


if __name__ == "__main__":
    main()

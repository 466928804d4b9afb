"""How a portable graph should compute a recurrent layer's rule: tk's closed form against a token loop.

One gated DeltaNet layer's rule (the gated delta rule, Qwen3.5-0.8B's sizes by default: 16 heads of
128 x 128) and one Mamba2 layer's (the gated rule), over a run of T tokens from a state, in ONNX
Runtime on the CPU, three ways:
- `closed`: what `tk export` writes for the portable target (models/reference/recurrent.py
  linear_attention, exported by torch.onnx: standard ops, no control flow; a run of at most 64);
- `onnx27-loop`: ONNX 1.23's standard `LinearAttention` (opset 27), a function over `Scan` that
  ONNX Runtime expands: the token loop, in standard ONNX;
- `ort-kernel`: ONNX Runtime's `com.microsoft.LinearAttention` (what `--for ort-cpu` writes).
Each is timed at T = 1 (a decode step), 16 and 64 (a prompt's run), alternating the contenders
round by round (the machine is shared: compare within one run), median over the rounds; the
outputs are checked against each other first.

    python examples/bench_recurrence.py [--heads 16 --dk 128 --dv 128] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from tk.models.reference.recurrent import linear_attention

RUNS = (1, 16, 64)


def _closed(path: Path, heads: int, dk: int, dv: int, delta: bool) -> None:
    """tk's closed form, exported as the portable graphs are (opset 23, T dynamic up to 64)."""
    from torch.export import Dim

    class Rule(torch.nn.Module):
        def forward(self, q, k, v, state, decay, beta):
            B, T = q.shape[:2]
            heads_of = lambda t: t.reshape(B, T, heads, -1).transpose(1, 2)  # noqa: E731
            o, new = linear_attention(heads_of(q), heads_of(k), heads_of(v), state, decay.transpose(1, 2),
                                      beta.transpose(1, 2) if delta else None, dk ** -0.5)
            return o.transpose(1, 2).reshape(B, T, -1), new

    args = _inputs(4, heads, dk, dv)
    T = Dim("T", min=1, max=64)
    shapes = ({1: T}, {1: T}, {1: T}, {}, {1: T}, {1: T})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(Rule(), tuple(torch.from_numpy(a) for a in args), dynamo=True, opset_version=23,
                                    dynamic_shapes=shapes, input_names=NAMES, output_names=["o", "s1"], verbose=False)
    program.save(str(path))


NAMES = ["q", "k", "v", "s0", "g", "beta"]


def _op(path: Path, domain: str, heads: int, dk: int, dv: int, delta: bool) -> None:
    """One LinearAttention node: opset 27's standard op, or ONNX Runtime's contrib kernel."""
    shapes = [["B", "T", heads * dk], ["B", "T", heads * dk], ["B", "T", heads * dv], ["B", heads, dk, dv],
              ["B", "T", heads], ["B", "T", heads]]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(NAMES, shapes)]
    node = helper.make_node("LinearAttention", NAMES if delta else NAMES[:5], ["o", "s1"], domain=domain,
                            q_num_heads=heads, kv_num_heads=heads, scale=dk ** -0.5,
                            update_rule="gated_delta" if delta else "gated")
    outs = [helper.make_tensor_value_info("o", TensorProto.FLOAT, ["B", "T", heads * dv]),
            helper.make_tensor_value_info("s1", TensorProto.FLOAT, ["B", heads, dk, dv])]
    opsets = [helper.make_opsetid("", 27)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(helper.make_graph([node], "rule", ins if delta else ins[:5], outs), opset_imports=opsets,
                              ir_version=10)
    onnx.save(model, str(path))


def _inputs(T: int, heads: int, dk: int, dv: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    unit = lambda a: (a / np.linalg.norm(a, axis=-1, keepdims=True)).reshape(1, T, -1).astype(np.float32)  # noqa
    return [unit(rng.standard_normal((1, T, heads, dk))), unit(rng.standard_normal((1, T, heads, dk))),
            rng.standard_normal((1, T, heads * dv), dtype=np.float32),
            rng.standard_normal((1, heads, dk, dv), dtype=np.float32),
            -rng.uniform(0.01, 1, (1, T, heads)).astype(np.float32), rng.uniform(0, 1, (1, T, heads)).astype(np.float32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        for delta, rule in ((True, "gated delta (DeltaNet)"), (False, "gated (Mamba2)")):
            sessions = {}
            for name, write in (("closed", lambda p: _closed(p, a.heads, a.dk, a.dv, delta)),
                                ("onnx27-loop", lambda p: _op(p, "", a.heads, a.dk, a.dv, delta)),
                                ("ort-kernel", lambda p: _op(p, "com.microsoft", a.heads, a.dk, a.dv, delta))):
                path = Path(tmp) / f"{name}.onnx"
                write(path)
                sessions[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            print(f"{rule}: {a.heads} heads of {a.dk} x {a.dv}, {a.threads} threads, median of {a.rounds} rounds")
            for T in RUNS:
                every = dict(zip(NAMES, _inputs(T, a.heads, a.dk, a.dv)))
                feeds = {n: {i.name: every[i.name] for i in s.get_inputs()} for n, s in sessions.items()}
                outs = {n: s.run(None, feeds[n]) for n, s in sessions.items()}
                for n, (o, s1) in outs.items():  # the three compute the same rule
                    assert np.abs(o - outs["ort-kernel"][0]).max() < 1e-3 * np.abs(o).max() + 1e-5, n
                times: dict[str, list[float]] = {n: [] for n in sessions}
                for _ in range(a.rounds):
                    for n, s in sessions.items():
                        start = time.perf_counter()
                        s.run(None, feeds[n])
                        times[n].append(time.perf_counter() - start)
                med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
                row = "  ".join(f"{n} {ms:8.3f} ms" for n, ms in med.items())
                print(f"  T={T:3d}: {row}  (onnx27-loop / closed {med['onnx27-loop'] / med['closed']:.1f}x)")


if __name__ == "__main__":
    main()

"""What ONNX Runtime's CPU kernels compute on this machine, asked of them once a process with graphs of
one node (milliseconds): MLAS picks its kernels by the CPU's instructions, and two of its choices
change what tk can promise.

- `integer_gemm_saturates`: MatMulIntegerToFloat over uint8 activations and int8 weights (a W8A8 LM
  head, exporters/quantize_graph.py) is exact where the CPU multiplies 8-bit integers into 32-bit
  sums (AVX-512 VNNI, AVX-VNNI, AMX; ARM's dot products). On an x86 CPU without them MLAS pairs the
  products in 16 bits (vpmaddubsw), which saturate: on a 2-vCPU AMD EPYC (Zen 3, AVX2) random
  full-range rows came out up to 763 apart from the exact sums, and a W8A8 head's logits 0.93 apart
  from the reference. Signed activations (int8 x int8) would be exact there, but take MLAS's
  portable kernel: 12x slower (at the real 0.5B head's shape, 16 rows: 227 against 21 ms).
- `one_row_apart`: MatMulNBits with 4-bit weights and int8 compute (tk's int4 exports) sums one row
  in a kernel of its own on such a CPU (2e-6 from the same row among others; on AVX-512 VNNI and AMX
  CPUs they agree, and 8-bit weights agree everywhere), so there a lone one-token step or a prompt's
  last position through the LM head would not be a verify run's bits: OrtRuntime.lone_row_apart,
  and the static layout runs no position alone (runtimes/cache_runs.py `Runs.paired`).
"""

from __future__ import annotations

import functools

import numpy as np

W8A8_SATURATES = ("this CPU has no VNNI or AMX, and there ONNX Runtime's integer GEMM (MatMulIntegerToFloat) sums "
                  "8-bit products in 16 bits, which saturate: a W8A8 LM head (--mixed-precision lm-head-w8a8) "
                  "computes wrong logits here")
VNNI_CPUS = "a CPU with AVX-512 VNNI, AVX-VNNI or AMX"  # where it runs (both refusals say so)


def _session(ort, nodes, inputs, outputs, initializers):
    """A probe's session: on ONNX Runtime's process-wide pool where this process's sessions already share it (ORT
    then refuses a pool of a session's own: an int4 export's validation asks once a runtime is open), else on
    one thread of its own. Never the one to size the shared pool: the first runtime's --threads does."""
    from onnx import helper

    from tk.runtimes.backends.ort_pool import session_options

    graph = helper.make_graph(nodes, "probe", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(ort, threads=1, sizes_pool=False),
                                providers=["CPUExecutionProvider"])


@functools.cache
def integer_gemm_saturates() -> bool:
    """Whether MatMulIntegerToFloat (uint8 around a zero point of 128, times int8) misses the exact
    sums on this CPU: every product at its largest, where 16-bit pairs saturate."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = 64, 16
    node = helper.make_node("MatMulIntegerToFloat", ["A", "W", "a_scale", "w_scale", "a_zero"], ["Y"],
                            domain="com.microsoft")
    inits = [numpy_helper.from_array(np.full((k, n), 127, np.int8), "W"),
             numpy_helper.from_array(np.ones(n, np.float32), "w_scale"),
             numpy_helper.from_array(np.array(128, np.uint8), "a_zero")]
    session = _session(ort, [node], [helper.make_tensor_value_info("A", TensorProto.UINT8, ["M", k]),
                                     helper.make_tensor_value_info("a_scale", TensorProto.FLOAT, [])],
                       [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    got = session.run(None, {"A": np.full((4, k), 255, np.uint8), "a_scale": np.array(1, np.float32)})[0]
    return not np.array_equal(got, np.full((4, n), 127 * 127 * k, np.float32))


@functools.cache
def one_row_apart() -> bool:
    """Whether MatMulNBits (4-bit, block 32, int8 compute) gives a row alone other bits than the same
    row among others on this CPU."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n, block = 256, 64, 32
    rng = np.random.default_rng(0)
    node = helper.make_node("MatMulNBits", ["A", "W", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=4)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8), "W"),
             numpy_helper.from_array((rng.random(n * k // block, dtype=np.float32) + 0.5) / 64, "S")]
    session = _session(ort, [node], [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                       [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    rows = rng.standard_normal((4, k), dtype=np.float32)
    return not np.array_equal(session.run(None, {"A": rows[:1]})[0][0], session.run(None, {"A": rows})[0][0])

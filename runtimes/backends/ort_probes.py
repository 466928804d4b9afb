"""What ONNX Runtime's CPU kernels compute on this machine, asked of them once a process with graphs of
one node (milliseconds): MLAS picks its kernels by the CPU's instructions, and two of its choices
change what tk can promise.

- `integer_gemm_saturates`: MatMulIntegerToFloat over uint8 activations and int8 weights (a W8A8 LM
  head, exporters/quantize_graph.py) is exact where the CPU multiplies 8-bit integers into 32-bit
  sums (AVX-512 VNNI, AVX-VNNI, AMX; ARM's dot products). On an x86 CPU without them MLAS pairs the
  products in 16 bits (vpmaddubsw), which saturate past 32,767 with full-range weights: on a 2-vCPU
  AMD EPYC (Zen 3, AVX2) random full-range rows came out up to 763 apart from the exact sums, and a
  W8A8 head's logits 0.93 apart from the reference. Weights of 7 bits (|q| <= 64) never saturate
  (2 x 255 x 64 = 32,640), so tk's W8A8 tables are 7-bit (models/quant/quantize.py W8A8_QMAX) and
  exact everywhere; the probe still tells an artifact of full-range 8-bit weights (tk before them)
  from one that runs here. Signed activations (int8 x int8) would be exact too, but take MLAS's
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

W8A8_SATURATES = ("this artifact's W8A8 LM head has full-range 8-bit weights (tk exported its W8A8 heads so before "
                  "their 7-bit ones), and this CPU has no VNNI or AMX: there ONNX Runtime's integer GEMM "
                  "(MatMulIntegerToFloat) sums 8-bit products in 16 bits, which saturate and give wrong logits")
VNNI_CPUS = "a CPU with AVX-512 VNNI, AVX-VNNI or AMX"  # where such an artifact runs (the refusal says so)


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
def integer_gemm_saturates(qmax: int = 127) -> bool:
    """Whether MatMulIntegerToFloat (uint8 around a zero point of 128, times int8 weights in
    [-qmax - 1, qmax], the symmetric quantizer's range) misses the exact sums on this CPU: every
    product at its largest, where 16-bit pairs saturate."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = 64, 16
    node = helper.make_node("MatMulIntegerToFloat", ["A", "W", "a_scale", "w_scale", "a_zero"], ["Y"],
                            domain="com.microsoft")
    weights = np.where(np.arange(n) % 2, qmax, -qmax - 1).astype(np.int8)[None].repeat(k, 0)  # both extremes
    inits = [numpy_helper.from_array(weights, "W"),
             numpy_helper.from_array(np.ones(n, np.float32), "w_scale"),
             numpy_helper.from_array(np.array(128, np.uint8), "a_zero")]
    session = _session(ort, [node], [helper.make_tensor_value_info("A", TensorProto.UINT8, ["M", k]),
                                     helper.make_tensor_value_info("a_scale", TensorProto.FLOAT, [])],
                       [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    got = session.run(None, {"A": np.full((4, k), 255, np.uint8), "a_scale": np.array(1, np.float32)})[0]
    return not np.array_equal(got, np.broadcast_to(127.0 * k * weights[0].astype(np.float32), (4, n)))


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

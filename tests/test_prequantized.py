"""GPTQ and AWQ checkpoints export straight from their integers: tiny checkpoints written in those
formats' documented layouts (the packers below follow AutoGPTQ's `QuantLinear.pack` and AutoAWQ's
`WQLinear_GEMM.from_linear`), whose tokens through ONNX Runtime equal their dequantized reference;
a wrong group size or a missing tensor is one clear error, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: np.ndarray, group: int, symmetric: bool):
    """A float weight [N, K] -> (q [K, N], zeros [G, N], scales [G, N]): 4-bit, groups of K rows."""
    w_t = w.T.astype(np.float32)
    k, n = w_t.shape
    groups = -(-k // group)
    q, zeros, scales = np.zeros((k, n), np.int64), np.zeros((groups, n), np.int64), np.zeros((groups, n), np.float32)
    for g in range(groups):
        block = w_t[g * group:(g + 1) * group]
        if symmetric:  # GPTQ sym: zero point 8
            s = np.maximum(np.abs(block).max(0), 1e-8) / 7.5
            z = np.full(n, 8)
        else:
            lo, hi = np.minimum(block.min(0), 0), np.maximum(block.max(0), 0)
            s = np.maximum(hi - lo, 1e-8) / 15
            z = np.clip(np.rint(-lo / s), 1, 15)  # >= 1: GPTQ's v1 stores z - 1
        q[g * group:(g + 1) * group] = np.clip(np.rint(block / s) + z, 0, 15)
        zeros[g], scales[g] = z, s.astype(np.float16).astype(np.float32)
    return q, zeros, scales


def _pack_gptq(q: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ QuantLinear.pack: qweight packs 8 rows of K per int32 (row i + j at bits 4j), qzeros
    packs 8 columns, storing z - 1 (the v1 checkpoint format)."""
    k, n = q.shape
    qweight = np.zeros((-(-k // 8), n), np.uint32)
    for j in range(8):
        rows = q[j::8].astype(np.uint32)
        qweight[:rows.shape[0]] |= rows << (4 * j)
    z = (zeros - 1).astype(np.uint32)
    qzeros = np.zeros((z.shape[0], n // 8), np.uint32)
    for j in range(8):
        qzeros |= z[:, j::8] << (4 * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def _pack_awq(q: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoAWQ WQLinear_GEMM.from_linear: 8 columns per int32, value i holding column order_map[i]."""
    def pack(values):
        out = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
        for col in range(out.shape[1]):
            for i in range(8):
                out[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
        return out.view(np.int32)
    return pack(q), pack(zeros)


def _write(src, dst, method: str, group: int, drop: str | None = None, config_group: int | None = None):
    """The float checkpoint `src` written as a `method` checkpoint in `dst`; -> the dequantized
    weights of each projection (HF name -> [N, K])."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    dequantized = {}
    for name in [n for n in sd if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        base = name.removesuffix(".weight")
        q, zeros, scales = _quantize(sd.pop(name).float().numpy(), group, symmetric=method == "gptq")
        dequantized[name] = ((q - np.repeat(zeros, group, 0)[:q.shape[0]]) * np.repeat(scales, group, 0)[:q.shape[0]]).T
        if method == "gptq":
            qweight, qzeros = _pack_gptq(q, zeros)
            sd[base + ".g_idx"] = torch.from_numpy(np.arange(q.shape[0], dtype=np.int32) // group)
        else:
            qweight, qzeros = _pack_awq(q, zeros)
        sd[base + ".qweight"], sd[base + ".qzeros"] = torch.from_numpy(qweight), torch.from_numpy(qzeros)
        sd[base + ".scales"] = torch.from_numpy(scales).half()
    if drop:
        del sd[drop]
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    group = config_group or group
    cfg["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                   "sym": True, "checkpoint_format": "gptq"} if method == "gptq" else
                                  {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                   "version": "gemm"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_prequantized_checkpoint_exports_its_integers(tiny, tmp_path, method):
    """The reader unpacks exactly the integers the packer wrote (the reference's weights are their
    dequantized values); the export stores them as uint4 with zero points, partial last group
    included (the FFN's K, 176, is 5.5 groups of 32); ORT's greedy tokens equal the reference's."""
    from tk.models.spec.manifest import Manifest
    from tk.models.checkpoint.loading import load_decoder
    from tk.runtimes.decoding.generate import generate
    from tk.runtimes.backends.ort import OrtRuntime
    from tk.toolkit.backends import reference_runtime
    from tk.toolkit.pipeline.export import export_artifact

    ckpt = tmp_path / "ckpt"
    dequantized = _write(tiny, ckpt, method, group=32)
    model = load_decoder(ckpt)
    q = model.layers[0].attn.wqkv.weight.detach().numpy()
    want = np.concatenate([dequantized[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    np.testing.assert_array_equal(q, want.astype(np.float32))
    np.testing.assert_array_equal(model.layers[1].ffn.w_down.weight.detach().numpy(),
                                  dequantized["model.layers.1.mlp.down_proj.weight"].astype(np.float32))

    art = tmp_path / "art"
    export_artifact(ckpt, art)
    m = Manifest.read(art)
    assert m.precision.method == method and m.precision.zero_points and m.precision.block_size == 32
    assert m.validation.passed, m.validation
    assert m.weights["model.layers.0.ffn.w_down.weight_t.quant"][2] == "uint4"
    ids = np.array([[5, 9, 31, 7, 200, 11]], np.int64)
    with reference_runtime(art) as ref, OrtRuntime(art, quant_compute="float") as ort:
        a = generate(ref, ids.tolist(), max_new_tokens=12, ignore_eos=True).rows[0].tokens
        b = generate(ort, ids.tolist(), max_new_tokens=12, ignore_eos=True).rows[0].tokens
        out_ref, s1 = ref.start(ids, np.ones_like(ids))
        out_ort, s2 = ort.start(ids, np.ones_like(ids))
        s1.close(), s2.close()
    assert a == b and len(a) == 12
    np.testing.assert_allclose(out_ort.logits, out_ref.logits, atol=2e-4)
    assert np.abs(out_ref.logits).max() > 1  # not flat


@pytest.mark.parametrize("case,message", [
    (dict(config_group=64), "model.layers.0.self_attn.q_proj.qzeros has shape"),
    (dict(drop="model.layers.1.mlp.up_proj.scales"), "lacks 1 tensor(s) its config needs, e.g. "
                                                       "model.layers.1.mlp.up_proj.scales"),
])
def test_prequantized_checkpoint_errors(tiny, tmp_path, case, message):
    ckpt = tmp_path / "ckpt"
    _write(tiny, ckpt, "gptq", group=32, **case)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "export", str(ckpt), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode in (1, 2), r.stderr
    assert message in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr  # one line says it
    assert not out.exists()


def test_prequantized_checkpoint_refuses_quantization_flags(tiny, tmp_path):
    ckpt = tmp_path / "ckpt"
    _write(tiny, ckpt, "awq", group=32)
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "export", str(ckpt), "-o", str(tmp_path / "o"),
                        "--weights", "int4"], capture_output=True, text=True)
    assert r.returncode == 2 and "is already quantized (AWQ, 4-bit, groups of 32)" in r.stderr

"""The float weights both ONNX Runtime sessions of an artifact read through one memory map.

Each session gets them as initializers (SessionOptions.add_initializer with OrtValues over one
read-only memory map of the weights file): one mapping, so the weights count once in RSS too,
and a session that prepacks its MatMuls copies only what it packs. Quantized weights are left to
ONNX Runtime, which packs them for MatMulNBits and frees what it read. Artifacts without the
manifest's weights table: ONNX Runtime maps the file per session.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tk.models.spec.manifest import Manifest

QUANTIZED_SUFFIXES = (".quant", ".scale")  # a quantized weight's initializers (exporters/weights.py)


def shared_initializers(ort, artifact: Path, manifest: Manifest) -> tuple[np.memmap | None, dict]:
    """(the memory map, to keep as long as the sessions; the OrtValues over it by initializer name)."""
    table = {n: e for n, e in manifest.weights.items()
             if e.dtype in ("float32", "float16") and not n.endswith(QUANTIZED_SUFFIXES)}
    if not table:
        return None, {}
    mapped = _mapped(artifact, manifest, np.uint8)
    return mapped, {name: ort.OrtValue.ortvalue_from_numpy(mapped[o:o + n].view(np.dtype(d)).reshape(shape))
                    for name, (o, n, d, shape, _) in table.items()}


def integer_extremes(artifact: Path, manifest: Manifest) -> tuple[int, int]:
    """The smallest and largest integer of the artifact's int8 tables (a W8A8 head's: the other quantized
    weights are 4-bit or unsigned), read through a memory map; (0, 0) where it has none."""
    tables = [e for n, e in manifest.weights.items() if e.dtype == "int8" and n.endswith(".quant")]
    if not tables:
        return 0, 0
    mapped = _mapped(artifact, manifest, np.int8)
    return (min(int(mapped[o:o + n].min()) for o, n, *_ in tables),
            max(int(mapped[o:o + n].max()) for o, n, *_ in tables))


def _mapped(artifact: Path, manifest: Manifest, dtype) -> np.memmap:
    """The artifact's weights file (every graph's), mapped read-only."""
    return np.memmap(artifact / next(iter(manifest.graphs.values())).data_file, dtype=dtype, mode="r")

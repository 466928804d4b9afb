"""How small a fault does the parity gate still catch? Bisect the size of three injected faults.

For each fault the reference decoder is compared (`tk.toolkit.verify.compare.compare_backends`, the
whole gate: teacher-forced cases and probes) with a copy of itself carrying the fault at size
eps, and eps is bisected on a log scale for the smallest value that fails the gate:

- norm_scale: layer 1's attention-norm weight times (1 + eps);
- ffn_scale: layer 0's FFN down projection times (1 + eps);
- rope_base: rope theta times (1 + eps) (RoPE frequencies computed from the changed base).

    python examples/fault_sensitivity.py CHECKPOINT [CHECKPOINT ...] [--json]

A checkpoint may be a folder or a preset name (tiny, small, trained-like), written to a temporary folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
from pathlib import Path

from tk.models.reference.positions import rope_inv_freq
from tk.models.checkpoint.loading import load_decoder
from tk.models.fixtures.presets import PRESETS, write_preset
from tk.runtimes.backends.torch import TorchRuntime
from tk.toolkit.verify.metrics import random_cases
from tk.toolkit.verify.tolerance import tolerance_for
from tk.toolkit.verify.compare import compare_backends


def mutate(model, kind: str, eps: float):
    if kind == "norm_scale":
        model.layers[1].attn_norm.weight.data *= 1 + eps
    elif kind == "ffn_scale":
        model.layers[0].ffn.w_down.weight.data *= 1 + eps
    elif kind == "rope_base":
        cfg = dataclasses.replace(model.config, rope_theta=model.config.rope_theta * (1 + eps))
        model.inv_freq = rope_inv_freq(cfg)
    return model


def tolerance(model):
    try:  # a gate whose bounds follow the model's size
        return tolerance_for("float32", config=model.config)
    except TypeError:  # the fixed table of tk before the scaled gate (to measure "before": run this there)
        return tolerance_for("float32")


def caught(folder: Path, reference: TorchRuntime, cases: dict, kind: str, eps: float) -> bool:
    mutant = TorchRuntime(mutate(load_decoder(folder), kind, eps))
    with mutant:
        report = compare_backends(reference, {"mutant": mutant}, cases, tolerance(reference.model), steps=3)
    return report.backends["mutant"].failed


def smallest_caught(folder: Path, kind: str, lo: float = 1e-9, hi: float = 1.0, iters: int = 14) -> float:
    """Bisect log(eps) between a size that passes and one that fails; returns the failing bound."""
    reference = TorchRuntime(load_decoder(folder))
    cases = random_cases(reference.dims.vocab_size, seed=1)
    with reference:
        if not caught(folder, reference, cases, kind, hi):
            return math.inf
        if caught(folder, reference, cases, kind, lo):
            return lo
        for _ in range(iters):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if caught(folder, reference, cases, kind, mid) else (mid, hi)
    return hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--faults", default="norm_scale,ffn_scale,rope_base")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.checkpoints:
            folder = write_preset(name, Path(tmp) / name) if name in PRESETS else Path(name)
            out[name] = {kind: smallest_caught(folder, kind) for kind in args.faults.split(",")}
            if not args.json:
                print(name, "  ".join(f"{k} {v:.3g}" for k, v in out[name].items()), flush=True)
    if args.json:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

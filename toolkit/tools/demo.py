"""`tk demo`: the whole path on a built-in preset, in a temporary folder, in about half a minute.

Writes the preset as a Hugging Face checkpoint (the default, `trained`, is really trained: about
10 seconds of AdamW on the presets' corpus, so what it generates reads as text; the others are
seeded random weights), exports and validates it, generates the same prompt greedily through
PyTorch and ONNX Runtime, and reports whether the tokens match, the largest logit difference over
a teacher-forced run, and each backend's decode speed. Nothing is kept outside the temporary folder.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

from tk.models.fixtures.presets import write_preset
from tk.runtimes.decoding.generate import left_pad
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.toolkit.backends import open_runtime, reference_runtime
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.verify.tolerance import tolerance_for
from tk.toolkit.verify.compare import compare_backends
from tk.toolkit.textgen import Tokenizer, generate_text


def run_demo(preset: str, prompt: str, max_new_tokens: int, echo: Callable[[str], None] = print) -> dict:
    with tempfile.TemporaryDirectory(prefix="tk-demo-") as tmp:
        start = time.perf_counter()
        trained = " (trained on the presets' corpus)" if preset == "trained" else " (seeded random weights)"
        echo(f"1. write preset {preset!r}{trained} as a Hugging Face checkpoint:")
        ckpt = write_preset(preset, Path(tmp) / "checkpoint")
        echo(f"   {ckpt}: {time.perf_counter() - start:.1f} s")
        art = Path(tmp) / "artifact"
        echo("2. tk export (prefill + decode graphs, contract check, ORT-vs-torch validation):")
        manifest = export_artifact(ckpt, art, progress=lambda m: echo(f"   {m}"))
        tok = Tokenizer(art)
        ids = tok.encode(prompt)
        echo(f"3. generate {max_new_tokens} tokens greedily from {prompt!r} ({len(ids)} prompt tokens):")
        results = {}
        for backend in ("torch", "ort"):
            result, texts = generate_text(open_runtime(art, backend), tok, [ids], max_new_tokens, SamplingConfig(),
                                          manifest.eos_token_ids, ignore_eos=True)
            results[backend] = result
            echo(f"   {backend:5} {texts[0]!r}")
        same = results["torch"].rows[0].tokens == results["ort"].rows[0].tokens
        # Largest logit difference: feed torch's tokens to ORT (teacher forcing), compare every step.
        pids, mask = left_pad([ids])
        tol = tolerance_for("float32", manifest.config)
        with reference_runtime(art) as ref, open_runtime(art, "ort") as ort:
            report = compare_backends(ref, {"ort": ort}, {"demo": (pids, mask)}, tol, max_new_tokens - 1,
                                      probes=False, free_running=False)
        steps = report.backends["ort"].cases[0].comparison.steps
        worst = max(s.metrics.max_abs for s in steps)
        echo(f"4. tokens identical on torch and ORT: {'yes' if same else 'NO'}; "
             f"largest logit difference over {len(steps)} steps: {worst:.3g} "
             f"({max(s.error_ratio for s in steps):.2g} of its bound)")
        for backend, r in results.items():
            t = r.timings()
            echo(f"   {backend:5} decode {t['decode_ms_per_token']:.2f} ms/token, "
                 f"time to first token {t['ttft_ms']:.1f} ms")
        ratio = results["torch"].decode_ms_per_token / results["ort"].decode_ms_per_token
        echo(f"   ORT decodes {ratio:.2f}x the speed of torch on this small model; total {time.perf_counter() - start:.0f} s")
        return {"identical": same, "max_abs": worst, "timings": {b: r.timings() for b, r in results.items()}}

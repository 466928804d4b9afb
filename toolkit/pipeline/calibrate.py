"""`tk export --calibration FILE`: the input channels' mean squared activation of every quantized
weight, measured by the full-precision reference decoder on the user's text (llama.cpp's importance
matrix, `llama-imatrix`), and the activation-aware channel scales searched with it (AWQ): the scale
search (models/quant/quantize.py) weighs each channel's rounding error by it, so the channels the model
actually drives get the finer grid, and the scales give those channels more of their blocks
(models/quant/calibration.py).

Bounded: at most MAX_TOKENS tokens of the file, in windows of WINDOW (a forward pass each, no
cache, no gradient); only [K] sums are kept per weight. The artifact keeps the result
(`calibration.npz`) so that its quantized reference is rebuilt exactly, and the manifest records
the file's name, SHA-256 and token count, and how many weights were scaled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tk.models.quant.calibration import Calibration, channel_scales
from tk.models.spec.errors import UsageProblem
from tk.models.spec.manifest import CalibrationRecord, sha256_file

MAX_TOKENS = 16384
WINDOW = 512


def calibrate(model_dir: Path, config, precision, text_file: Path) -> tuple[Calibration, CalibrationRecord]:
    """-> (the statistics and channel scales, the manifest's record)."""
    import torch

    from tk.models.checkpoint.loading import load_decoder
    from tk.models.quant.plan import quant_plan
    from tk.toolkit.textgen import Tokenizer

    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageProblem(f"--calibration {text_file}: cannot read it as UTF-8 text ({e.__class__.__name__}); "
                           "give a text file") from None
    ids = Tokenizer(model_dir).encode(text)[:MAX_TOKENS]
    if len(ids) < 2:
        raise UsageProblem(f"--calibration {text_file} is {len(ids)} token(s); give at least a paragraph of text")
    window = min(WINDOW, config.max_position_embeddings)
    model = load_decoder(model_dir, "float32")
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name in quant_plan(config, precision):
        if name == "embed.weight":
            continue  # a table lookup: no input channels

        def hook(module, args, name=name):
            x = args[0].detach().float()
            sums[name] = sums.get(name, 0) + (x * x).reshape(-1, x.shape[-1]).sum(0)

        hooks.append(model.get_submodule(name.removesuffix(".weight")).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for start in range(0, len(ids), window):
                chunk = torch.tensor([ids[start:start + window]])
                model(chunk, torch.ones_like(chunk), torch.arange(chunk.shape[1])[None])
    finally:
        for h in hooks:
            h.remove()
    importance = {name: (s / len(ids)).numpy().astype(np.float32) for name, s in sums.items()}
    scales = channel_scales(model, quant_plan(config, precision), importance)
    return Calibration(importance, scales), CalibrationRecord(Path(text_file).name, sha256_file(Path(text_file)),
                                                              len(ids), len(scales))

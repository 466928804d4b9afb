"""PyTorch backend over the reference decoder, given by the caller (runtimes never import models).

device "auto" takes CUDA when torch sees a GPU, else the CPU; "cuda" insists on a GPU. The cache is the decoder's own list of (key, value)
tensors and stays on the device between steps.
"""

from __future__ import annotations

import numpy as np

from models import contract
from runtimes.base import BackendUnavailable, Runtime


class TorchRuntime(Runtime):
    name = "torch"

    def __init__(self, model, device: str = "auto", debug: bool = False):
        c = model.config
        kv_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        super().__init__(contract.GraphDims(c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size, kv_dtype),
                         c.max_position_embeddings)
        self.model, self.device, self.debug = model, device, debug  # debug: keep per-layer hidden states

    def _load(self) -> None:
        import torch

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendUnavailable("the torch backend was asked for CUDA but torch sees no CUDA device; "
                                     "use --device cpu or install a CUDA build of torch on a GPU machine")
        self._torch = torch
        self.model = self.model.to(self.device).eval()

    def _run(self, input_ids, attention_mask, position_ids, cache):
        t = self._torch
        args = [t.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in (input_ids, attention_mask, position_ids)]
        with t.inference_mode():
            out = self.model(*args, cache, output_hidden=self.debug)
        self.hidden = [h.cpu().numpy() for h in out[2]] if self.debug else None
        return out[0].float().cpu().numpy(), out[1]

    def _prefill(self, input_ids, attention_mask, position_ids):
        return self._run(input_ids, attention_mask, position_ids, None)

    def _decode(self, input_ids, attention_mask, position_ids, cache):
        return self._run(input_ids, attention_mask, position_ids, cache)

    def cache_feed(self, cache):
        key = cache[0][0]
        return tuple(key.shape), str(key.dtype).removeprefix("torch.")

    def cache_arrays(self, cache):
        return [t.float().cpu().numpy() for kv in cache for t in kv]

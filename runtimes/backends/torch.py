"""PyTorch backend over the reference decoder, given by the caller (runtimes never import models).

Construction is cheap: pass the decoder, or a loader that returns it (Polygraphy's
runner-takes-a-callable idiom) with the dims it will have; the loader runs on activation.
device "auto" takes CUDA when torch sees a GPU, else the CPU; "cuda" insists on a GPU. The cache
is the decoder's own tensors and stays on the device between steps (`TorchBuffers`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from tk.models.spec import contract
from tk.models.spec.manifest import Precision
from tk.models.spec.variant import Variant
from tk.runtimes.base import BackendUnavailable, CacheBuffers, Runtime, StepOutput
from tk.runtimes.buffers import rows_of


def resolve_device(device: str) -> str:
    """The device a torch runtime asked for `device` runs on: "auto" is CUDA where torch sees a GPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchBuffers(CacheBuffers):
    """A cache as torch tensors on the runtime's device (the numpy defaults would copy every step);
    `torch` and `device` are set while the runtime is loaded."""

    def __init__(self):
        self.torch = self.device = None

    def alloc(self, shape, dtype):
        return self.torch.zeros(shape, dtype=getattr(self.torch, dtype), device=self.device)

    def copy_positions(self, dst, src, count, dst_row=None, src_row=None, src_at=0, dst_at=0):
        dst[rows_of(dst_row), :, dst_at:dst_at + count].copy_(src[rows_of(src_row), :, src_at:src_at + count])

    def read_positions(self, buf, row, start, end):
        return buf[row:row + 1, :, start:end].clone()  # stays on the device

    def read_row(self, buf, row):
        return buf[row].clone()  # stays on the device

    def write_row(self, buf, row, value=None):
        buf[row].zero_() if value is None else buf[row].copy_(value)

    def to_numpy(self, buf) -> np.ndarray:
        return buf.float().cpu().numpy()

    def take(self, buffers, rows):
        index = self.torch.as_tensor(rows, device=self.device)
        return [b.index_select(0, index) for b in buffers]


class TorchRuntime(Runtime):
    name = "torch"
    all_prefill_logits = True  # the model computes every position's logits, whatever the artifact's graphs return
    computes_every_position = True

    def __init__(self, model=None, device: str = "auto", debug: bool = False, *,
                 loader: Callable[[], object] | None = None, dims: contract.GraphDims | None = None,
                 max_context: int | None = None):
        """A Decoder `model`, or a `loader` returning one with the `dims` and `max_context` it will have."""
        self.model, self._loader = model, loader
        if model is not None:
            kv_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            dims = contract.GraphDims.of(model.config, Precision(kv=kv_dtype), Variant())  # the plain graphs'
            max_context = model.config.max_position_embeddings
        super().__init__(dims, max_context, TorchBuffers())  # its torch and device: set by _load
        self.device, self.debug = device, debug  # "auto" | "cpu" | "cuda..."; debug: per-layer hidden states

    def _load(self) -> None:
        import torch

        device = resolve_device(self.device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendUnavailable("the torch backend was asked for CUDA but torch sees no CUDA device; "
                                     "use --device cpu or install a CUDA build of torch on a GPU machine")
        self.buffers.torch, self.buffers.device = torch, device
        if self.model is None:
            self.model = self._loader()
        self.model.to(device).eval()  # in place: a module's .to() returns itself

    def _unload(self) -> None:
        if self._loader is not None:
            self.model = None  # loads again on the next activation
            _return_freed_memory()
        self.buffers.torch = self.buffers.device = None

    def run(self, graph, feeds, past, session, in_place=False):
        t, device = self.buffers.torch, self.buffers.device
        ids, mask, pos = (t.from_numpy(np.ascontiguousarray(feeds[k])).to(device)
                          for k in ("input_ids", "attention_mask", "position_ids"))
        write = feeds.get("write_indices")  # a static-capacity cache (dims.kv_capacity)
        write = None if write is None else t.from_numpy(np.ascontiguousarray(write)).to(device)
        pairs = None if past is None else self.dims.group(past)  # per layer: (key, value), or its recurrent state
        with t.inference_mode():
            out = self.model(ids, mask, pos, pairs, write, output_hidden=self.debug)
            present = [x for kv in out[1] for x in kv]
            if in_place:  # kv_write returned new buffers: the layout keeps its own
                for buf, new in zip(past, present):
                    buf.copy_(new)
                present = past
        hidden = [h.cpu().numpy() for h in out[2]] if self.debug else None
        logits = out[0].float().cpu().numpy()
        keep = feeds.get("logits_to_keep")  # the model computes every position; the graph returns these
        return StepOutput(logits if keep is None else logits[:, keep], hidden), present


def _return_freed_memory() -> None:
    """Hand the freed weights back to the OS. glibc keeps freed heap memory for reuse (and raises its
    mmap threshold after large frees, so tensors land on the heap): without this, a reference
    unloaded before ONNX Runtime loads (export validation) would still count in the process's RSS."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass

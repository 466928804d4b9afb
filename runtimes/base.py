"""The runtime interface every backend implements, and the input check they share.

A runtime is cheap to construct, loads on `activate()` (or `__enter__`), and offers `prefill`
and `decode` over numpy int64 inputs, returning float32 numpy logits and an opaque cache that
stays wherever the backend keeps it (torch tensors, OrtValues, device buffers). The generation
loop and the parity harness see only this interface. Imports nothing heavy.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from models import contract


class RuntimeErrorBase(RuntimeError):
    """Base of the errors runtimes raise for the CLI to report."""


class BackendUnavailable(RuntimeErrorBase):
    """An optional library or device this backend needs is missing; the message says how to get it."""


class InputError(RuntimeErrorBase, ValueError):
    """Inputs do not fit the contract or the backend's limits."""


class ArtifactError(RuntimeErrorBase, ValueError):
    """The artifact folder is missing files or does not match this tk or this machine."""


def read_manifest(artifact: Path) -> dict:
    artifact = Path(artifact)
    path = artifact / contract.MANIFEST
    if not artifact.is_dir():
        raise ArtifactError(f"artifact folder {artifact} does not exist; create it with tk export")
    if not path.is_file():
        raise ArtifactError(f"{artifact} has no {contract.MANIFEST}; it is not a tk artifact (tk export makes one)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); re-export the artifact") from None
    try:
        contract.check_manifest_version(manifest)
    except contract.ContractError as e:
        raise ArtifactError(str(e)) from None
    return manifest


def dims_from_manifest(manifest: dict) -> contract.GraphDims:
    return contract.GraphDims(**manifest["dims"])


def check_inputs(graph: str, dims: contract.GraphDims, feeds: dict[str, tuple[tuple, str]]) -> None:
    """Check named (shape, dtype) pairs against the contract before a run (Polygraphy's check_inputs).

    Symbolic dims must agree wherever they recur: batch everywhere, the decode mask one longer
    than the past. Messages name the tensor and both shapes. The first past tensor stands for
    the cache (`GraphDims.checked_inputs`): this runs before every decode step.
    """
    bound: dict[str, int] = {}
    for spec in dims.checked_inputs(graph):
        if spec.name not in feeds:
            raise InputError(f"{graph}: input {spec.name} is missing")
        shape, dtype = feeds[spec.name]
        if dtype != spec.dtype:
            raise InputError(f"{graph}: {spec.name} has dtype {dtype}, expected {spec.dtype}")
        if len(shape) != len(spec.dims):
            raise InputError(f"{graph}: {spec.name} has shape {list(shape)}, expected {list(spec.dims)}")
        for got, want in zip(shape, spec.dims):
            if isinstance(want, int):
                ok = got == want
            else:
                ok = bound.setdefault(want, got) == got
            if not ok or got <= 0:
                raise InputError(f"{graph}: {spec.name} has shape {list(shape)}, expected {list(spec.dims)} "
                                 f"with {', '.join(f'{k}={v}' for k, v in bound.items())}")
    if graph == contract.DECODE and contract.PAST in bound and bound[contract.TOTAL] != bound[contract.PAST] + 1:
        raise InputError(f"decode: attention_mask covers {bound[contract.TOTAL]} tokens, expected past "
                         f"{bound[contract.PAST]} + 1")


def check_token_ids(input_ids: np.ndarray, vocab_size: int) -> None:
    # A decode step's few ids are checked as Python ints: two numpy reductions cost ~8 us each step.
    ids = input_ids.ravel().tolist() if input_ids.size <= 64 else (input_ids.min(), input_ids.max())
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = int(input_ids[(input_ids < 0) | (input_ids >= vocab_size)][0])
        raise InputError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


_DTYPE_NAMES = {np.dtype(n): n for n in ("int64", "int32", "float32", "float16")}


def dtype_name(dtype: np.dtype) -> str:
    """numpy's str(dtype) costs ~7 us; this runs several times every decode step."""
    return _DTYPE_NAMES.get(dtype) or str(dtype)


class Runtime(ABC):
    """One backend. Subclasses implement `_load`, `_unload`, `_prefill`, `_decode`, `cache_arrays`."""

    name = "base"

    def __init__(self, dims: contract.GraphDims, max_context: int):
        self.dims = dims
        self.past_names = contract.past_names(dims.num_layers)  # named once, bound every decode step
        self.present_names = contract.present_names(dims.num_layers)
        self.max_context = max_context
        self.active = False
        self.hidden: list[np.ndarray] | None = None  # the last call's per-layer hidden states, where available

    def activate(self) -> "Runtime":
        if not self.active:
            self._load()
            self.active = True
        return self

    def deactivate(self) -> None:
        if self.active:
            self._unload()
            self.active = False

    def __enter__(self) -> "Runtime":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def _feeds(self, input_ids, attention_mask, position_ids) -> dict:
        return {"input_ids": (input_ids.shape, dtype_name(input_ids.dtype)),
                "attention_mask": (attention_mask.shape, dtype_name(attention_mask.dtype)),
                "position_ids": (position_ids.shape, dtype_name(position_ids.dtype))}

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray):
        """-> (logits float32 (B, S, V), cache)."""
        if not self.active:
            self.activate()
        check_inputs(contract.PREFILL, self.dims, self._feeds(input_ids, attention_mask, position_ids))
        check_token_ids(input_ids, self.dims.vocab_size)
        return self._prefill(input_ids, attention_mask, position_ids)

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, cache):
        """-> (logits float32 (B, 1, V), cache)."""
        feeds = self._feeds(input_ids, attention_mask, position_ids)
        feeds[self.past_names[0]] = self.cache_feed(cache)
        check_inputs(contract.DECODE, self.dims, feeds)
        check_token_ids(input_ids, self.dims.vocab_size)
        return self._decode(input_ids, attention_mask, position_ids, cache)

    @abstractmethod
    def _load(self) -> None: ...

    def _unload(self) -> None:
        pass

    @abstractmethod
    def _prefill(self, input_ids, attention_mask, position_ids): ...

    @abstractmethod
    def _decode(self, input_ids, attention_mask, position_ids, cache): ...

    @abstractmethod
    def cache_feed(self, cache) -> tuple[tuple, str]:
        """(shape, dtype) of the past tensors the cache would feed, all alike (no copy)."""

    @abstractmethod
    def cache_arrays(self, cache) -> list[np.ndarray]:
        """The cache as float32 numpy arrays in contract order (copies; for parity, not the loop)."""

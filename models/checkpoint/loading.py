"""Load a local Hugging Face checkpoint folder into the reference `Decoder`.

Reads config.json (and generation_config.json for EOS ids) and safetensors weights, single-file or
sharded through model.safetensors.index.json. Never unpickles. Every shape is checked against
the config before anything is materialized, so a mismatched or corrupt checkpoint fails with a
sentence naming the tensor, not deep inside torch.

`weight_map` (models/checkpoint/names.py) is the one table of how Hugging Face tensor names map to
ours; the presets write checkpoints from the same table.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from tk.models.spec.config import DecoderConfig, UnsupportedModelError
from tk.models.checkpoint import mxfp4
from tk.models.checkpoint.families import FAMILIES, config_from_hf
from tk.models.checkpoint.names import Part, hf_shapes, weight_map
from tk.models.checkpoint.prequantized import METHODS as PREQUANTIZED
from tk.models.checkpoint.prequantized import quantized_shapes, read_prequantized, unpack
from tk.models.spec.dtypes import canonical_dtype
from tk.models.spec.errors import CheckpointError, read_json  # CheckpointError: callers import it from here too
from tk.models.reference.decoder import Decoder
from tk.models.reference.positions import rope_inv_freq
from tk.models.quant.plan import quant_plan, quantized_layers
from tk.models.quant.quantize import QTensor, dequantize, quantize, quantize_rows

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I32": torch.int32, "U8": torch.uint8}  # U8: MXFP4's blocks and scales


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, canonical_dtype(name))


def read_config(folder: Path) -> DecoderConfig:
    folder = Path(folder)
    hf = read_json(folder, "config.json", CheckpointError, no_folder="checkpoint folder {folder} does not exist",
                   no_file="{folder} has no config.json; point at a Hugging Face checkpoint folder")
    try:
        cfg = config_from_hf(hf)
    except UnsupportedModelError:
        raise
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(eos if isinstance(eos, list) else [eos]))
    return cfg


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        return {name: folder / fname for name, fname in wm.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        hint = f" (found {', '.join(others)}: tk loads safetensors only, never pickles)" if others else ""
        raise CheckpointError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    return {name: single for name in _open(single).keys()}


def _open(path: Path):
    if not path.is_file():
        raise CheckpointError(f"weights file {path} is missing")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); re-download or re-save it") from None


class ReusableBuffer:
    """Bytes reused from tensor to tensor, grown as needed: fresh memory costs a page fault per
    4 KiB, most of a streaming reader's or writer's kernel time at real sizes."""

    def __init__(self):
        self._bytes = torch.empty(0, dtype=torch.uint8)

    def view(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        if self._bytes.numel() < n:
            self._bytes = torch.empty(n, dtype=torch.uint8)
        return self._bytes[:n].view(dtype).view(shape)


class CheckpointReader:
    """A checkpoint's tensors under our names, one at a time: every shape is checked against the
    config when the reader opens, before any weight is read; `tensor(ours)` reads and concatenates
    the Hugging Face tensors that make one of ours (nothing else stays in memory)."""

    def __init__(self, folder: Path, cfg: DecoderConfig):
        self.folder, self.cfg = Path(folder), cfg
        files = _weight_files(self.folder)
        expected = hf_shapes(cfg)
        self._float_shapes = dict(expected)  # a packed projection's shape as a float weight
        # a GPTQ/AWQ checkpoint: each projection's weight is its packed integers, zero points and scales
        self.prequantized = read_prequantized(self.folder)
        self.packed: set[str] = set()  # our names read from integers
        if self.prequantized is not None:
            for ours in quantized_layers(cfg, lm_head=False):
                for name, *_ in weight_map(cfg)[ours]:
                    n, k = expected.pop(name)
                    base = name.removesuffix(".weight")
                    for part, shape in quantized_shapes(self.prequantized, k, n).items():
                        if part != "g_idx" or f"{base}.g_idx" in files:  # older GPTQ files always have g_idx
                            expected[f"{base}.{part}"] = shape
                self.packed.add(ours)
        self.mxfp4 = self._mxfp4_tensors(expected, files)
        missing = [n for n in expected if n not in files]
        others = FAMILIES[cfg.architecture].ignore  # a multimodal checkpoint's other towers
        unexpected = [n for n in files if n not in expected and not n.endswith(IGNORED_SUFFIXES)
                      and not (cfg.tie_embeddings and n == "lm_head.weight") and not n.startswith(others)]
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s) its config needs, e.g. {missing[0]}")
        if unexpected:
            raise CheckpointError(
                f"checkpoint has {len(unexpected)} tensor(s) its config does not describe, e.g. {unexpected[0]}"
            )
        self.files = files
        self.handles = {p: _open(p) for p in set(files[n] for n in expected)}
        for name, shape in expected.items():
            try:
                got = tuple(self.handles[files[name]].get_slice(name).get_shape())
            except SafetensorError as e:
                raise CheckpointError(f"cannot read {name} from {files[name]} ({e})") from None
            if got != shape:
                pq = self.prequantized
                why = f" with {pq.method.upper()} groups of {pq.group}" if pq and name.endswith((".scales", ".qzeros")) else ""
                raise CheckpointError(f"tensor {name} has shape {list(got)} but config.json implies {list(shape)}{why}")
        self._headers: dict[Path, tuple[dict, int]] = {}
        self._convert = ReusableBuffer()  # reads that change dtype land here first
        self.map = weight_map(cfg)
        if cfg.tie_embeddings:
            self.map = {**self.map, "lm_head.weight": self.map["embed.weight"]}

    def _mxfp4_tensors(self, expected: dict, files: dict) -> set[str]:
        """The dense tensors an MXFP4 checkpoint (gpt-oss's) holds as blocks and scales instead: `expected`
        then names those (models/checkpoint/mxfp4.py)."""
        path = self.folder / "config.json"
        if not path.is_file() or not mxfp4.is_mxfp4(json.loads(path.read_text()).get("quantization_config")):
            return set()
        names = {n for n in expected if n not in files and f"{n}_blocks" in files}
        for name in names:
            packed = mxfp4.packed_shapes(expected.pop(name))
            if not packed:
                raise CheckpointError(f"{name} is stored in MXFP4 blocks of {mxfp4.BLOCK}, and its input size is not a "
                                      "multiple of that")
            expected.update({name + suffix: shape for suffix, shape in packed.items()})
        return names

    def _info(self, name: str) -> tuple[Path, dict, int]:
        path = self.files[name]
        if path not in self._headers:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[path] = (json.loads(f.read(n)), 8 + n)
        header, base = self._headers[path]
        return path, header[name], base

    def _read_into(self, name: str, out: torch.Tensor, part: Part | None = None) -> None:
        """Read `name` (or the rows of it `part` names) into `out` (its shape, any dtype) with pread, not
        through safetensors' memory map: mapped pages would stay resident (and count in RSS) for as long
        as the reader lives, a second copy of the checkpoint. In the checkpoint's dtype the bytes land in
        `out` directly."""
        path, info, base = self._info(name)
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"cannot read {name} from {path}: dtype {info['dtype']} is not one tk reads")
        begin, end = info["data_offsets"]
        src = _ST_DTYPES[info["dtype"]]
        if part is not None:  # its rows: of its expert's slice where the tensor stacks them
            shape = info["shape"][1:] if part.experts else info["shape"]
            row = math.prod(shape[1:]) * src.itemsize
            begin += ((part.expert or 0) * shape[0] + part.start) * row
            end = begin + part.rows * row
        buf = out if out.dtype == src else self._convert.view(out.shape, src)
        got = 0
        if end > begin:
            with open(path, "rb") as f:
                got = os.preadv(f.fileno(), [buf.view(torch.uint8).numpy()], base + begin)
        if got != end - begin or buf.numel() * buf.element_size() != end - begin:
            raise CheckpointError(f"cannot read {name} from {path} (read {got} of {end - begin} bytes); "
                                  "the file may be truncated")
        if buf is not out:
            out.copy_(buf)

    def shape(self, ours: str) -> tuple[int, ...]:
        parts = self.map[ours]
        first = self._float_shapes[parts[0].name]  # as a float tensor (a packed or an MXFP4 one's too)
        if not first:
            return ()
        one = first[1:] if parts[0].experts else first  # one expert's
        return (sum(p.rows for p in parts), *(one[:-1] if parts[0].transposed else one[1:]))

    def _read_part(self, part: Part, out: torch.Tensor) -> None:
        """One part of ours into `out`: its rows read straight in, or, where they are strided or the tensor is
        stored transposed or in MXFP4, its (expert's) whole matrix first, its rows taken from that."""
        if part.step == 1 and not part.transposed and part.name not in self.mxfp4:
            self._read_into(part.name, out, part)
            return
        if part.name in self.mxfp4:  # blocks and scales [out, in]: the dense tensor transposed, dequantized
            blocks, scales = (self._slice(part.name + suffix, part, torch.uint8) for suffix in ("_blocks", "_scales"))
            try:
                matrix = mxfp4.dequantize(blocks, scales)
            except ValueError as e:
                raise CheckpointError(f"{part.name} (expert {part.expert}): {e}") from None
            matrix = matrix if part.transposed else matrix.T
        else:
            whole = self._slice(part.name, part, out.dtype)
            matrix = whole.T if part.transposed else whole
        out.copy_(matrix[part.start:part.start + part.rows * part.step:part.step])

    def _slice(self, name: str, part: Part, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` whole, or its slice `part.expert` where it stacks experts, in `dtype`."""
        shape = self._info(name)[1]["shape"]
        one = shape[1:] if part.experts else shape
        t = torch.empty(one, dtype=dtype)
        self._read_into(name, t, Part(name, one[0], 0, part.expert, part.experts))
        return t

    def quantized(self, ours: str):
        """A GPTQ/AWQ projection's integers as tk stores them (models/quant/quantize.py QTensor, [K, N]),
        its parts concatenated along N."""
        parts = []
        for name, rows, *_ in self.map[ours]:
            base = name.removesuffix(".weight")
            tensors = {}
            for part in ("qweight", "qzeros", "scales", "g_idx"):
                if f"{base}.{part}" in self.files:
                    info = self._info(f"{base}.{part}")[1]
                    t = torch.empty(info["shape"], dtype=_ST_DTYPES.get(info["dtype"], torch.uint8))
                    self._read_into(f"{base}.{part}", t)  # refuses a dtype tk does not read
                    tensors[part] = t.float().numpy() if part == "scales" else t.numpy()
            parts.append(unpack(self.prequantized, base, tensors, self.shape(ours)[1], rows))
        return QTensor(np.concatenate([p.q for p in parts], 1), np.concatenate([p.scales for p in parts], 1),
                       np.concatenate([p.zeros for p in parts], 1))

    def tensor(self, ours: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Our parameter `ours` (e.g. layers.0.attn.wqkv.weight) in `dtype`, its parts (concatenated
        along dim 0 where we fuse) read straight into their rows; into `out` when given (a buffer
        the caller reuses). A GPTQ/AWQ projection is its integers, dequantized."""
        if ours in self.packed:
            qt = self.quantized(ours)
            w = torch.empty(qt.q.shape[::-1], dtype=torch.float32)
            dequantize(qt, self.prequantized.group, out=w.numpy().T)
            return w.to(dtype) if out is None else out.copy_(w)
        shape = self.shape(ours)
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(f"{ours} is {dtype} {shape}, not {out.dtype} {tuple(out.shape)}")
        if not shape:  # a scalar: one part
            self._read_into(self.map[ours][0][0], out)
            return out
        row = 0
        for part in self.map[ours]:
            self._read_part(part, out[row:row + part.rows])
            row += part.rows
        return out


def load_state_dict(folder: Path, cfg: DecoderConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our state dict, shapes checked first, fused where the model fuses."""
    reader = CheckpointReader(folder, cfg)
    sd = {ours: reader.tensor(ours, dtype) for ours in weight_map(cfg)}
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]
    return sd


def load_decoder(folder: str | Path, dtype: str | torch.dtype = "float32") -> Decoder:
    """Build the reference decoder from a Hugging Face checkpoint folder, in eval mode."""
    folder = Path(folder)
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    cfg = read_config(folder)
    sd = load_state_dict(folder, cfg, dtype)
    with torch.device("meta"):  # no random init of weights we are about to replace
        model = Decoder(cfg)
    model.load_state_dict(sd, assign=True, strict=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(cfg)
    if cfg.rope_local_theta is not None:
        model.inv_freq_local = rope_inv_freq(cfg, "local")
    return model.eval()


def quantize_weights_(model: Decoder, precision, calibration=None) -> Decoder:
    """The quantized reference: each weight a quantized export stores quantized replaced, in place,
    by its dequantized value (models/quant/quantize.py, after the same `calibration`'s channel scales and
    weighted by its importance, models/quant/calibration.py; scales rounded to the activations' dtype as
    the artifact stores them), so that eager PyTorch computes what the graphs compute. A quantized
    embedding is its own table's, or when tied the LM head's, dequantized. A W8A8 weight's input is
    rounded to int8 a row at a time too (`quantize_rows`)."""
    if precision.method in PREQUANTIZED:
        return model  # loaded from its integers, dequantized (CheckpointReader.tensor)
    scale_dtype = torch_dtype(precision.activations)
    if calibration is not None:
        calibration.scale_(model)
    for name, scheme in quant_plan(model.config, precision).items():
        module = model.get_submodule(name.removesuffix(".weight"))
        weight = module.weight.detach()
        qt = quantize(weight.float().T.numpy(), scheme, calibration and calibration.importance_of(name))
        qt.scales = torch.from_numpy(qt.scales).to(scale_dtype).float().numpy()
        # written over the float weight where it is its own float32 table (a tied head that keeps a
        # float embedding gets a table of its own): no whole-tensor copies beside the model
        shared = model.config.tie_embeddings and not precision.quantized_embedding and name == "lm_head.weight"
        w = weight if weight.dtype == torch.float32 and weight.is_contiguous() and not shared else \
            torch.empty(weight.shape, dtype=torch.float32)
        dequantize(qt, scheme.block, out=w.numpy().T)
        module.weight = torch.nn.Parameter(w.to(weight.dtype), requires_grad=False)
        if scheme.int8_inputs:  # W8A8: its input rounded to int8 a row at a time, as the graph does
            module.register_forward_pre_hook(lambda _, args: (quantize_rows(args[0]),))
            module.int8_inputs = True  # (parity records what it took in: toolkit/verify/head_rounding.py)
    if precision.quantized_embedding and model.config.tie_embeddings:
        model.embed.weight = model.lm_head.weight  # the one table, tied again
    return model

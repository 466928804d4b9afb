"""A real-numerics fixture for judging quantizers: a small Llama really trained on real text.

    python examples/quality_fixture.py OUT [--steps 600] [--hidden 256] [--layers 6]

Random weights say nothing about quantization, and a checkpoint dequantized from a GGUF sits on
that format's 4-bit grid; no machine here reaches a model hub. So this trains one, from scratch, on
text every machine with Python has: the standard library's own source (English comments,
docstrings and code). Files are split by name hash into training text and held-out text
(OUT/heldout.txt, never seen in training), a byte-level BPE of 8,192 tokens is trained on the
training text, and the model (SmolLM-style: tied embeddings, GQA, RoPE theta 1e5; the FFN's
intermediate size 688 is a multiple of no block above 16, so quantizers meet partial blocks) is
trained with AdamW and a cosine schedule on windows of 256 tokens. OUT is a Hugging Face checkpoint
folder (config.json, model.safetensors, tokenizer.json) tk, transformers, onnxruntime-genai's
builder and llama.cpp's converter all read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path


def corpus(root: Path) -> tuple[str, str]:
    """(training text, held-out text) from the .py files under `root`; one file in 16 held out."""
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts or "idlelib" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if hashlib.blake2b(str(path.relative_to(root)).encode()).digest()[0] % 16 == 0 else train).append(text)
    return "\n".join(train), "\n".join(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tk.models.reference.decoder import Decoder
    from tk.models.checkpoint.families import config_from_hf
    from tk.models.checkpoint.loading import SINGLE_FILE
    from tk.models.fixtures.presets import EOS, PAD, _hf_names, next_token_step

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    train_text, held_text = corpus(Path(sysconfig.get_paths()["stdlib"]))
    (out / "heldout.txt").write_text(held_text[:400_000], encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(train_text.splitlines(), trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=[EOS, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD, "model_max_length": 2048}))
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
          "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": 0,
          "pad_token_id": 1, "vocab_size": args.vocab, "hidden_size": args.hidden,
          "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
          "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 128),
          "head_dim": 64, "max_position_embeddings": 2048, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))

    cfg = config_from_hf(hf)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    model = Decoder(cfg)
    with torch.no_grad():  # GPT-2's init: std 0.02, residual projections scaled down with depth
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * args.layers) if name.endswith(("wo.weight", "w_down.weight")) else 0.02
                p.normal_(0.0, std, generator=g)
    model.lm_head.weight = model.embed.weight
    ids = torch.tensor(tok.encode(train_text).ids)
    print(f"{len(ids):,} training tokens, {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.95))
    warmup, start = 30, time.time()
    for step in range(args.steps):
        lr = 2e-3 * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = max(lr, 1e-4)
        loss = next_token_step(model, opt, ids, 256, 16, g, clip=1.0)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss:.3f} ({time.time() - start:.0f} s)", flush=True)
    sd = {k: v.detach() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd["lm_head.weight"] = sd["embed.weight"]
    weights = _hf_names(cfg, sd)
    weights.pop("lm_head.weight", None)
    save_file(weights, str(out / SINGLE_FILE), metadata={"format": "pt"})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Built-in tiny models with seeded weights, written as real Hugging Face checkpoints.

A preset is a Hugging Face config.json plus seeded random weights under Hugging Face names
(from `loading.weight_map`) plus a byte-level BPE tokenizer trained offline, so it loads through
exactly the same path as a downloaded checkpoint. Matrices are drawn far wider than Hugging
Face's default init (std 1.6/sqrt(fan_in): 0.2 for the tiny preset) so logits are not flat and
greedy text does not collapse into one repeated token; every vector is jittered, so a loader that
ignores a norm weight or a bias cannot pass.
"""

from __future__ import annotations

import json
from pathlib import Path

from tk.models.errors import UsageProblem

# torch, safetensors and the model code are imported where weights are made, so that the CLI can
# list the PRESETS table (tk demo --preset) without importing torch

EOS, PAD = "<|endoftext|>", "<|pad|>"

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 1}

PRESETS: dict[str, dict] = {
    # The demo and test model: GQA, 2 layers, runs anything in seconds.
    "tiny": {**_LLAMA, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 1024},
    # The benchmark model of the performance issue: 55M parameters.
    "small": {**_LLAMA, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376,
              "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
              "max_position_embeddings": 4096},
    # Really trained (trained_weights): 4 layers, hidden 128, a few seconds of AdamW on CORPUS
    "trained": {**_LLAMA, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 384,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 256},
    # 246M parameters (16 layers, hidden 1024, GQA 16/4): the size quantized-decode benchmarks use
    "medium": {**_LLAMA, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
               "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
               "max_position_embeddings": 4096},
    # Numerics of a trained checkpoint at test size (see trained_like_weights): 24 layers, a 32k
    # vocabulary, tied embeddings, rope theta 1e5, logits of magnitude ~30, a residual stream
    # that grows ~200x over depth. The fixture the parity gate's tolerances are tested on.
    "trained-like": {**_LLAMA, "vocab_size": 32768, "hidden_size": 128, "intermediate_size": 384,
                     "num_hidden_layers": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 4096, "rope_theta": 100000.0, "tie_word_embeddings": True},
    # The families issue's benchmarks (examples/bench_families.py). A Mixtral-style mixture of 8 experts,
    # top 2, each half small's FFN: the active parameters of small (plus a router of 8 columns a layer)
    "small-moe": {**_LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                  "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 688, "num_hidden_layers": 8,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                  "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    # A Gemma-3-style model: 5 sliding layers (window 512, their own RoPE base) to 1 global, sandwich norms,
    # per-head q/k norms, 12 layers of small's width; its context of 8192 holds 4,096 past positions
    "small-gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                     "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 1, "vocab_size": 32000,
                     "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 12,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "query_pre_attn_scalar": 64,
                     "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
                     "rope_local_base_freq": 10000.0, "max_position_embeddings": 8192},
}

CORPUS = """\
The quick brown fox jumps over the lazy dog. A decoder reads tokens one at a time and predicts the next.
Once upon a time there was a small model that wanted to run everywhere: on a laptop, on a server, on a GPU.
It learned that every runtime computes slightly different numbers, and that a good tool tells you how much.
Prefill reads the whole prompt; decode appends one token and reuses the cache of keys and values.
Attention looks back over the past, never into the future; padding on the left must never leak into a row.
Rotary position embeddings turn positions into angles; grouped query attention shares keys among heads.
In 1969 people walked on the moon. In 2026 people export transformers to ONNX and build TensorRT engines.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828. Code: def f(x): return x * 2 + 1
"""


def train_tokenizer(folder: Path, vocab_size: int) -> None:
    """Train a byte-level BPE on CORPUS and save tokenizer.json + tokenizer_config.json.

    Deterministic; needs no network. Ids 0 and 1 are EOS and PAD.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
         "model_max_length": 1 << 30}, indent=2))


def random_weights(hf_config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded tensors under Hugging Face names: matrices N(0, 1.6/sqrt(fan_in)), norm weights 1 + N(0, 0.1)
    (Gemma-style offset norms get N(0, 0.1)), biases N(0, 0.05)."""
    import torch

    from tk.models.families import config_from_hf
    from tk.models.loading import hf_shapes

    cfg = config_from_hf(hf_config)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(hf_shapes(cfg).items()):
        t = torch.randn(shape, generator=g)
        if len(shape) > 1:
            t = t * (1.6 / shape[-1] ** 0.5)
        elif name.endswith("norm.weight"):
            t = (1.0 - cfg.norm_offset) + 0.1 * t
        else:
            t = 0.05 * t
        out[name] = t.contiguous()
    return out


def trained_like_weights(hf_config: dict, seed: int, growth: float = 1.25, embed_std: float = 0.05,
                         logit_max: float = 30.0) -> dict[str, torch.Tensor]:
    """Seeded weights with the numerics that make a trained checkpoint hard for a parity gate.

    Random weights at HF's init give logits near 1 and a residual stream of constant size, so
    float32 differences stay ~1e-6 and no tolerance is ever tested at scale. A trained model
    (FACTS.md: a 135M, 30-layer Llama) has logits of magnitude ~30, keys and values of several
    units, peaked attention, and a residual stream whose RMS grows layer by layer. This draws
    the weights, then calibrates them on a batch of random tokens, layer by layer, as a
    data-dependent init does:
    - each block's attention and FFN output projections are scaled so that the residual RMS
      grows by `growth` per layer (1.25 over 24 layers: ~200x, from the embeddings' 0.05);
    - the final norm's weight is scaled so the mean over positions of max |logit| is `logit_max`;
    - keys and values are drawn 2x wider (max |k| ~9, as in trained checkpoints' caches) and
      queries 0.8x; every norm weight is jittered (1 + N(0, 0.1)) before scaling.
    Wider keys and FFN gains make a random deep model chaotic (a 1e-6 change of the embeddings
    moved the logits by 3e-3, and fp16 by 2.1 against the real checkpoint's 0.085); these gains
    keep it at 3e-4 and 0.3 in eager PyTorch.
    """
    import torch

    from tk.models.families import config_from_hf
    from tk.models.decoder import Decoder

    cfg = config_from_hf(hf_config)
    g = torch.Generator().manual_seed(seed)
    model = Decoder(cfg).eval()
    gains = {"attn.wqkv.weight": None, "attn.wo.weight": 1.0, "ffn.w_gate_up.weight": 1.0, "ffn.w_down.weight": 1.0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = torch.randn(p.shape, generator=g)
            if name == "embed.weight":
                p.copy_(embed_std * t)
            elif p.dim() > 1:
                p.copy_(t / p.shape[1] ** 0.5)
                kind = name.split(".", 2)[-1]
                if kind == "attn.wqkv.weight":
                    q, kv = cfg.q_size, cfg.kv_size
                    p[:q] *= 0.8
                    p[q:q + kv] *= 2.0
                    p[q + kv:] *= 2.0
                else:
                    p.mul_(gains[kind])
            elif name.endswith("norm.weight"):
                p.copy_(1.0 - cfg.norm_offset + 0.1 * t)
            else:
                p.copy_(0.05 * t)
        ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=g)
        mask = torch.ones_like(ids)
        pos = torch.arange(64).expand(4, 64)

        def rms(x: torch.Tensor) -> float:
            return float(x.pow(2).mean().sqrt())

        for i, layer in enumerate(model.layers):
            for module, proj in ((layer.attn, layer.attn.wo), (layer.ffn, layer.ffn.w_down)):
                seen = {}
                hook = module.register_forward_hook(lambda m, a, out: seen.setdefault("y", out))
                _, _, hidden = model(ids, mask, pos, output_hidden=True)
                hook.remove()
                y = seen["y"][0] if isinstance(seen["y"], tuple) else seen["y"]
                r_in = rms(model.embed(ids)) if i == 0 else rms(hidden[i - 1])
                # two uncorrelated additions of size d take the RMS from r to growth * r
                proj.weight.mul_(r_in * ((growth**2 - 1) / 2) ** 0.5 / rms(y))
        logits, _ = model(ids, mask, pos)
        model.norm.weight.mul_(logit_max / float(logits.abs().amax(-1).mean()))
    return _hf_names(cfg, model.state_dict())


def trained_weights(hf_config: dict, seed: int, folder: Path, steps: int = 200) -> dict[str, torch.Tensor]:
    """Weights actually trained, briefly, on CORPUS with the preset's tokenizer (AdamW, next-token
    loss, batches of 8 windows of 64 tokens; 200 steps): a small model whose weights have a trained
    model's structure, so what it loses to quantization is a trained model's loss, not a random one's
    (random deep models amplify any perturbation: int8 weights keep 0.7 of trained-like's greedy
    tokens). Trained on one thread: its ops are so small that more threads only wait on each other
    (2 threads on a loaded 2-core machine: 1.7 s a step, one thread 0.1 s; 11 s in all idle), and
    the weights of a seed no longer depend on the machine's thread count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(hf_config, seed, folder, steps)
    finally:
        torch.set_num_threads(threads)


def _train(hf_config: dict, seed: int, folder: Path, steps: int) -> dict[str, torch.Tensor]:
    """trained_weights' loop, on whatever threads torch has."""
    import torch
    from tokenizers import Tokenizer

    from tk.models.families import config_from_hf
    from tk.models.decoder import Decoder

    cfg = config_from_hf(hf_config)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = Decoder(cfg)
    with torch.no_grad():  # nn.Linear's init, but the norms jittered: a loader that skips one fails
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    ids = torch.tensor(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(CORPUS * 8).ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for _ in range(steps):
        next_token_step(model, opt, ids, 64, 8, g)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return _hf_names(cfg, sd)


def next_token_step(model, opt, ids, window: int, batch: int, g, clip: float | None = None) -> float:
    """One optimizer step of next-token loss on `batch` windows of `window` tokens drawn from `ids`
    with generator `g` (the `trained` preset's loop, and examples/quality_fixture.py's); -> the loss."""
    import torch

    pos = torch.arange(window).expand(batch, window)
    mask = torch.ones(batch, window, dtype=torch.int64)
    starts = torch.randint(0, len(ids) - window - 1, (batch,), generator=g)
    x = torch.stack([ids[s:s + window] for s in starts])
    y = torch.stack([ids[s + 1:s + window + 1] for s in starts])
    logits, _ = model(x, mask, pos)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, model.config.vocab_size), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.item()


def _hf_names(cfg, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict back under Hugging Face names, unfused."""
    from tk.models.loading import weight_map

    out = {}
    for ours, parts in weight_map(cfg).items():
        for t, (name, _) in zip(sd[ours].split([rows for _, rows in parts]), parts):
            out[name] = t.contiguous().clone()
    return out


WEIGHTS = {"trained-like": trained_like_weights}


def write_preset(name: str, folder: str | Path, seed: int = 0, **config) -> Path:
    """Write preset `name` as a Hugging Face checkpoint folder and return it; `config` changes its
    config.json first (e.g. `max_position_embeddings=4096`, or sizes whose K a block divides)."""
    if name not in PRESETS:
        raise UsageProblem(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    from safetensors.torch import save_file

    from tk.models.loading import SINGLE_FILE

    hf = {**PRESETS[name], **config}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": hf["eos_token_id"]}))
    train_tokenizer(folder, hf["vocab_size"])
    weights = trained_weights(hf, seed, folder) if name == "trained" else WEIGHTS.get(name, random_weights)(hf, seed)
    save_file(weights, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    return folder

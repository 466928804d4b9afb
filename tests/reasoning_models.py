"""Tiny checkpoints that speak the reasoning families' chat formats: the tiny preset's weights with a
tokenizer that has their marker tokens (special as in the real tokenizers: gpt-oss's harmony tokens
and Qwen's `<|im_start|>`/`<|im_end|>` are special, Qwen's `<think>` and `<tool_call>` are not) and
their real chat templates (tests/fixtures/templates, README there), exported with a static cache.
The harmony encoding (openai-harmony's o200k_base vocabulary) for tests that run the library."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
QWEN_SPECIAL, QWEN_PLAIN = ["<|im_start|>", "<|im_end|>"], ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# family -> (template file, special tokens, plain added tokens, the EOS tokens of its generation config)
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", QWEN_SPECIAL, QWEN_PLAIN, ["<|endoftext|>"]),
    "qwen3.5": ("Qwen3.5-4B.jinja", QWEN_SPECIAL, QWEN_PLAIN, ["<|endoftext|>"]),
    "gpt-oss": ("openai-gpt-oss-120b.jinja", HARMONY_TOKENS, [], ["<|endoftext|>", "<|return|>"]),
}


def template(family: str) -> str:
    return (FIXTURES / "templates" / FAMILIES[family][0]).read_text()


def checkpoint(tiny: Path, folder: Path, family: str) -> Path:
    """The tiny preset (`tiny`: its folder) as a checkpoint of `family`'s chat format, in `folder`."""
    from tokenizers import AddedToken, Tokenizer

    from tk.models.fixtures.presets import train_tokenizer

    name, special, plain, eos = FAMILIES[family]
    shutil.copytree(tiny, folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    train_tokenizer(folder, vocab - len(special) - len(plain))  # the added tokens' ids stay in the model's rows
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(template(family))
    ids = [tok.token_to_id(t) for t in eos]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder


def artifact(tiny: Path, root: Path, family: str) -> Path:
    from tk.toolkit.pipeline.export import export_artifact

    out = root / "artifact"
    export_artifact(checkpoint(tiny, root / "checkpoint", family), out, kv_cache="static", max_seq_len=1024,
                    validate=False)
    return out


def harmony_encoding(tmp: Path):
    """openai-harmony's gpt-oss encoding, its vocabulary read from the fixture (harmony checks its sha256)."""
    import os

    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    vocab = tmp / "o200k_base.tiktoken"
    if not vocab.is_file():
        vocab.write_bytes(gzip.decompress((FIXTURES / "harmony" / "o200k_base.tiktoken.gz").read_bytes()))
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(tmp)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

"""A chat template for test checkpoints, in either of the places transformers reads one from."""

from __future__ import annotations

import json
from pathlib import Path

# ChatML-like, over the tiny tokenizer's own special token (<|endoftext|> ends every turn).
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def add_chat_template(folder: Path, where: str = "tokenizer_config.json") -> Path:
    folder = Path(folder)
    if where == "chat_template.jinja":
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    else:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}, indent=2))
    return folder

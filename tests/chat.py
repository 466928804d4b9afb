"""Chat templates for test checkpoints, in either of the places transformers reads one from."""

from __future__ import annotations

import json
from pathlib import Path

# ChatML-like, over the tiny tokenizer's own special token (<|endoftext|> ends every turn).
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# Qwen2.5's tool format (hermes: <tool_call> JSON </tool_call>), short enough for a tiny model's
# context: the tools by name in a system turn, an assistant turn's calls, a tool turn's result.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|endoftext|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|endoftext|>\n"
    "{% elif m.role == 'tool' %}<|tool|>\n{{ m.content }}<|endoftext|>\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def add_chat_template(folder: Path, where: str = "tokenizer_config.json", template: str = TEMPLATE) -> Path:
    folder = Path(folder)
    if where == "chat_template.jinja":
        (folder / "chat_template.jinja").write_text(template)
    else:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}, indent=2))
    return folder

"""README's usage block, run verbatim, line by line, in a fresh folder: what a new user types first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chat import add_chat_template

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def usage_lines() -> list[str]:
    """Every `tk ...` line of the fenced block under README's "Using it" heading."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Using it\n+```\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md has no fenced block under '## Using it'"
    return [ln for ln in block.group(1).splitlines() if ln.startswith("tk ")]


def test_every_readme_command_works_verbatim(tmp_path):
    from tk.models.presets import write_preset

    lines = usage_lines()
    assert len(lines) >= 12 and any("--chat" in ln for ln in lines) and any("--junit" in ln for ln in lines)
    ckpt = write_preset("tiny", tmp_path / "path" / "to" / "hf-checkpoint")  # as the README names it
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))  # a real context
    add_chat_template(ckpt)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for line in lines:
        out = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert "Traceback" not in out.stderr, f"{line}\n{out.stderr}"
        if line.startswith("tk build-engine"):  # no GPU here: one clean line saying how to get TensorRT
            assert out.returncode == 1, f"{line}\n{out.stderr}"
            assert out.stderr.strip().splitlines()[-1].startswith("Error: TensorRT is not installed; on a machine "
                                                                  "with an NVIDIA GPU, pip install 'tk[gpu]'")
        else:
            assert out.returncode == 0, f"{line}\nexit {out.returncode}\n{out.stderr}"
    assert (tmp_path / "out" / "model" / "manifest.json").is_file()
    assert (tmp_path / "parity.png").is_file() and (tmp_path / "parity.xml").is_file()

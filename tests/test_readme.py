"""README as a newcomer runs it: every fenced command block, verbatim, top to bottom, in one fresh
folder, on a tiny model where the README says path/to/hf-checkpoint (and a tiny LFM2 at path/to/lfm2).

A block that cannot run here is marked in the README by an HTML comment on the line before it,
`<!-- readme-test: skip (the reason) -->`, and the test prints the reason. `tk serve` runs in the
background until the page is done (the Python client block after it talks to it), and `tk
build-engine` without TensorRT must fail in one clean line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from chat import TOOLS_TEMPLATE, add_chat_template
from hf_models import make_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.readme]  # CI leaves it to `pytest -m readme` (README, "Tests")

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"^<!-- readme-test: skip \((.+)\) -->$")
SHELL = ("", "sh", "bash", "shell")


@dataclass
class Block:
    lang: str
    body: str
    line: int  # of the opening fence, 1-based
    skip: str | None  # the reason, where the README marks the block as not runnable here

    def commands(self) -> list[str]:
        """Logical lines: continuations joined, blank and comment-only lines left out."""
        return [c for c in self.body.replace("\\\n", " ").splitlines() if c.strip() and not c.lstrip().startswith("#")]


def readme_blocks() -> list[Block]:
    text = (ROOT / "README.md").read_text()
    blocks = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = SKIP.match(before)
        blocks.append(Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, mark and mark.group(1)))
    return blocks


def test_the_readme_marks_few_blocks_and_exports_each_folder_once():
    blocks = readme_blocks()
    assert len([b for b in blocks if b.skip]) <= 4, [b.skip for b in blocks if b.skip]
    outs = [m.group(1) for b in blocks if not b.skip and b.lang in SHELL for c in b.commands()
            if (m := re.match(r"tk export \S+ -o (\S+)", c))]
    assert len(outs) == len(set(outs)), f"exported twice: {sorted({o for o in outs if outs.count(o) > 1})}"
    assert blocks[0].skip and "tk demo" in blocks[0].body  # the first block sets up, and the second leads with --for
    assert "--for ort-cpu" in blocks[1].body and not blocks[1].skip


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port(command: str) -> int:
    found = re.search(r"--port (\d+)", command)
    return int(found.group(1)) if found else 8000


class Server:
    """A `tk serve ...` line, started in the background and stopped (SIGINT) when the page is done."""

    def __init__(self, command: str, cwd: Path, env: dict):
        self.port = _port(command)
        self.log = cwd / "serve.log"
        self.proc = subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{command} exited {self.proc.returncode}:\n{self.log.read_text()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        pytest.fail(f"{command} did not answer /health in 180 s:\n{self.log.read_text()}")

    def stop(self) -> int:
        """Ctrl-C for tk serve (it drains and exits 0), not for the shell that runs it: a shell that
        receives SIGINT itself reports the line as interrupted, whatever tk serve did."""
        pid = self.proc.pid
        if self.proc.poll() is not None:
            return self.proc.returncode
        shell = Path(f"/proc/{pid}/comm").read_text().strip() in ("bash", "sh")
        for target in (Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if shell else [pid]):
            os.kill(int(target), signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def _run(command: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                          executable="/bin/bash")


def _check(command: str, out: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in out.stderr, f"{command}\n{out.stderr}"
    if command.startswith("tk build-engine") and importlib.util.find_spec("tensorrt") is None:
        # no GPU here: one clean line saying how to get TensorRT
        assert out.returncode == 1, f"{command}\n{out.stderr}"
        assert out.stderr.strip().splitlines()[-1].startswith("Error: TensorRT is not installed; on a machine "
                                                              "with an NVIDIA GPU, pip install 'tk[gpu]'")
    else:
        assert out.returncode == 0, f"{command}\nexit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


def test_every_readme_block_runs_verbatim_in_one_fresh_folder(tmp_path):
    from tk.models.fixtures.presets import CORPUS, write_preset

    # the tiny preset with a real context, and sizes whose every K a block of 32, 64 or 128 divides
    # (int4 for ONNX Runtime and for TensorRT), and a chat template that renders tools (tk generate --chat,
    # the agent's loop against tk serve)
    ckpt = write_preset("tiny", tmp_path / "path" / "to" / "hf-checkpoint", hidden_size=128, intermediate_size=256,
                        max_position_embeddings=4096)
    add_chat_template(ckpt, template=TOOLS_TEMPLATE)
    make_checkpoint("lfm2", tmp_path / "path" / "to" / "lfm2")  # a hybrid ("Hybrid decoders")
    (tmp_path / "held-out.txt").write_text(CORPUS)  # tk eval --text held-out.txt: the user's own text
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    server, took, said = None, [], []
    try:
        for block in readme_blocks():
            where = f"README.md:{block.line}"
            if block.skip:
                said.append(f"{where}: not run here: {block.skip}")
                continue
            if block.lang == "python":
                if server is None and "127.0.0.1:8000" in block.body:
                    said.append(f"{where}: not run here: no tk serve is up on port 8000 (it was busy)")
                    continue
                (tmp_path / "block.py").write_text(block.body)
                start = time.perf_counter()
                _check(f"{where} (python)", _run(f"{sys.executable} block.py", tmp_path, env))
                took.append((time.perf_counter() - start, f"{where} (python)"))
                continue
            assert block.lang in SHELL, f"{where}: a ```{block.lang} block; mark it or make it shell or python"
            for command in block.commands():
                start = time.perf_counter()
                if command.startswith("tk serve "):
                    if server is not None or not _port_free(_port(command)):
                        said.append(f"{where}: not run here: {command!r}: its port is busy on this machine")
                        continue
                    server = Server(command, tmp_path, env)
                else:
                    _check(command, _run(command, tmp_path, env))
                took.append((time.perf_counter() - start, command))
    finally:
        code = server.stop() if server is not None else 0
        print("\n".join(said + [f"{s:6.1f} s  {c}" for s, c in took]))
    assert code == 0, f"tk serve exited {code} on SIGINT:\n{server.log.read_text()}"
    assert (tmp_path / "out" / "model" / "manifest.json").is_file()
    assert (tmp_path / "parity.png").is_file() and (tmp_path / "parity.xml").is_file()
    manifest = {d: json.loads((tmp_path / "out" / d / "manifest.json").read_text())
                for d in ("cpu", "model-serve", "model-int4-trt", "model-int4-cpu", "model-static")}
    assert manifest["cpu"]["profile"] == "ort-cpu" and manifest["cpu"]["variant"]["capacity"] == 2048
    assert manifest["model-int4-trt"]["precision"]["block_size"] == 128  # what TensorRT takes
    assert manifest["model-static"]["profile"] is None
    assert (tmp_path / "repo" / "model-serve" / "1" / "artifact" / "manifest.json").is_file()

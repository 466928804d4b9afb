"""tk generate --chat: the checkpoint's chat template, applied as transformers applies it."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from chat import add_chat_template
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.cli.main import main

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module", params=["tokenizer_config.json", "chat_template.jinja"])
def chat_artifact(request, tiny, tmp_path_factory):
    """(checkpoint, artifact) with the template in one of the two places a checkpoint keeps it."""
    ckpt = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(tiny, ckpt)
    add_chat_template(ckpt, request.param)
    art = ckpt.parent / "art"
    export_artifact(ckpt, art, validate=False)
    return ckpt, art


def test_chat_prompt_is_the_template_of_transformers(chat_artifact):
    from transformers import AutoTokenizer

    ckpt, art = chat_artifact
    hf = AutoTokenizer.from_pretrained(str(ckpt))
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False).endswith("<|assistant|>\n")
    common = ["--max-new-tokens", "6", "--ignore-eos", "--json"]
    chat = run("generate", art, "--chat", MESSAGES[1]["content"], "--system", MESSAGES[0]["content"], *common)
    assert chat.exit_code == 0, chat.output
    by_ids = run("generate", art, "--prompt-ids", ",".join(map(str, expected)), *common)
    row, ref = json.loads(chat.stdout)["rows"][0], json.loads(by_ids.stdout)["rows"][0]
    assert row["prompt_tokens"] == len(expected) and row["tokens"] == ref["tokens"]
    # the template was copied into the artifact at export: the checkpoint is not needed to chat
    shutil.rmtree(ckpt)
    plain = run("generate", art, "--chat", MESSAGES[1]["content"], "--system", MESSAGES[0]["content"],
                "--backend", "ort", "--max-new-tokens", "6", "--ignore-eos")
    assert plain.exit_code == 0, plain.output
    assert plain.stdout.strip() == ref["text"].strip()  # the reply, and nothing else on stdout


def test_checkpoint_without_a_template_gets_one_line(tiny_artifact):
    result = run("generate", tiny_artifact, "--chat", "hi")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {tiny_artifact} has no chat template (no chat_template.jinja, and no chat_template in "
        "tokenizer_config.json): it is not an instruction-tuned checkpoint; use --prompt"]


def test_system_needs_chat(tiny_artifact):
    result = run("generate", tiny_artifact, "--prompt", "hi", "--system", "Be brief.")
    assert result.exit_code == 2 and "Error: --system goes with --chat" in result.stderr

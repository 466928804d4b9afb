"""Forced tool calls end where the model ends (issue 46): under a required call's grammar, once a
call has closed, the model's own draw decides whether another call begins; a draw the grammar
cannot take ends the reply there, instead of being masked into one more forced call. Checked on
the grammar processor itself, driven by a planted model (scripted logits over the tiny tokenizer:
noise, and a large margin on the next token of the text it means), greedy and sampled; the
server's whole and streamed replies are tests/test_tool_calling.py's."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from chat import TOOLS_TEMPLATE, add_chat_template
from test_tool_calling import CALL, CALL_ADD, TOOLS
from tk.runtimes.decoding.sampling import NO_TOKEN, Sampler, SamplingConfig

pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="tool grammars need llguidance: pip install -e '.[serve]'")
NAMES = {"get_weather", "add"}
EOS = 0  # the tiny tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """(tokenizer, a required call's compiled grammar, parallel or one call)."""
    from tk.toolkit.serving.openai import structured, tool_grammar
    from tk.toolkit.serving.openai.schemas import schemas
    from tk.toolkit.textgen import Tokenizer

    folder = tmp_path_factory.mktemp("forced") / "checkpoint"
    shutil.copytree(tiny, folder)
    tokenizer = Tokenizer(add_chat_template(folder, template=TOOLS_TEMPLATE))
    body = schemas("tiny", 512, 512).Chat.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    compiler = structured.Compiler(tokenizer, 512, [EOS])
    specials = tool_grammar.specials_of(tokenizer.hf)
    compiled = {parallel: compiler.compile(body, tool_grammar.grammar("hermes", TOOLS, parallel=parallel,
                                                                       specials=specials))
                for parallel in (True, False)}
    return tokenizer, compiled


def planted(tokenizer, means: dict[str, float], seed: int = 0, margin: float = 20.0):
    """A model that means one of `means`' texts (each with its probability), then EOS: each step's
    logits are noise, plus log(p) + margin on the next token of each text the tokens so far follow."""
    texts = {tuple(tokenizer.encode(t, False)): np.log(p) for t, p in means.items()}
    rng = np.random.default_rng(seed)

    def logits(tokens: list[int]) -> np.ndarray:
        out = rng.standard_normal((1, 512)).astype(np.float32)
        for ids, logp in texts.items():
            if tuple(tokens[:len(ids)]) == ids[:len(tokens)]:
                out[0, ids[len(tokens)] if len(tokens) < len(ids) else EOS] = margin + logp
        return out
    return logits


def generate(constraint, model, sampling: SamplingConfig, model_ends: bool = True, budget: int = 240):
    """The batcher's row in miniature (runtimes/decoding/row.py, rows.py): processors, the
    request's sampler, NO_TOKEN or EOS ends it, and so does a complete grammar -> its tokens."""
    grammar, sampler, tokens = constraint.start(sampling if model_ends else None), Sampler(sampling), []
    while len(tokens) < budget:
        token = int(sampler(grammar(model(tokens), tokens))[0])
        if token in (NO_TOKEN, EOS):
            break
        tokens.append(token)
        if grammar.complete(tokens):
            break
    return tokens


def _calls(tokenizer, tokens) -> tuple[str | None, list[str]]:
    from tk.toolkit.serving.openai.tool_formats import PARSERS

    parsed = PARSERS["hermes"].parse(tokenizer.decode(tokens), NAMES)
    return parsed.content, [c.name for c in parsed.calls]


PROSE = f"{CALL}\nI have called it."


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("means, calls", [(PROSE, ["get_weather"]), (CALL, ["get_weather"]),
                                          (f"{CALL}\n{CALL_ADD}\nDone.", ["get_weather", "add"])])
def test_a_required_reply_ends_where_the_model_leaves_the_call_format(setup, means, calls, temperature):
    """A model that writes prose after its call (a newline, then words: what Qwen2.5-Coder-0.5B does)
    gets its one call; one that ends at once, the same; one that opens a second call, both."""
    tokenizer, compiled = setup
    model = planted(tokenizer, {means: 1.0})
    tokens = generate(compiled[True], model, SamplingConfig(temperature=temperature, seed=7))
    assert _calls(tokenizer, tokens) == (None, calls)
    written = tokenizer.decode(tokens)
    assert means.startswith(written) and written.rstrip().endswith("</tool_call>")  # nothing forced after it


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masking_alone_forced_the_prose_into_more_calls(setup, temperature):
    """What the mechanism replaces: the same model under the mask alone writes call after call."""
    tokenizer, compiled = setup
    tokens = generate(compiled[True], planted(tokenizer, {PROSE: 1.0}), SamplingConfig(temperature=temperature, seed=7),
                      model_ends=False)
    assert len(_calls(tokenizer, tokens)[1]) >= 2


def test_one_call_where_parallel_calls_are_off(setup):
    tokenizer, compiled = setup
    tokens = generate(compiled[False], planted(tokenizer, {f"{CALL}\n{CALL_ADD}": 1.0}), SamplingConfig(seed=1))
    assert _calls(tokenizer, tokens) == (None, ["get_weather"])


def test_sampled_the_model_opens_a_second_call_as_often_as_it_means_to(setup):
    """Sampled, a reply opens a second call with the model's own probability (30% here), not the
    mask's (every time) nor never: the model's draw decides, and the masked draw only follows it."""
    tokenizer, compiled = setup
    model = planted(tokenizer, {f"{CALL}\n{CALL_ADD}": 0.3, PROSE: 0.7}, margin=25.0)
    twice = sum(len(_calls(tokenizer, generate(compiled[True], model, SamplingConfig(temperature=1.0, seed=s)))[1]) == 2
                for s in range(200))
    assert 40 <= twice <= 80, twice  # 60 expected; 200 draws put 99.9% of outcomes in this range

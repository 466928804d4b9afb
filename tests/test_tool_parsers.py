"""toolkit/serving/openai/tools.py: the tool-call parsers on typical model replies, streaming against
non-streaming over every split of each reply, format detection on real chat templates, and the
grammars that force calls, driven through llguidance with a tiny trained tokenizer's token ids."""

from __future__ import annotations

import random

import pytest

from tk.toolkit.serving.openai.tool_grammar import grammar, specials_of
from tk.toolkit.serving.openai.tool_formats import PARSERS, detect
from tk.toolkit.serving.openai.tools import Delta, Parsed, StreamParser, ToolCall, tool_names

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}},  # no parameters
]
NAMES = tool_names(TOOLS)
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
TIME = ToolCall("get_time", "{}")
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {}}'

ALL = ...  # the whole reply stays content (stripped)

# (parser, reply, content, calls)
CASES = [
    # hermes: Qwen2.5/Qwen3/SmolLM3/Hermes
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", None, [PARIS]),
    ("hermes", f"Let me check.\n<tool_call>\n{W}\n</tool_call>", "Let me check.", [PARIS]),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", None, [PARIS, TIME]),
    ("hermes", f"Before <tool_call>{W}</tool_call> between <tool_call>{T}</tool_call>\nafter.\n",
     "Before  between \nafter.", [PARIS, TIME]),
    ("hermes", f"<tool_call>\n{W}\n", None, [PARIS]),  # stopped before the closing tag: the JSON is whole
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu', ALL, []),
    ("hermes", f"<tool_call>\n{{bad json}}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>",
     "<tool_call>\n{bad json}\n</tool_call>", [TIME]),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok', ALL, []),  # not a function offered
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', ALL, []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', ALL, []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
     None, [PARIS]),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', None, [TIME]),  # no arguments: none needed
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>', None,
     [ToolCall("get_weather", '{"city": "Zürich"}')]),
    ("hermes", "Just text, a < sign and a <tool", ALL, []),
    ("hermes", "  \n ", None, []),
    # llama3_json: Llama 3.1+
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", f"<|python_tag|>{T}", None, [TIME]),
    ("llama3_json", '\n {"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}', None, [PARIS, TIME]),
    ("llama3_json", f"{T} Done.", "Done.", [TIME]),
    ("llama3_json", f"{T};", None, [TIME]),
    ("llama3_json", f"The call would be {T}", ALL, []),  # only the reply's beginning calls
    ("llama3_json", '{"answer": 42}', ALL, []),
    ("llama3_json", f'{T}; {{"name": "rm_rf", "parameters": {{}}}}', ALL, []),  # all of them or none
    ("llama3_json", f"{T}; and more", ALL, []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"ci', ALL, []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', ALL, []),
    ("llama3_json", "<|python", ALL, []),
    # mistral: Mistral 7B v0.3, Nemo; and the newer tokenizers' name[ARGS] form
    ("mistral", f"[TOOL_CALLS] [{W}, {T}]", None, [PARIS, TIME]),
    ("mistral", f"Checking.[TOOL_CALLS][{W}]\n", "Checking.", [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None, [PARIS, TIME]),
    ("mistral", "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}", None, [TIME]),
    ("mistral", '[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}] sorry', ALL, []),
    ("mistral", f'[TOOL_CALLS] [{W}, {{"name": 1}}]', ALL, []),  # all of them or none
    ("mistral", "[TOOL_CALLS] no JSON here", ALL, []),
    ("mistral", f"[TOOL_CALLS] [{W}", ALL, []),
    ("mistral", "[TOOL_CALLS] []", ALL, []),
    ("mistral", "A list: [1, 2] and [TOOL", ALL, []),
    # granite: Granite 3.x
    ("granite", f"<|tool_call|>[{T}]", None, [TIME]),
    ("granite", f"<|tool_call|> [{W}, {T}]", None, [PARIS, TIME]),
    ("granite", f"<tool_call>[{W}]", None, [PARIS]),
    ("granite", '<|tool_call|>[{"arguments": {}}]', ALL, []),
    ("granite", f"I can help.<|tool_call|>[{W}", ALL, []),
    # pythonic: Llama 3.2/4 small models
    ("pythonic", '[get_weather(city="Paris"), get_time()]', None, [PARIS, TIME]),
    ("pythonic", ' [get_weather(city="Paris", days=3, metric=True, at=None, hours=(1, 2))]\n', None,
     [ToolCall("get_weather", '{"city": "Paris", "days": 3, "metric": true, "at": null, "hours": [1, 2]}')]),
    ("pythonic", "[a link](https://example.com)", ALL, []),
    ("pythonic", "[get_weather(city=paris)]", ALL, []),  # a variable, not a literal
    ("pythonic", '[get_weather("Paris")]', ALL, []),
    ("pythonic", "[rm_rf()]", ALL, []),
    ("pythonic", "[get_time()] done", ALL, []),  # the list is the whole reply
    ("pythonic", "I would call [get_time()]", ALL, []),
    ("pythonic", "[get_time(", ALL, []),
]


def _stream(parser: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    s = StreamParser(PARSERS[parser], NAMES)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    assert all((d.content is None) != (d.call is None) and d.content != "" for d in deltas), deltas
    return "".join(d.content for d in deltas if d.content), [d.call for d in deltas if d.call]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parse(parser, text, content, calls):
    assert PARSERS[parser].parse(text, NAMES) == Parsed(text.strip() if content is ALL else content, calls)


@pytest.mark.parametrize("parser", list(PARSERS))
def test_stream_equals_parse_over_every_split(parser):
    """Every reply of every format (another format's reply is content, or calls, all the same) split at
    every point, and in random pieces down to single characters, gives the content and calls of parse."""
    rng = random.Random(0)
    for text in dict.fromkeys(t for _, t, _, _ in CASES):
        want = PARSERS[parser].parse(text, NAMES)
        want = (want.content or "", want.calls)
        splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
        for _ in range(6):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
            splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        for pieces in splits:
            assert _stream(parser, pieces) == want, (parser, pieces)


def test_content_streams_as_it_comes():
    s = StreamParser(PARSERS["hermes"], NAMES)
    assert s.feed("  Hello wor") == [Delta(content="Hello wor")]  # leading blanks dropped, the rest at once
    assert s.feed("ld <tool") == [Delta(content="ld")]  # " " waits for text, "<tool" may open a call
    assert s.feed('_call>\n{"name": "get_time", "arguments": {}}\n') == []
    assert s.feed("</tool_call>") == [Delta(call=TIME)]
    assert s.feed(" and") == [Delta(content="  and")]
    assert s.feed(" \n") == [] and s.finish() == []

    s = StreamParser(PARSERS["llama3_json"], NAMES)
    assert s.feed(" ") == [] and s.feed("It") == [Delta(content="It")]  # no call can follow: all content
    assert s.feed(' is {"name": "get_time", "parameters": {}}') == [Delta(content=' is {"name": "get_time", '
                                                                                   '"parameters": {}}')]
    s = StreamParser(PARSERS["llama3_json"], NAMES)
    assert s.feed('{"name": "get_time", "parameters": {}}') == []  # a "; " and a second call may follow
    assert s.feed(" Done") == [Delta(call=TIME), Delta(content="Done")]

    s = StreamParser(PARSERS["pythonic"], NAMES)
    assert s.feed("[a") == [] and s.feed(" link") == [Delta(content="[a link")]  # "[a(" would have been a call

    s = StreamParser(PARSERS["mistral"], NAMES)
    assert s.feed("Sure [TOOL_C") == [Delta(content="Sure")]
    assert s.feed(f"ALLS] [{T}]") == [Delta(call=TIME)]  # the list is complete: no need to wait for the end


def test_tool_call_openai_shape():
    assert PARIS.openai("call_1") == {"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert tool_names(TOOLS) == {"get_weather", "get_time"}


# --- detect: excerpts of the real chat templates, the parts that show each format ---

# Qwen/Qwen2.5-7B-Instruct tokenizer_config.json's chat_template: an excerpt written out here (the tools
# preamble and how an assistant turn's calls are written), not fetched verbatim.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}"""

# meta-llama Llama 3.1 Instruct's template, verbatim excerpt from llama.cpp's
# models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja (3.3 ships 3.1's template).
LLAMA31 = r"""{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}"""

# meta-llama/Llama-3.2-3B-Instruct's template (llama.cpp models/templates), verbatim excerpt: no <|python_tag|>.
LLAMA32 = r"""{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}"""

# mistralai/Mistral-7B-Instruct-v0.3's template, verbatim excerpt (as LLaMA-Factory's template tests hold it).
MISTRAL_V03 = r"""{%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message["role"] == "tool_calls" or message.tool_calls is defined %}
        {%- if message.tool_calls is defined %}
            {%- set tool_calls = message.tool_calls %}
        {%- else %}
            {%- set tool_calls = message.content %}
        {%- endif %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out }}"""

# ibm-granite/granite-3.3-2b-instruct's template (llama.cpp models/templates), verbatim excerpt.
GRANITE33 = r"""{%- elif available_tools %}
         {%- set system_message = system_message + " You are a helpful assistant with access to the following tools. When a tool is required to answer the user's query, respond only with <|tool_call|> followed by a JSON list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do not have the ability to fulfill the request." %}
 {%- if available_tools %}
     {{- '<|start_of_role|>available_tools<|end_of_role|>' }}
     {{- available_tools | tojson(indent=4) }}"""

# vLLM's examples/tool_chat_template_llama3.2_pythonic.jinja, verbatim excerpt.
LLAMA32_PYTHONIC = r"""{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
    {{- "You have access to the following functions. To call functions, please respond with a python list of the calls. " }}
    {{- 'Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)] ' }}
    {{- "Do not use variables.\n\n" }}"""

CHATML = r"""{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""


@pytest.mark.parametrize("template, parser", [(QWEN25, "hermes"), (LLAMA31, "llama3_json"), (LLAMA32, "llama3_json"),
                                              (MISTRAL_V03, "mistral"), (GRANITE33, "granite"),
                                              (LLAMA32_PYTHONIC, "pythonic"), (CHATML, None)])
def test_detect(template, parser):
    assert detect(template) == parser


# --- grammars, through llguidance ---

MARKERS = ["[TOOL_CALLS]", "<|tool_call|>", "<|python_tag|>"]  # special in their models' tokenizers
QWEN_LIKE = ["<tool_call>", "</tool_call>"]  # added, not special (as Qwen2.5's); llguidance takes <...> as special


def _tokenizer(markers: bool):
    """A byte-level BPE trained in a few milliseconds on call-like text: its merges cross JSON's quotes and
    brackets as real vocabularies do. With `markers`, the markers are added tokens as in their models."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([W, T, '{"city": "Rome", "days": 12}; ', "Hello world, the weather in Paris."] * 4, trainer)
    if markers:
        tok.add_special_tokens(MARKERS)
        tok.add_tokens([AddedToken(m, special=False) for m in QWEN_LIKE] + [AddedToken("[NOT_SPECIAL]", special=False)])
    return tok


@pytest.fixture(scope="module")
def llg_env():
    """(llguidance, {with markers: (tokenizers.Tokenizer, its LLTokenizer, specials_of its transformers tokenizer)})."""
    llguidance = pytest.importorskip("llguidance")
    from transformers import PreTrainedTokenizerFast

    envs = {}
    for markers in (False, True):
        tok = _tokenizer(markers)
        lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=0)
        envs[markers] = tok, lt, specials_of(PreTrainedTokenizerFast(tokenizer_object=tok))
    return llguidance, envs


def _accepts(llg_env, lark: str, text: str, markers: bool = True) -> bool:
    """Whether the grammar takes `text`, tokenized as the model would write it, and then is complete."""
    llguidance, envs = llg_env
    tok, lt, _ = envs[markers]
    compiled = llguidance.LLMatcher.grammar_from_lark(lark)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, lt)
    assert not failed and not messages, messages
    matcher = llguidance.LLMatcher(lt, compiled, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tok.encode(text).ids) and matcher.is_accepting()


def test_specials_of(llg_env):
    tok, _, specials = llg_env[1][True]  # (through transformers' tokenizer)
    assert specials == {m: tok.token_to_id(m) for m in ["<|endoftext|>", *MARKERS, *QWEN_LIKE]}  # not [NOT_SPECIAL]
    assert specials_of(tok) == specials


def _text(fmt: str, calls: list[str], key: str = "arguments") -> str:
    calls = [c.replace('"arguments"', f'"{key}"') for c in calls]
    return {"hermes": "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls),
            "llama3_json": "; ".join(calls), "mistral": f"[TOOL_CALLS] [{', '.join(calls)}]",
            "granite": f"<|tool_call|>[{', '.join(calls)}]"}[fmt]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "granite"])
def test_grammar_forces_a_valid_call(llg_env, fmt):
    specials = llg_env[1][True][2]
    key = "parameters" if fmt == "llama3_json" else "arguments"
    one, many = (grammar(fmt, TOOLS, parallel=p, specials=specials) for p in (False, True))
    named = grammar(fmt, TOOLS, name="get_time", specials=specials)
    W2 = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 12}}'
    rome = ToolCall("get_weather", '{"city": "Rome", "days": 12}')
    for calls, expected in (([W], [PARIS]), ([T], [TIME]), ([W2], [rome])):
        text = _text(fmt, calls, key)
        assert _accepts(llg_env, one, text), text
        assert PARSERS[fmt].parse(text, NAMES) == Parsed(None, expected)  # it reads back, arguments as written
    assert _accepts(llg_env, many, _text(fmt, [W, T, W2], key)) and _accepts(llg_env, many, _text(fmt, [T], key))
    assert not _accepts(llg_env, one, _text(fmt, [W, T], key))  # one call only
    assert _accepts(llg_env, named, _text(fmt, [T], key)) and not _accepts(llg_env, named, _text(fmt, [W], key))
    refused = ['{"name": "get_wether", "arguments": {"city": "Paris"}}',  # no such function
               '{"name": "get_weather", "arguments": {"city": 3}}',  # a string argument given a number
               '{"name": "get_weather", "arguments": {"days": 3}}',  # a required argument missing
               '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1.5}}',
               '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # name first, as the format writes it
               '{"name": "get_weather", "arguments": {"city": "Paris"}, "why": 1}',
               '{"name": "get_weather", "arguments": {"city":"Paris"}}',  # compact as trained: ": " and ", "
               '{"name": "get_weather",  "arguments": {"city": "Paris"}}',
               '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}']
    for call in refused:
        assert not _accepts(llg_env, many, _text(fmt, [call], key)), call
    assert not _accepts(llg_env, many, _text(fmt, [W], key)[:-3])  # unfinished


def test_grammar_markers_as_tokens_or_text(llg_env):
    specials = llg_env[1][True][2]
    lark = grammar("hermes", TOOLS, specials=specials)
    assert f"<[{specials['<tool_call>']}]>" in lark and '"<tool_call>"' not in lark
    # Qwen's <tool_call> is not special in its tokenizer, yet llguidance takes it as one: quoted, it could
    # never be that token; named by id it is the only way.
    assert not _accepts(llg_env, grammar("hermes", TOOLS), _text("hermes", [W]))
    # Where the markers are no tokens of their own, the grammar spells them out and the model writes their text.
    for fmt in ["hermes", "mistral", "granite"]:
        lark = grammar(fmt, TOOLS, specials={})
        assert "<[" not in lark and _accepts(llg_env, lark, _text(fmt, [W]), markers=False), fmt
    assert _accepts(llg_env, grammar("mistral", TOOLS, specials=specials), "[TOOL_CALLS][" + T + "]")  # no space


def test_grammar_schema_refs_and_errors(llg_env):
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
        "$defs": {"City": {"enum": ["Paris", "Rome"]}}}}}, *TOOLS]
    for fmt in ["hermes", "mistral"]:  # the list formats nest the calls one level deeper
        lark = grammar(fmt, tools, parallel=True, specials=llg_env[1][True][2])
        assert _accepts(llg_env, lark, _text(fmt, ['{"name": "pick", "arguments": {"city": "Rome"}}']))
        assert not _accepts(llg_env, lark, _text(fmt, ['{"name": "pick", "arguments": {"city": "Oslo"}}']))
    with pytest.raises(ValueError, match="the pythonic format has no grammar: "):
        grammar("pythonic", TOOLS)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        grammar("nope", TOOLS)
    with pytest.raises(ValueError, match="no function named 'get_date'"):
        grammar("hermes", TOOLS, name="get_date")

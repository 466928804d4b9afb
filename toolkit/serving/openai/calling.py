"""Tool calling on `/v1/chat/completions`, as vLLM (`--tool-call-parser`) and llama.cpp's server
(`--jinja`) serve it: a request's `tools` are rendered by the model's own chat template, and its
reply is read back for calls in the format that template teaches (the tools module's parsers).

- `tool_choice: auto` (the default where tools are given): the model decides; its calls are
  parsed out of the text, and a call that does not parse stays content (never a 500). A reply that
  is nothing but a JSON call, without the format's markers, is a call too where the format's models
  write so (the bare_calls module; `tk serve --no-bare-tool-calls` turns it off).
- `required`, or a named function: the reply runs under a grammar that admits only the format's
  call syntax with arguments valid against each function's JSON schema, so it always parses.
- `none`: the tools are rendered (vLLM's default), the reply is text.

The server picks the format from its chat template (`detect`), or takes `tk serve --tool-call-parser`;
a template that does not render tools is refused in one line (tools it never shows would be
silently ignored). No server here: the server module asks `ToolCalling.request` for each chat body
and hands the `Calls` it gets to the reply.
"""

from __future__ import annotations

from dataclasses import dataclass

from tk.toolkit.serving.openai import bare_calls, tool_formats as formats, tool_grammar, tools
from tk.toolkit.serving.openai.api import ApiError


@dataclass
class Calls:
    """One request's tool calling: the tools its template renders, and (unless tool_choice is
    none) the parser its reply is read with, the functions it may name and its grammar."""

    template_tools: list[dict]
    parser: object | None = None  # None: tool_choice none (the reply is text)
    names: frozenset = frozenset()
    grammar: str | None = None  # required or named: the Lark grammar the reply runs under
    parallel: bool = True  # False: the first call only (parallel_tool_calls: false)
    keep_special: bool = False  # the format's marker is a special token: the text keeps special tokens

    def stream(self) -> "tools.StreamParser | None":
        return None if self.parser is None else tools.StreamParser(self.parser, set(self.names))


def _agree(body) -> None:
    """tools and tool_choice's cross-field rules (400s naming the field)."""
    names = [t.function.name for t in body.tools or []]
    if len(set(names)) < len(names):
        raise ApiError(400, "tools: two functions share a name; name each once", "tools")
    choice = body.tool_choice
    if choice == "required" and not names:
        raise ApiError(400, "tool_choice: required needs tools; send tools or leave tool_choice out", "tool_choice")
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise ApiError(400, f"tool_choice: {choice.function.name!r} is not one of the tools "
                            f"({', '.join(names) or 'none given'})", "tool_choice")


class ToolCalling:
    """A server's tool calling: its chat template's format (or `parser`, tk serve --tool-call-parser),
    whether the template renders tools, the special tokens a grammar names by id, and whether `auto`
    reads bare JSON calls (`bare`; None: where the format's models write them, bare_calls.DEFAULT_ON)."""

    def __init__(self, tokenizer, parser: str | None = None, bare: bool | None = None):
        template = tokenizer.hf.chat_template if tokenizer is not None else None
        template = template if isinstance(template, str) else ""
        self.parser_name = parser or formats.detect(template)
        self.bare = self.parser_name in (bare_calls.DEFAULT_ON if bare is None else bare_calls.FORMATS if bare else ())
        self.renders = bool(template) and tokenizer.renders_tools
        self.specials = tool_grammar.specials_of(tokenizer.hf) if template else {}
        parser = formats.PARSERS.get(self.parser_name)
        marks = [*getattr(parser, "markers", ()), *getattr(parser, "heads", ()), *getattr(parser, "tokens", ())]
        self.keep_special = tool_grammar.loses(tokenizer, self.specials, marks)

    def request(self, body) -> Calls | None:
        """A chat body's tool calling (None: it sends no tools), or a 400 naming the field."""
        _agree(body)
        if not body.tools:
            return None
        if not self.renders:
            raise ApiError(400, "tools: this model's chat template does not render tools, so the model would never "
                                "see them; leave tools out, or serve a checkpoint whose template takes tools", "tools")
        given = [t.model_dump(exclude_none=True) for t in body.tools]
        choice = body.tool_choice or "auto"
        if choice == "none":
            return Calls(given)
        if self.parser_name is None:
            raise ApiError(400, "tools: tk cannot tell this chat template's tool-call format; start tk serve with "
                                f"--tool-call-parser ({', '.join(formats.PARSERS)})", "tools")
        if self.parser_name in formats.UNREAD:
            raise ApiError(400, f"tools: this chat template writes calls in the {self.parser_name} format (vLLM's name), "
                                "which tk serve does not read; leave tools out, or start tk serve with "
                                f"--tool-call-parser ({', '.join(formats.PARSERS)}) if the model writes one of those",
                           "tools")
        parser = formats.PARSERS[self.parser_name]
        if choice == "auto" and self.bare:
            parser = bare_calls.BareCalls(parser, given)
        named = None if isinstance(choice, str) else choice.function.name
        grammar = None
        if choice != "auto":
            try:
                grammar = tool_grammar.grammar(self.parser_name, given, name=named, parallel=body.parallel_tool_calls
                                          and named is None, specials=self.specials)
            except ValueError as e:
                raise ApiError(400, f"tool_choice: {e}", "tool_choice") from None
        return Calls(given, parser, frozenset(t["function"]["name"] for t in given), grammar,
                     body.parallel_tool_calls, self.keep_special)

"""The grammars that make a reply a tool call (`tool_choice: "required"` or a named function), in
llguidance's Lark dialect, over the formats of the tools module: `%json` for the call objects, so
that the arguments follow each function's JSON schema, compact as the models were trained, and
`<[id]>` for a marker that is one token of the model's tokenizer (`specials_of`).
"""

from __future__ import annotations

from tk.toolkit.serving.openai.tool_formats import PARSERS, JsonList
from tk.toolkit.serving.openai.tools import JSON_OPTIONS


def _relocate(schema, base: str):
    """A schema's local `$ref`s ("#/$defs/X") as pointers from the root of the schema it is put in at `base`."""
    if isinstance(schema, dict):
        return {k: "#" + base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _relocate(v, base) for k, v in schema.items()}
    return [_relocate(v, base) for v in schema] if isinstance(schema, list) else schema


def grammar(parser_name: str, tools: list[dict], *, name: str | None = None, parallel: bool = False,
            specials: dict[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's dialect) whose every text is a call of `name` (else of any of the
    tools), several where `parallel`, in the format of `parser_name`. `specials`: marker text -> id of
    the one token it is (`specials_of`). ValueError for a format with no grammar or an unknown name."""
    if parser_name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser_name!r}; known: {', '.join(PARSERS)}")
    fmt = PARSERS[parser_name]
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise ValueError(f"no function named {name!r} among the tools" if name else "no tools to call")
    if getattr(fmt, "names_outside", False):  # one call, its name in the format's text and its arguments a root
        return fmt.grammar_of([(f["name"], {"x-guidance": dict(JSON_OPTIONS), "type": "object",
                                            **(f.get("parameters") or {})}) for f in functions], specials or {})
    # One branch a function, `name` first as every format writes it; where the list formats nest the
    # branches under "items", `JsonList.grammar` moves them, so its refs are relocated under /items.
    base = "/items" if isinstance(fmt, JsonList) else ""
    branches = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        fmt.args_key: _relocate({"type": "object", **(f.get("parameters") or {})},  # (arguments are an object)
                                f"{base}/anyOf/{i}/properties/{fmt.args_key}")},
        "required": ["name", fmt.args_key], "additionalProperties": False} for i, f in enumerate(functions)]
    return fmt.grammar({"x-guidance": dict(JSON_OPTIONS), "anyOf": branches}, parallel, specials or {})


def specials_of(hf_tokenizer) -> dict[str, int]:
    """Text -> id of the added tokens llguidance takes as special, which a grammar can only name by id:
    the special ones and, as llguidance reads tokenizer.json, any `<...>` (Qwen's `<tool_call>` is not
    special in its tokenizer, yet a quoted "<tool_call>" could never match that token). Takes a
    transformers tokenizer or a `tokenizers.Tokenizer`."""
    added = getattr(hf_tokenizer, "added_tokens_decoder", None)
    added = hf_tokenizer.get_added_tokens_decoder() if added is None else added
    return {t.content: i for i, t in added.items()
            if t.special or (t.content.startswith("<") and t.content.endswith(">"))}


def loses(tokenizer, specials: dict[str, int], marks) -> bool:
    """Whether decoding would drop one of `marks` (a special token, skipped when decoding): a reply read
    for them keeps special tokens in its text."""
    return any(m in specials and tokenizer.decode([specials[m]]) == "" for m in marks)

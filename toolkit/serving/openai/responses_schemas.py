"""The body of `POST /v1/responses` (OpenAI's Responses API) as tk serve takes it, in pydantic, so that
FastAPI validates and documents it beside chat completions (the schemas module, whose pieces it
shares): `input` as a string or a list of items (messages, with text parts; `function_call`;
`function_call_output`; an output message or reasoning item sent back as it came), `instructions`, function
`tools`, `tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`, tk's
`seed`, `text.format` (text, json_object, json_schema), `stream`, `store`, `previous_response_id`,
`include` (empty: tk adds nothing), `metadata`, `user`, `truncation` (disabled).

As every tk body, it forbids what it does not name, so what tk does not implement is a 400 naming
it: `reasoning`, `background`, `conversation`, `prompt`, image and file parts, encrypted reasoning, and
hosted tools (web search, file search, code interpreter, computer use, image generation, MCP, ...),
which `_hosted` names by their type. Rules between fields are in the document (`if`/`then`), as the
chat body's. No `from __future__ import annotations` (pydantic reads these classes' annotations).
"""

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from tk.toolkit.serving.openai.api import LIMITS
from tk.toolkit.serving.openai.schema_rules import NOT_NULL, Int, Strict, Text, given, rules, when
from tk.toolkit.serving.openai.schemas import RULES, FunctionName, Sizes

ItemId = Annotated[str, Field(max_length=256)]
Status = Optional[Literal["in_progress", "completed", "incomplete"]]
HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
          "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom", "tool_search")


class TextPart(Strict):
    """A message's text: what a client writes (`input_text`), or a reply's (`output_text`) sent back."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[Annotated[list[dict], Field(max_length=LIMITS["tools"])]] = None  # a reply's, sent back
    logprobs: Optional[Annotated[list[dict], Field(max_length=LIMITS["messages"])]] = None


Content = Union[str, Annotated[list[TextPart], Field(max_length=LIMITS["messages"])]]


class MessageItem(Strict):
    """A message: `{"role", "content"}` as clients write one, or a reply's output message sent back."""

    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: Optional[ItemId] = None
    status: Status = None
    phase: Optional[Literal["commentary", "final_answer"]] = None


class FunctionCallItem(Strict):
    """A call the model made (a reply's `function_call` item, sent back)."""

    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: str
    id: Optional[ItemId] = None
    status: Status = None


class FunctionCallOutputItem(Strict):
    """A tool's result, answering the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: ItemId
    output: Content
    id: Optional[ItemId] = None
    status: Status = None


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """A reply's reasoning sent back (tk's own: text, no encrypted content): the next assistant turn's."""

    type: Literal["reasoning"]
    summary: Annotated[list[ReasoningText], Field(max_length=LIMITS["messages"])] = []
    content: Optional[Annotated[list[ReasoningText], Field(max_length=LIMITS["messages"])]] = None
    id: Optional[ItemId] = None
    status: Status = None
    encrypted_content: Literal[None] = None  # (tk writes none, and reads none of another server's)


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
REASONING = {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]}


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema of the arguments object (none: any object)
    strict: Optional[bool] = None  # OpenAI's; tk holds required and named calls to the schema either way


class NamedTool(Strict):  # the Responses shape of a named tool_choice: no "function" level
    type: Literal["function"]
    name: FunctionName


class TextFormat(Strict):
    model_config = rules(when(given("type", {"const": "json_schema"}), given("schema", NOT_NULL),
                              {"properties": {"schema": {"type": "null"}}}))

    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    schema_: Optional[dict] = Field(None, alias="schema", description=RULES["constraint"])
    description: Optional[str] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is required with type json_schema, and only then")
        return self


class TextConfig(Strict):
    format: Optional[TextFormat] = None


def _hosted(tools):
    """A hosted tool's 400, by its type, before the function tools are validated."""
    if isinstance(tools, list):
        kinds = [t.get("type") for t in tools if isinstance(t, dict) and t.get("type") != "function"]
        known = [k for k in kinds if isinstance(k, str) and (k in HOSTED or k.startswith(HOSTED))]
        if known:
            raise ValueError(f"{', '.join(dict.fromkeys(known))}: a hosted tool, which tk serve does not run; "
                             "send function tools (type function) and run them in the client")
    return tools


def body(sizes: Sizes):
    """The Responses body of a server of `sizes.model`."""
    Budget = Int(ge=1, le=max(1, sizes.max_context - 1))

    class Responses(Strict):
        model_config = rules(when(given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]}),
                                  given("tools", {"type": "array", "minItems": 1})))  # calling._agree

        model: sizes.model = None
        # (one message fewer than a chat's: the instructions are the conversation's first)
        # (a reasoning item is the next turn's: an input of nothing else is no conversation)
        input: Union[Text, Annotated[list[Item], Field(min_length=1, max_length=LIMITS["messages"] - 1,
                                                       json_schema_extra={"contains": {"not": REASONING}})]] = Field(
            description=RULES["messages"])
        instructions: Optional[str] = None
        tools: Optional[Annotated[list[FunctionTool], Field(max_length=LIMITS["tools"])]] = Field(
            None, description=RULES["tools"])
        tool_choice: Union[Literal["none", "auto", "required"], NamedTool, None] = Field(
            None, description=RULES["tool_choice"])
        parallel_tool_calls: bool = True
        max_output_tokens: Optional[Budget] = None
        temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
        top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
        seed: Optional[Int(ge=0, lt=2**63)] = None  # tk's, as in chat completions
        text: Optional[TextConfig] = None
        stream: bool = False
        store: bool = True  # kept for GET /v1/responses/{id} and previous_response_id (bounded: oldest out)
        previous_response_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
        include: Optional[Annotated[list[str], Field(max_length=0)]] = None  # tk adds nothing to a response
        metadata: Optional[Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                                     Field(max_length=16)]] = None
        user: Optional[str] = Field(None, max_length=256)
        truncation: Optional[Literal["disabled"]] = None

        @field_validator("input")
        @classmethod
        def _more_than_reasoning(cls, given):
            if isinstance(given, list) and all(isinstance(i, ReasoningItem) for i in given):
                raise ValueError("reasoning items only: send the messages, calls or call outputs they go with")
            return given

        @field_validator("tools", mode="before")
        @classmethod
        def _no_hosted_tools(cls, tools):
            return _hosted(tools)

    return Responses


def dump(model: Optional[BaseModel]):
    """A body's part as the response echoes it (None stays None)."""
    return None if model is None else model.model_dump(by_alias=True, exclude_none=True)

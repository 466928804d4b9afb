"""The request bodies `tk serve` takes (pydantic, so that FastAPI validates them and documents them
in /openapi.json): OpenAI's completions and chat completions, vLLM's extras (`top_k`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `return_token_ids`, `structured_outputs` and
the older `guided_*`), and vLLM's tokenizer endpoints.

Every body forbids fields it does not name: a field tk does not implement (`suffix`, `audio`,
`best_of`, ...) gets a 400 naming it, never a silent 200. The served model's name, its vocabulary
and context are in the schemas (an enum, token id ranges, token budgets), and every list has a cap
(LIMITS), so the document says what the server accepts; every number is bounded there (floats finite:
no NaN or infinity) or handled exactly (a `top_k` beyond the vocabulary is all of it; a tiny
`repetition_penalty`'s overflow is the sampler's to make finite). The parts that do not depend on
the model are classes here; a body that does is made by a small factory per schema from the model's
`_Sizes` (`schemas` makes them all). Imported once the serving stack is known to be installed (pydantic).
No `from __future__ import annotations`: pydantic and FastAPI read the annotations of classes made
inside functions as objects.
"""

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from tk.toolkit.serving.openai.api import LIMITS


@dataclass
class Schemas:
    """The models of one server: Completion, Chat, Tokenize (text), TokenizeChat, Detokenize."""

    Completion: Any
    Chat: Any
    Tokenize: Any
    TokenizeChat: Any
    Detokenize: Any


def _integral(value):
    """JSON Schema's integer includes 2.0: take it as 2 (strict models refuse floats, bools and strings)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds):  # the bounds inside, so that the JSON schema says minimum/maximum (not pydantic's ge/le)
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Text = Annotated[str, Field(min_length=1)]  # an empty prompt has no token to start from
Stop = Union[Annotated[str, Field(max_length=LIMITS["stop_chars"])],
             Annotated[list[Annotated[str, Field(max_length=LIMITS["stop_chars"])]], Field(max_length=LIMITS["stop"])],
             None]


class Strict(BaseModel):  # no coercion either: `"seed": false` or `"max_tokens": "5"` is a 400, as the schema says
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class JsonSchema(Strict):
    name: str = Field("response", max_length=64)
    schema_: dict = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(Strict):  # vLLM's: exactly one of them
    json_: Union[dict, str, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[Text]] = Field(None, min_length=1, max_length=LIMITS["prompts"])
    grammar: Optional[str] = None  # a Lark grammar (llguidance's dialect)
    json_object: Optional[bool] = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]  # OpenAI's rule (and a dot)


class FunctionCall(Strict):
    name: FunctionName
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(Strict):  # an assistant turn's call, sent back in the conversation
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None  # None only where an assistant turn calls tools
    name: Optional[str] = Field(None, max_length=256)
    tool_calls: Optional[Annotated[list[ToolCall], Field(max_length=LIMITS["tools"])]] = None
    tool_call_id: Optional[str] = Field(None, max_length=256)  # a tool turn's: the call it answers
    refusal: Optional[str] = None  # an assistant turn's, as OpenAI's clients send it back

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to an assistant message")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message answers one call: tool_call_id is required there, and only there")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal is not None)):
            raise ValueError("content is required (null only for an assistant message with tool_calls)")
        return self


class Function(Strict):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema of the arguments object (none: any object)
    strict: Optional[bool] = None  # OpenAI's; tk holds required and named calls to the schema either way


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice, None]
Tools = Optional[Annotated[list[Tool], Field(min_length=1, max_length=LIMITS["tools"])]]



Messages = Annotated[list[Message], Field(min_length=1, max_length=LIMITS["messages"])]


@dataclass(frozen=True)
class _Sizes:
    """What the served model puts in its bodies' schemas: its name (`model`: optional, vLLM's default is
    the one served), its token ids and its context."""

    model: Any
    token_id: Any
    vocab_size: int
    max_context: int

    @classmethod
    def of(cls, model_name: str, vocab_size: int, max_context: int) -> "_Sizes":
        return cls(Optional[Literal[model_name]], Int(ge=0, lt=vocab_size), vocab_size, max_context)


def _body(sizes: _Sizes):
    """What completions and chat completions share."""
    Budget = Int(ge=1, le=max(1, sizes.max_context - 1))
    vocab_size = sizes.vocab_size

    class Body(Strict):
        model: sizes.model = None
        max_tokens: Optional[Budget] = None
        max_completion_tokens: Optional[Budget] = None
        min_tokens: Int(ge=0, le=sizes.max_context) = 0
        temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)  # below 1e-5: greedy
        top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
        top_k: Int(ge=-1) = 0  # vLLM: -1 (or 0) is off; beyond the vocabulary: all of it
        # > 0 as vLLM's; a tiny one overflows the seen tokens' logits, which the sampler handles (sampling.py)
        repetition_penalty: float = Field(1.0, gt=0, le=10, allow_inf_nan=False)
        presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
        frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
        logit_bias: Optional[Annotated[dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$")],
                                            Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]],
                                       Field(max_length=LIMITS["logit_bias"])]] = None
        n: Int(ge=1, le=LIMITS["n"]) = 1
        stream: bool = False
        stream_options: Optional[StreamOptions] = None
        stop: Stop = None
        seed: Optional[Int(ge=0, le=2**63 - 1)] = None
        ignore_eos: bool = False
        speculate: bool = True  # tk's: where the server speculates (tk serve --lookup), false opts this request out
        return_token_ids: bool = False
        user: Optional[str] = Field(None, max_length=256)  # OpenAI's end-user id: recorded nowhere
        response_format: Optional[ResponseFormat] = None
        structured_outputs: Optional[StructuredOutputs] = None
        guided_json: Union[dict, str, None] = None  # vLLM's older names for structured_outputs
        guided_regex: Optional[str] = None
        guided_choice: Optional[list[Text]] = Field(None, min_length=1, max_length=LIMITS["prompts"])
        guided_grammar: Optional[str] = None

        @field_validator("stream_options")  # (field validators: the 400 names the field; `stream` comes first)
        @classmethod
        def _options_need_a_stream(cls, options, info):
            if options is not None and not info.data.get("stream"):
                raise ValueError("stream_options needs stream: true")
            return options

        @field_validator("logit_bias")
        @classmethod
        def _bias_keys(cls, bias):
            for key in bias or {}:
                if not int(key) < vocab_size:
                    raise ValueError(f"keys are token ids in 0 .. {vocab_size - 1}, got {key!r}")
            return bias

    return Body


def _completion(body, sizes: _Sizes):
    TokenId, max_context = sizes.token_id, sizes.max_context

    class Completion(body):
        prompt: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=LIMITS["prompts"])],
                      Annotated[list[TokenId], Field(min_length=1, max_length=max_context)],
                      Annotated[list[Annotated[list[TokenId], Field(min_length=1, max_length=max_context)]],
                                Field(min_length=1, max_length=LIMITS["prompts"])]]
        echo: bool = False
        logprobs: Optional[Int(ge=0, le=LIMITS["logprobs"])] = None

    return Completion


def _chat(body):
    class Chat(body):
        messages: Messages
        logprobs: bool = False
        top_logprobs: Optional[Int(ge=0, le=LIMITS["logprobs"])] = None
        tools: Tools = None
        tool_choice: ToolChoice = None  # OpenAI's default: auto where tools are given, else none
        parallel_tool_calls: bool = True

        @field_validator("top_logprobs")
        @classmethod
        def _top_needs_logprobs(cls, top, info):
            if top and not info.data.get("logprobs"):
                raise ValueError("top_logprobs needs logprobs: true")
            return top

    return Chat


def _tokenize(sizes: _Sizes):
    class Tokenize(Strict):  # vLLM's TokenizeCompletionRequest
        model: sizes.model = None
        prompt: str
        add_special_tokens: bool = True
        return_token_strs: bool = False

    return Tokenize


def _tokenize_chat(sizes: _Sizes):
    class TokenizeChat(Strict):  # vLLM's TokenizeChatRequest
        model: sizes.model = None
        messages: Messages
        add_generation_prompt: bool = True
        tools: Tools = None  # rendered by the chat template, as in a chat request
        return_token_strs: bool = False

    return TokenizeChat


def _detokenize(sizes: _Sizes):
    class Detokenize(Strict):
        model: sizes.model = None
        tokens: Annotated[list[sizes.token_id], Field(max_length=sizes.max_context * 4)]

    return Detokenize


def schemas(model_name: str, vocab_size: int, max_context: int) -> Schemas:
    sizes = _Sizes.of(model_name, vocab_size, max_context)
    body = _body(sizes)
    return Schemas(_completion(body, sizes), _chat(body), _tokenize(sizes), _tokenize_chat(sizes), _detokenize(sizes))

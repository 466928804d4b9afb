"""The request bodies `tk serve` takes (pydantic, so that FastAPI validates them and documents them
in /openapi.json): OpenAI's completions and chat completions, vLLM's extras (`top_k`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `return_token_ids`, `structured_outputs` and
the older `guided_*`), and vLLM's tokenizer endpoints.

Every body forbids fields it does not name: a field tk does not implement (`suffix`, `audio`,
`best_of`, ...) gets a 400 naming it, never a silent 200. The served model's name, its vocabulary
and context are in the schemas (an enum, token id ranges, token budgets), and every list has a cap
(LIMITS, and the choices the server takes at once), so the document says what the server accepts;
every number is bounded there (floats finite: no NaN or infinity) or handled exactly (a `top_k`
beyond the vocabulary is all of it; a tiny `repetition_penalty`'s overflow is the sampler's to make
finite). A rule between fields of one object (a tool message's `tool_call_id`, `stream_options`
only with `stream`, ...) is in the document too, as `if`/`then` (OpenAPI 3.1 is JSON Schema
2020-12), so that a fuzzer (issue 36: schemathesis) finds no body the document admits and the
server refuses. What no JSON schema can say is in the fields' descriptions (RULES): the prompt and
its budget within the context (tokens, not characters), prompts x n within the choices, one
constraint per request, a grammar, regex or JSON schema llguidance compiles, a named tool_choice
among the tools, tool names distinct. The parts that do not depend on the model are classes here; a
body that does is made by a small factory per schema from the model's `Sizes` (`schemas` makes
them all). Imported once the serving stack is known to be installed (pydantic).
No `from __future__ import annotations`: pydantic and FastAPI read the annotations of classes made
inside functions as objects.
"""

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from tk.toolkit.serving.openai.api import LIMITS
from tk.toolkit.serving.openai.schema_rules import (ABSENT, NOT_NULL, Int, Stop, Strict, Text, below, given,
                                                    rules, when)


@dataclass
class Schemas:
    """The models of one server: Completion, Chat, Tokenize (text), TokenizeChat, Detokenize."""

    Completion: Any
    Chat: Any
    Tokenize: Any
    TokenizeChat: Any
    Detokenize: Any
    sizes: "Sizes"  # what they were made for (the Responses body's module makes its own from them)


# What no JSON schema can say, said where a client reads the field (the server's 400s name the field)
RULES = {
    "prompt": "Each prompt's tokens plus max_tokens fit the model's context (a prompt as long as the context leaves "
              "no room), or the request is a 400. Prompts x n is at most the choices the server takes at once (n's "
              "maximum).",
    "messages": "The conversation's tokens as the chat template renders them (with the tools) plus max_tokens fit "
                "the model's context, or the request is a 400.",
    "n": "Prompts x n is at most this maximum, the choices the server takes at once.",
    "constraint": "One constraint per request: at most one of response_format (json_object or json_schema), "
                  "structured_outputs' fields, guided_json, guided_regex, guided_choice, guided_grammar, and none "
                  "with a required or named tool_choice. A regex, a Lark grammar (llguidance's dialect) or a JSON "
                  "schema that llguidance cannot compile is a 400.",
    "tools": "Each function named once; a required or named tool_choice holds the reply to a grammar built from "
             "the functions' parameters, which llguidance compiles or the request is a 400.",
    "tool_choice": "required needs tools; a named function must be one of the tools.",
    "chat_template_kwargs": "Variables the chat template reads (vLLM's), e.g. {\"enable_thinking\": false} (Qwen3) "
                            "or {\"reasoning_effort\": \"high\"} (gpt-oss); none of apply_chat_template's own "
                            "arguments.",
}


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class JsonSchema(Strict):
    name: str = Field("response", max_length=64)
    schema_: dict = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    model_config = rules(when(given("type", {"const": "json_schema"}), given("json_schema", NOT_NULL),
                               {"properties": {"json_schema": {"type": "null"}}}))

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = Field(None, description=RULES["constraint"])

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(Strict):  # vLLM's: exactly one of them
    model_config = ConfigDict(json_schema_extra={"description": RULES["constraint"]})

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
    # the roles' rules (_roles), by role: a tool turn answers a call with content; an assistant turn has content,
    # calls, a refusal or reasoning; the other turns have content, and no calls or reasoning
    model_config = rules(
        when(given("role", {"const": "tool"}), {"properties": {
            "tool_call_id": {"type": "string"}, "content": NOT_NULL, "tool_calls": ABSENT,
            "reasoning_content": ABSENT}, "required": ["tool_call_id", "content"]}),
        when(given("role", {"const": "assistant"}), {"properties": {"tool_call_id": ABSENT}, "anyOf": [
            given("content", NOT_NULL), given("tool_calls", {"type": "array", "minItems": 1}),
            given("refusal", {"type": "string"}), given("reasoning_content", {"type": "string"})]}),
        when(given("role", {"enum": ["system", "developer", "user"]}), {"properties": {
            "content": NOT_NULL, "tool_calls": ABSENT, "tool_call_id": ABSENT, "reasoning_content": ABSENT},
            "required": ["content"]}))

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None  # None only where an assistant turn calls tools
    name: Optional[str] = Field(None, max_length=256)
    tool_calls: Optional[Annotated[list[ToolCall], Field(max_length=LIMITS["tools"])]] = None
    tool_call_id: Optional[str] = Field(None, max_length=256)  # a tool turn's: the call it answers
    refusal: Optional[str] = None  # an assistant turn's, as OpenAI's clients send it back
    reasoning_content: Optional[str] = None  # vLLM's: an assistant turn's reasoning (reasoning templates read it)
    # what else a reply's message carries when a client appends it as is (`message.model_dump()`), as
    # llama-server takes it: no template reads these (a legacy function_call is refused: send tool_calls)
    annotations: Optional[Annotated[list[dict], Field(max_length=LIMITS["tools"])]] = None
    audio: Optional[dict] = None
    function_call: Literal[None] = None

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to an assistant message")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message answers one call: tool_call_id is required there, and only there")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("reasoning_content belongs to an assistant message")
        if self.content is None and not (self.role == "assistant" and (
                self.tool_calls or self.refusal is not None or self.reasoning_content is not None)):
            raise ValueError("content is required (null only for an assistant message with tool_calls or reasoning)")
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
# apply_chat_template's own arguments, what tk passes itself and the functions transformers gives every
# template, which chat_template_kwargs may not set
TEMPLATE_OWN = ("messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now")
_KWARG = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"  # a template variable's name


def _template_kwargs(kwargs: dict) -> dict:
    if own := [k for k in kwargs if k in TEMPLATE_OWN]:
        raise ValueError(f"{', '.join(own)}: set by tk serve itself, not a template variable")
    return kwargs


TemplateKwargs = Optional[Annotated[  # vLLM's chat_template_kwargs: variables the chat template reads
    dict[Annotated[str, Field(pattern=_KWARG)], Any], Field(max_length=64), AfterValidator(_template_kwargs),
    WithJsonSchema({"type": "object", "maxProperties": 64, "description": RULES["chat_template_kwargs"],
                    "propertyNames": {"pattern": _KWARG, "not": {"enum": list(TEMPLATE_OWN)}}})]]


@dataclass(frozen=True)
class Sizes:
    """What the served model puts in its bodies' schemas: its name (`model`: optional, vLLM's default is
    the one served), its token ids and its context; and the server's choices per request (prompts x n)."""

    model: Any
    token_id: Any
    vocab_size: int
    max_context: int
    max_choices: int

    @classmethod
    def of(cls, model_name: str, vocab_size: int, max_context: int, max_choices: int) -> "Sizes":
        return cls(Optional[Literal[model_name]], Int(ge=0, lt=vocab_size), vocab_size, max_context, max_choices)


def _body(sizes: Sizes):
    """What completions and chat completions share."""
    Budget = Int(ge=1, le=max(1, sizes.max_context - 1))
    vocab_size = sizes.vocab_size
    # keys as digits (the 400 names the key beyond the vocabulary: _bias_keys); documented as the ids' range
    # (propertyNames: pydantic's patternProperties would admit any other key)
    bias_doc = {"type": "object", "propertyNames": {"pattern": below(vocab_size)},
                "maxProperties": LIMITS["logit_bias"],
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}

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
                                       Field(max_length=LIMITS["logit_bias"]), WithJsonSchema(bias_doc)]] = None
        n: Int(ge=1, le=min(LIMITS["n"], sizes.max_choices)) = Field(1, description=RULES["n"])
        stream: bool = False
        stream_options: Optional[StreamOptions] = None
        stop: Stop = None
        # below 2**63 (int64), said as lt: FastAPI's document writes bounds as floats, and 2**63 is one, 2**63 - 1 not
        seed: Optional[Int(ge=0, lt=2**63)] = None
        ignore_eos: bool = False
        speculate: bool = True  # tk's: where the server speculates (tk serve --lookup), false opts this request out
        return_token_ids: bool = False
        user: Optional[str] = Field(None, max_length=256)  # OpenAI's end-user id: recorded nowhere
        response_format: Optional[ResponseFormat] = None
        structured_outputs: Optional[StructuredOutputs] = None
        guided_json: Union[dict, str, None] = Field(None, description=RULES["constraint"])  # vLLM's older names
        guided_regex: Optional[str] = Field(None, description=RULES["constraint"])  # for structured_outputs
        guided_choice: Optional[list[Text]] = Field(None, min_length=1, max_length=LIMITS["prompts"],
                                                    description=RULES["constraint"])
        guided_grammar: Optional[str] = Field(None, description=RULES["constraint"])

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


STREAM_OPTIONS = when(given("stream_options", NOT_NULL), given("stream", {"const": True}))  # _options_need_a_stream


def _completion(body, sizes: Sizes):
    TokenId, max_context = sizes.token_id, sizes.max_context
    prompts = min(LIMITS["prompts"], sizes.max_choices)  # each prompt a choice at least

    class Completion(body):
        model_config = rules(STREAM_OPTIONS)

        prompt: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=prompts)],
                      Annotated[list[TokenId], Field(min_length=1, max_length=max_context)],
                      Annotated[list[Annotated[list[TokenId], Field(min_length=1, max_length=max_context)]],
                                Field(min_length=1, max_length=prompts)]] = Field(description=RULES["prompt"])
        echo: bool = False
        logprobs: Optional[Int(ge=0, le=LIMITS["logprobs"])] = None

    return Completion


def _chat(body):
    class Chat(body):
        model_config = rules(
            STREAM_OPTIONS, when(given("top_logprobs", {"type": "integer", "minimum": 1}),  # _top_needs_logprobs
                                  given("logprobs", {"const": True})),
            when(given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]}),  # calling._agree
                  given("tools", NOT_NULL)))

        messages: Messages = Field(description=RULES["messages"])
        logprobs: bool = False
        top_logprobs: Optional[Int(ge=0, le=LIMITS["logprobs"])] = None
        tools: Tools = Field(None, description=RULES["tools"])
        # OpenAI's default: auto where tools are given, else none
        tool_choice: ToolChoice = Field(None, description=RULES["tool_choice"])
        parallel_tool_calls: bool = True
        chat_template_kwargs: TemplateKwargs = None

        @field_validator("top_logprobs")
        @classmethod
        def _top_needs_logprobs(cls, top, info):
            if top and not info.data.get("logprobs"):
                raise ValueError("top_logprobs needs logprobs: true")
            return top

    return Chat


def _tokenize(sizes: Sizes):
    class Tokenize(Strict):  # vLLM's TokenizeCompletionRequest
        model: sizes.model = None
        prompt: str
        add_special_tokens: bool = True
        return_token_strs: bool = False

    return Tokenize


def _tokenize_chat(sizes: Sizes):
    class TokenizeChat(Strict):  # vLLM's TokenizeChatRequest
        model: sizes.model = None
        messages: Messages
        add_generation_prompt: bool = True
        tools: Tools = None  # rendered by the chat template, as in a chat request
        return_token_strs: bool = False
        chat_template_kwargs: TemplateKwargs = None

    return TokenizeChat


def _detokenize(sizes: Sizes):
    class Detokenize(Strict):
        model: sizes.model = None
        tokens: Annotated[list[sizes.token_id], Field(max_length=sizes.max_context * 4)]

    return Detokenize


def schemas(model_name: str, vocab_size: int, max_context: int, max_choices: int = LIMITS["choices"]) -> Schemas:
    """The bodies of a server of `model_name` taking `max_choices` choices (prompts x n) per request."""
    sizes = Sizes.of(model_name, vocab_size, max_context, max_choices)
    body = _body(sizes)
    return Schemas(_completion(body, sizes), _chat(body), _tokenize(sizes), _tokenize_chat(sizes), _detokenize(sizes),
                   sizes)

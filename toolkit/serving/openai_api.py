"""The OpenAI API's shapes for `tk serve`: request bodies (pydantic), errors, responses and
server-sent-event chunks. No server here (toolkit/serving/openai_server.py); pydantic comes with FastAPI.

Beyond OpenAI's fields, vLLM's names: `top_k`, `repetition_penalty`, `ignore_eos`, and
`return_token_ids` (each choice, and each streamed chunk, then carries its `token_ids`).
"""

from __future__ import annotations

import json
import time
from typing import Literal, Union

from tk.runtimes.base import InputError
from tk.runtimes.rows import FinishReason

FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # as OpenAI's
UNSUPPORTED = {"n": "tk serve returns one choice per request (n=1)",
               "presence_penalty": "not supported; use repetition_penalty",
               "frequency_penalty": "not supported; use repetition_penalty",
               "logprobs": "not supported by tk serve", "echo": "not supported by tk serve"}


class ApiError(Exception):
    """An HTTP error with OpenAI's JSON body; `param` names the request's field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def schemas():
    """(Completion, Chat): the request bodies, OpenAI's fields and vLLM's extras."""
    from pydantic import BaseModel, ConfigDict, Field

    class Body(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: str
        max_tokens: int | None = Field(None, gt=0)
        max_completion_tokens: int | None = Field(None, gt=0)
        temperature: float = Field(1.0, ge=0, le=2)
        top_p: float = Field(1.0, gt=0, le=1)
        n: Literal[1] = 1
        stream: bool = False
        stream_options: dict | None = None
        stop: Union[str, list[str], None] = None
        seed: int | None = Field(None, ge=0)
        presence_penalty: Literal[0, 0.0] = 0
        frequency_penalty: Literal[0, 0.0] = 0
        logprobs: Literal[None, False, 0] = None
        top_k: int = Field(0, ge=-1)  # vLLM: -1 (or 0) is off
        repetition_penalty: float = Field(1.0, gt=0)
        ignore_eos: bool = False
        return_token_ids: bool = False

    class Completion(Body):
        prompt: Union[str, list[int], list[str]]
        echo: Literal[False] = False

    class Message(BaseModel):
        role: str
        content: Union[str, list[dict]]

    class Chat(Body):
        messages: list[Message] = Field(min_length=1)

    return Completion, Chat


def parse(raw: bytes, schema, model_name: str):
    """A request body, or the 400 that names its first bad field."""
    from pydantic import ValidationError

    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        parsed = schema.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        raise ApiError(400, f"{'.'.join(map(str, err['loc']))}: {UNSUPPORTED.get(param, err['msg'])}", param) from None
    if parsed.model != model_name:
        raise ApiError(400, f"model {parsed.model!r} is not served here; this server serves {model_name!r} "
                            "(GET /v1/models)", "model")
    return parsed


def prompt_ids(body, chat: bool, tokenizer) -> list[int]:
    """The prompt's token ids: the chat template over the messages, or the prompt encoded (or given as ids)."""
    try:
        if chat:
            messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                         "".join(p.get("text", "") for p in m.content if p.get("type") == "text")}
                        for m in body.messages]
            return tokenizer.chat_messages(messages)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (send a request for each)", "prompt")
            prompt = prompt[0]
        return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except InputError as e:
        raise ApiError(400, str(e), "messages" if chat else "prompt") from None


class Reply:
    """One request's response objects: the whole completion, or its stream of chunks."""

    def __init__(self, ident: str, model: str, chat: bool, token_ids: bool):
        self.ident, self.model, self.chat, self.token_ids = ident, model, chat, token_ids

    def _envelope(self, chunk: bool, choices: list) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.ident, "object": kind, "created": int(time.time()), "model": self.model, "choices": choices}

    @staticmethod
    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def complete(self, text: str, reason: str, tokens: list[int], usage: dict) -> dict:
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text, "logprobs": None}
        choice = {"index": 0, "finish_reason": FINISH.get(reason, reason), **body}
        if self.token_ids:
            choice["token_ids"] = tokens
        return {**self._envelope(False, [choice]), "usage": usage}

    def role(self) -> str:
        """The first chunk of a chat stream."""
        return sse(self._envelope(True, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None}]))

    def chunk(self, text: str, reason: str | None, tokens: list[int]) -> str:
        body = {"delta": {"content": text} if text else {}} if self.chat else {"text": text, "logprobs": None}
        choice = {"index": 0, "finish_reason": FINISH.get(reason, reason), **body}
        if self.token_ids:
            choice["token_ids"] = tokens
        return sse(self._envelope(True, [choice]))

    def usage_chunk(self, usage: dict) -> str:
        return sse({**self._envelope(True, []), "usage": usage})


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"

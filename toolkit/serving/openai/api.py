"""The OpenAI API's shapes for `tk serve`, apart from the request bodies (the schemas module): errors,
what a body asks of each generation, and the responses and server-sent-event chunks, with
log-probabilities in OpenAI's two shapes (completions: `tokens`/`token_logprobs`/`top_logprobs`/
`text_offset`; chat: `content` entries with `bytes` and `top_logprobs`). No server here
(the server module).

One request may ask for several choices: each prompt of a list, `n` times; choice `i * n + j` is
prompt i's j-th, as vLLM numbers them. Each choice is one batcher request (its own seed stream).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from tk.runtimes.base import InputError
from tk.runtimes.decoding.logits import TokenLogprob
from tk.runtimes.decoding.rows import FinishReason
from tk.runtimes.slots import Slots
from tk.toolkit.serving import frontend

# Caps on what one request may list (each a 400 beyond; the schemas say them): OpenAI's own are lower for `stop` (4).
LIMITS = {"prompts": 1024, "n": 128, "stop": 16, "stop_chars": 512, "messages": 1024, "logit_bias": 1024,
          "choices": 512, "logprobs": 20, "tools": 128}
FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # as OpenAI's
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


class ApiError(Exception):
    """An HTTP error with OpenAI's JSON body; `param` names the request's field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(errors: list[dict], model_name: str) -> ApiError:
    """The 400 for a body pydantic refused: its most telling error, in one line naming the field."""
    if not errors:
        return ApiError(400, "the body is not valid")
    err = next((e for e in errors if not e["type"].endswith("_type") and e["type"] != "literal_error"), errors[0])
    # a union's member is named in the path by its type: a builtin's name, a generic's (`list[int]`), or a
    # model's class (/tokenize's TokenizeChat), CapWords as no field of a body is
    loc = [str(p) for p in err["loc"] if p != "body" and not ("[" in str(p) or str(p).lower() in _TYPE_NAMES
                                                               or str(p)[:1].isupper() and str(p).isidentifier())]
    where, param = ".".join(loc), (loc[0] if loc else None)
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"{where}: tk serve does not implement this field; leave it out", param)
    if param == "model" and err["type"] == "literal_error":
        return ApiError(400, f"model {err['input']!r} is not served here; this server serves {model_name!r} "
                             "(GET /v1/models)", "model", code="model_not_found")
    return ApiError(400, f"{where or 'body'}: {err['msg']}", param)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its ids, and its text where the client sent text (echo returns it)."""

    ids: list[int]
    text: str | None = None


def prompts(body, chat: bool, tokenizer, tools: list[dict] | None = None) -> list[Prompt]:
    """The request's prompts: the chat template over the messages (and the tools the reply may
    call), or each prompt encoded (or given as ids)."""
    try:
        if chat:
            return [Prompt(tokenizer.chat_messages(messages(body.messages), tools=tools,
                                                   template_kwargs=body.chat_template_kwargs))]
        given = body.prompt
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        return [Prompt(tokenizer.encode(p), p) if isinstance(p, str) else Prompt(list(p)) for p in given]
    except InputError as e:
        raise ApiError(400, str(e), "messages" if chat else "prompt") from None


def messages(given) -> list[dict]:
    """Chat messages as the template takes them: text parts joined (no content: ""), an assistant
    turn's tool calls with their arguments as objects (templates write them with `tojson`, as vLLM
    hands them over), its reasoning as `reasoning_content` (what Qwen's templates read) and `thinking`
    (gpt-oss's), a tool turn's call id."""
    out = []
    for m in given:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        message = {"role": m.role, "content": content, **({"name": m.name} if m.name else {})}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if getattr(m, "reasoning_content", None) is not None:
            message["reasoning_content"] = message["thinking"] = m.reasoning_content
        out.append(message)
    return out


def _arguments(text: str):
    """A call's arguments as an object where they are JSON of one (else the text as sent)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def stops(body) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def params(body, chat: bool, prompt_len: int, max_context: int, constraint, special_tokens: bool = False) -> frontend.Params:
    """What the body asks of each of its generations, OpenAI's defaults where it gives none (16 new
    tokens for completions, or fewer where the context has less room; the rest of the context for chat)."""
    room = max(1, max_context - prompt_len)
    budget = body.max_completion_tokens or body.max_tokens or (room if chat else min(16, room))
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = logprobs if body.echo and logprobs is not None else None
    return frontend.Params(
        max_tokens=budget, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        repetition_penalty=body.repetition_penalty, seed=body.seed, ignore_eos=body.ignore_eos, stop=stops(body),
        min_tokens=body.min_tokens, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()}, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, constraint=constraint, speculate=body.speculate, special_tokens=special_tokens)


def echo_problem(body, chat: bool, runtime) -> str | None:
    """Why this runtime cannot score the prompts a body asks to echo with log-probabilities (None: it can)."""
    if chat or not body.echo or body.logprobs is None:
        return None
    return Slots.prompt_logits_problem(runtime)


def max_choices(capacity: int) -> int:
    """The choices (prompts x n) one request may ask of a batcher that holds `capacity` requests (slots and queue)."""
    return min(LIMITS["choices"], capacity)


def choices_problem(count: int, capacity: int) -> str | None:
    cap = max_choices(capacity)
    if count > cap:
        return (f"this request asks for {count} choices (prompts x n); this server takes at most {cap} per request: "
                "send fewer prompts or a smaller n")
    return None


CONTEXT = 4  # tokens before a token that its text is decoded after


@dataclass
class Choice:
    """One choice's state as its events arrive: its text so far, its tokens and their log-probabilities."""

    index: int
    prompt: Prompt
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    scores: list[TokenLogprob] = field(default_factory=list)
    reason: FinishReason | None = None
    offset: int = 0  # characters of text before the next token (completions' text_offset)
    echoed: bool = False  # a stream sent its prompt (echo)
    eos: int | None = None  # the EOS token that ended it, where its log-probability was asked for (not kept)
    calls: int = 0  # tool calls its stream has sent
    parsing: object | None = None  # its reader (reasoning.ReplyStream) where reasoning or tools are read: fed as
    # it streams, or once with the whole text

    def before(self, newest: int = 0) -> list[int]:
        """The CONTEXT tokens before its `newest` last ones (what their texts are read after)."""
        kept = self.tokens[:len(self.tokens) - newest]
        return (self.prompt.ids[-CONTEXT:] + kept[-CONTEXT:])[-CONTEXT:]

    def scored(self) -> list[int]:
        """The tokens its log-probabilities cover: the kept ones, then the EOS that ended it."""
        return [*self.tokens, *([] if self.eos is None else [self.eos])]


class Reply:
    """One request's response objects: the whole completion, or its stream of chunks. A token of
    the log-probabilities is named by its text as it reads after the tokens before it (a window of
    CONTEXT: a SentencePiece token keeps its leading space, a special token reads as ""), so that
    `text_offset` follows the returned text; its alternatives are named the same way."""

    def __init__(self, ident: str, model: str, chat: bool, body, tokenizer, reasoning: bool = False):
        self.ident, self.model, self.chat, self.tokenizer = ident, model, chat, tokenizer
        self.reasoning = reasoning  # the server reads reasoning: messages carry reasoning_content
        self.token_ids, self.echo = body.return_token_ids, (not chat and body.echo)
        self.logprobs = (body.logprobs if chat else body.logprobs is not None)

    def _envelope(self, chunk: bool, choices: list) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.ident, "object": kind, "created": int(time.time()), "model": self.model, "choices": choices}

    @staticmethod
    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # --- log-probabilities ---

    def _named(self, before: Sequence[int], tokens: Sequence[int], scores: Sequence[TokenLogprob | None]):
        """(text, score, {alternative: its text}) of each token, read after the tokens before it."""
        decode, window = self.tokenizer.decode, list(before[-CONTEXT:])
        for token, s in zip(tokens, scores):
            base = decode(window)

            def text(t: int) -> str:
                full = decode([*window, t])
                return full[len(base):] if full.startswith(base) else self.tokenizer.token_text(t)
            yield text(token), s, ({} if s is None else {t: text(t) for t, _ in s.top})
            window = [*window, token][-CONTEXT:]

    def _completion_logprobs(self, c: Choice, before, tokens, scores) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for text, s, names in self._named(before, tokens, scores):
            out["tokens"].append(text)
            out["token_logprobs"].append(None if s is None else s.logprob)
            top = None if s is None else {names[t]: lp for t, lp in s.top}
            if top is not None:
                top.setdefault(text, s.logprob)  # the chosen token always, as vLLM does
            out["top_logprobs"].append(top)
            out["text_offset"].append(c.offset)
            c.offset += len(text)
        return out

    @staticmethod
    def _entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    def _chat_logprobs(self, before, tokens, scores) -> dict:
        return {"content": [{**self._entry(text, s.logprob), "top_logprobs": [self._entry(names[t], lp) for t, lp in s.top]}
                            for text, s, names in self._named(before, tokens, scores)], "refusal": None}

    def _logprobs(self, c: Choice, before, tokens, scores):
        if not self.logprobs or not tokens:
            return None
        if self.chat:
            return self._chat_logprobs(before, tokens, scores)
        return self._completion_logprobs(c, before, tokens, scores)

    def head(self, c: Choice, prompt_scores) -> tuple[str, list, list[int]]:
        """What echo puts before a choice's completion: the prompt's text, scores and ids."""
        if not self.echo:
            return "", [], []
        text = c.prompt.text if c.prompt.text is not None else self.tokenizer.decode(c.prompt.ids)
        return text, (prompt_scores or [None] * len(c.prompt.ids)), c.prompt.ids

    # --- whole responses ---

    def complete(self, choices: list[Choice], prompt_scores: dict[int, list], usage: dict) -> dict:
        out = []
        for c in choices:
            head, head_scores, head_ids = self.head(c, prompt_scores.get(c.index))
            body, called = {"text": head + c.text}, False
            if self.chat:
                reasoning, content, calls = c.parsing.whole(c.text) if c.parsing is not None else (None, c.text, [])
                calls = [call.openai(call_id()) for call in calls]
                body = {"message": {"role": "assistant", "content": content, **(
                    {"reasoning_content": reasoning} if self.reasoning else {}), **({"tool_calls": calls} if calls else {})}}
                called = bool(calls)
            before = [] if self.echo else c.prompt.ids
            lp = self._logprobs(c, before, [*head_ids, *c.scored()], [*head_scores, *c.scores])
            choice = {"index": c.index, **body, "logprobs": lp, "finish_reason": finish(c.reason, called)}
            if self.token_ids:
                choice["token_ids"] = c.tokens
                if self.echo:
                    choice["prompt_token_ids"] = head_ids
            out.append(choice)
        return {**self._envelope(False, out), "usage": usage}

    # --- streams ---

    def role(self, index: int) -> str:
        """The first chunk of a chat choice's stream."""
        return sse(self._envelope(True, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]))

    def chunk(self, c: Choice, text: str, reason: FinishReason | None, before: list[int], tokens: list[int],
              scores: Sequence[TokenLogprob | None], usage: dict | None = None, prompt: bool = False,
              reasoning: str = "") -> str:
        """One chunk of choice `c`: its new text (and reasoning), and its new tokens after the ones `before`
        (with `prompt`, the echoed prompt's; at a finish by EOS, that EOS, scored but not kept)."""
        delta = {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": text} if text else {})}
        body = {"delta": delta} if self.chat else {"text": text}
        choice = {"index": c.index, **body, "logprobs": self._logprobs(c, before, tokens, scores),
                  "finish_reason": None if reason is None else finish(reason, c.calls > 0)}
        if self.token_ids:
            choice["prompt_token_ids" if prompt else "token_ids"] = tokens if reason is None else []
        return sse({**self._envelope(True, [choice]), **({"usage": usage} if usage else {})})

    def text_and_calls(self, c: Choice, piece: str, final: bool) -> tuple[str, str, list[str]]:
        """A streamed chat choice's new text where its reader reads reasoning or tools: its content, held
        back while it may open a call, its reasoning, and the chunks of each call that closed (OpenAI's
        shape: the id, type and name, then the arguments), numbered in the choice's order."""
        if c.parsing is None:
            return piece, "", []
        deltas = c.parsing.feed(piece) + (c.parsing.finish() if final else [])
        text, reasoning, chunks = "", "", []
        for d in deltas:
            if d.reasoning is not None:
                reasoning += d.reasoning
            elif d.call is None:
                text += d.content
            else:
                head = {"index": c.calls, "id": call_id(), "type": "function",
                        "function": {"name": d.call.name, "arguments": ""}}
                chunks += [self._call_chunk(c, head), self._call_chunk(c, {"index": c.calls,
                                                                           "function": {"arguments": d.call.arguments}})]
                c.calls += 1
        return text, reasoning, chunks

    def _call_chunk(self, c: Choice, call: dict) -> str:
        return sse(self._envelope(True, [{"index": c.index, "delta": {"tool_calls": [call]}, "logprobs": None,
                                          "finish_reason": None}]))

    def usage_chunk(self, usage: dict) -> str:
        return sse({**self._envelope(True, []), "usage": usage})


def finish(reason: FinishReason, called: bool) -> str:
    """OpenAI's finish_reason: tool_calls where a reply that ended on its own made calls."""
    return "tool_calls" if called and reason in (FinishReason.EOS, FinishReason.STOP) else FINISH[reason]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's shape: call_ and 24 characters


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"

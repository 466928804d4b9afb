"""What a `/v1/responses` reply says, in OpenAI's Responses shapes (checked against the `openai`
package's `openai.types.responses`): its output items (`message` with `output_text`, `function_call`),
the `response` object, and the stream's events, in OpenAI's order (a reasoning item, where the server
reads reasoning, as a message with `reasoning_text` for `output_text`):

    response.created, response.in_progress,
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta,
                  response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens; response.failed)

`Output` turns a reply's text into items as it arrives, through the request's reader (the reasoning
module's `ReplyStream`: its reasoning, content and calls, markers or bare JSON), so the streamed
items equal the whole reply's by construction: a whole reply is the same text fed at once. A call
arrives whole (the scanner sends it once it closes), so its arguments come in one delta. No server
here (the responses module).
"""

from __future__ import annotations

import copy
import json
import time
import uuid

from tk.toolkit.serving.openai.api import call_id
from tk.toolkit.serving.openai.tools import Delta


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def event_text(event: dict) -> str:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _part(kind: str, text: str) -> dict:
    """A text part of a message (`output_text`) or of a reasoning item (`reasoning_text`)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []} if kind == "message" else \
        {"type": "reasoning_text", "text": text}


# by item: its id's prefix, its first fields, and the name of its text's delta and done events
_ITEMS = {"message": ("msg", {"type": "message", "role": "assistant"}, "output_text"),
          "reasoning": ("rs", {"type": "reasoning", "summary": []}, "reasoning_text")}


class Output:
    """One response's output items as its text arrives: `feed(piece, final)` -> the stream's events
    for it (without sequence numbers); `items` holds what is written so far. `parsing`: the request's
    reader (reasoning.ReplyStream: reasoning, content and calls, the first call only where
    parallel_tool_calls is false; None: the text is the message)."""

    def __init__(self, parsing):
        self.parsing = parsing
        self.items: list[dict] = []
        self.open: dict | None = None  # the message or reasoning item being written

    def feed(self, piece: str, final: bool, incomplete: bool = False) -> list[dict]:
        """The events of `piece` (and, `final`, of the reply's end; `incomplete`: cut by its budget)."""
        if self.parsing is None:
            deltas = [Delta(content=piece)] if piece else []
        else:
            deltas = self.parsing.feed(piece) + (self.parsing.finish() if final else [])
        events = []
        for d in deltas:
            if d.call is not None:
                events += self._close() + self._call(d.call)
            else:
                events += self._text("reasoning" if d.reasoning is not None else "message", d.reasoning or d.content)
        return events + (self._close("incomplete" if incomplete else "completed") if final else [])

    def _text(self, kind: str, text: str) -> list[dict]:
        events = [] if self.open is None or self.open["type"] == kind else self._close()
        prefix, fields, name = _ITEMS[kind]
        if self.open is None:
            self.open = {"id": new_id(prefix), **fields, "status": "in_progress", "content": []}
            self.items.append(self.open)
            events += [self._at({"type": "response.output_item.added", "item": {**self.open, "content": []}}),
                       self._at({"type": "response.content_part.added", "item_id": self.open["id"],
                                 "content_index": 0, "part": _part(kind, "")})]
            self.open["content"].append(_part(kind, ""))
        self.open["content"][0]["text"] += text
        logprobs = {"logprobs": []} if kind == "message" else {}
        return events + [self._at({"type": f"response.{name}.delta", "item_id": self.open["id"], "content_index": 0,
                                   "delta": text, **logprobs})]

    def _close(self, status: str = "completed") -> list[dict]:
        """The open item's end, if one is open."""
        m, self.open = self.open, None
        if m is None:
            return []
        m["status"] = status
        part, at, name = m["content"][0], len(self.items) - 1, _ITEMS[m["type"]][2]
        logprobs = {"logprobs": []} if m["type"] == "message" else {}
        return [{"type": f"response.{name}.done", "item_id": m["id"], "output_index": at, "content_index": 0,
                 "text": part["text"], **logprobs},
                {"type": "response.content_part.done", "item_id": m["id"], "output_index": at, "content_index": 0,
                 "part": dict(part)},
                {"type": "response.output_item.done", "output_index": at, "item": copy.deepcopy(m)}]

    def _call(self, call) -> list[dict]:
        item = {"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": call_id(),
                "name": call.name, "arguments": call.arguments}
        self.items.append(item)
        at, ident = len(self.items) - 1, item["id"]
        return [{"type": "response.output_item.added", "output_index": at,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", "item_id": ident, "output_index": at,
                 "delta": call.arguments},
                {"type": "response.function_call_arguments.done", "item_id": ident, "output_index": at,
                 "name": call.name, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": at, "item": dict(item)}]

    def _at(self, event: dict) -> dict:
        """An event of the newest item (its output index)."""
        return {**event, "output_index": len(self.items) - 1}


def usage(prompt: int, completion: int, reasoning: int = 0) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def response(ident: str, model: str, body, *, status: str, output: list[dict], usage: dict | None,
             created: float, error: dict | None = None) -> dict:
    """The `response` object: its status, output and usage, and the request's settings echoed."""
    from tk.toolkit.serving.openai.responses_schemas import dump

    choice = body.tool_choice
    return {
        "id": ident, "object": "response", "created_at": created, "model": model, "status": status,
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": dump(choice) if choice is not None and not isinstance(choice, str) else (choice or "auto"),
        "tools": [dump(t) for t in body.tools or []],
        "text": {"format": dump(body.text.format) if body.text and body.text.format else {"type": "text"}},
        "truncation": "disabled", "store": body.store, "metadata": body.metadata or {}, "user": body.user,
        "background": False, "usage": usage,
    }

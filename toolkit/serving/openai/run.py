"""One HTTP request of `tk serve` in flight: its choices (each prompt, `n` times) as batcher jobs
whose events reach the event loop on one queue, tagged with the choice's index, and their state as
the events arrive (the api module's Choice), until all have finished (`collect`; streamed:
`chat_events`) or the request is cancelled (by the server, or by a client that went away).
"""

from __future__ import annotations

import asyncio

from tk.runtimes.decoding.rows import FinishReason
from tk.toolkit.serving import frontend
from tk.toolkit.serving.openai import api
from tk.toolkit.serving.openai.api import ApiError


class HttpJob(frontend.Job):
    """One choice of an HTTP request: its events go to the request's queue on the event loop, with
    the choice's index."""

    def __init__(self, batcher, prompt: list[int], params: frontend.Params, *, tokenizer, metrics, loop, queue,
                 index: int, choice: int):
        super().__init__(batcher, prompt, params, tokenizer=tokenizer, metrics=metrics, choice=choice)
        self.loop, self.queue, self.index = loop, queue, index

    def deliver(self, piece, event) -> None:  # the batcher's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, piece, event))


class Run:
    """One HTTP request's choices in flight: their jobs, their state as events arrive (`take`), and
    what ends them (all finished, or `cancel`)."""

    def __init__(self, jobs: list[HttpJob], choices: list[api.Choice], queue, prompt_tokens: int):
        self.jobs, self.choices, self.queue, self.prompt_tokens = jobs, choices, queue, prompt_tokens
        self.pending = len(jobs)

    def take(self, index: int, piece: str, event) -> None:
        c = self.choices[index]
        c.text += piece
        if event.token is None:
            c.reason = event.finish_reason
            self.pending -= 1
            if event.logprob is not None:  # the EOS that ended it, scored
                c.eos = event.logprob.token
                c.scores.append(event.logprob)
        else:
            c.tokens.append(event.token)
            if event.logprob is not None:
                c.scores.append(event.logprob)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    def usage(self) -> dict:
        return api.Reply.usage(self.prompt_tokens, sum(len(c.tokens) for c in self.choices))

    def prompt_scores(self) -> dict[int, list]:
        return {job.index: job.request.prompt_scores for job in self.jobs}

    def failure(self, index: int) -> ApiError:
        """A choice that did not complete: 503 when the server stopped it, 500 when it failed."""
        request = self.jobs[index].request
        if self.choices[index].reason == FinishReason.CANCELLED:
            return ApiError(503, "the server is shutting down; retry on another replica", kind="server_error")
        return ApiError(500, f"the batcher failed this request: {request.error}", kind="server_error")

    def raise_failure(self) -> None:
        for c in self.choices:
            if not c.reason.completed:
                raise self.failure(c.index)

    async def chat_events(self, reply: api.Reply, options, watch):
        """The server-sent events of a streamed completion or chat completion (`reply`'s chunks), until
        every choice finishes (then [DONE]) or one fails; `watch` (cancel_when_gone) ends with it."""
        usage_at_end = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage_stats
        try:
            if reply.chat:
                for c in self.choices:
                    yield reply.role(c.index)
            while self.pending:
                index, piece, event = await self.queue.get()
                c = self.choices[index]
                if reply.echo and not c.echoed:  # before its first event: the prompt's scores are in
                    head, scores, ids = reply.head(c, self.jobs[index].request.prompt_scores)
                    c.echoed = True
                    yield reply.chunk(c, head, None, [], ids, scores, prompt=True)
                self.take(index, piece, event)
                if event.token is None and not event.finish_reason.completed:
                    yield api.sse(self.failure(index).body())
                    self.cancel()
                    break
                usage = self.usage() if continuous else None
                text, reasoning, calls = reply.text_and_calls(c, piece, event.token is None)
                if reasoning and calls:  # the reasoning before the calls it led to
                    yield reply.chunk(c, "", None, [], [], [], reasoning=reasoning)
                    reasoning = ""
                for chunk in calls:
                    yield chunk
                if event.token is None:
                    eos = [] if c.eos is None else [c.eos]
                    yield reply.chunk(c, text, event.finish_reason, c.before(), eos, c.scores[-1:] if eos
                                      else [], usage, reasoning=reasoning)
                elif text or reasoning or reply.token_ids or reply.logprobs:
                    yield reply.chunk(c, text, None, c.before(1), [event.token], [event.logprob], usage,
                                      reasoning=reasoning)
            else:
                if usage_at_end:
                    yield reply.usage_chunk(self.usage())
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream (or the stream ended): its slots are freed
            watch.cancel()
            self.cancel()

    async def collect(self, http) -> bool:
        """Take every event until all choices finish: True; False (each cancelled) where the client of
        `http` (a request whose body was read) went away, as nobody is left to answer."""
        gone = asyncio.ensure_future(disconnected(http))
        try:
            while self.pending:
                getter = asyncio.ensure_future(self.queue.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    self.cancel()
                    return False
                self.take(*getter.result())
        except asyncio.CancelledError:  # the server stops (uvicorn cancels its handlers): so do the choices
            self.cancel()
            raise
        finally:
            gone.cancel()
        return True

    async def cancel_when_gone(self, http) -> None:
        """Cancel the choices when the client of `http` goes away (a stream's watch)."""
        await disconnected(http)
        self.cancel()


async def disconnected(request) -> None:
    """Returns when the client of a request whose body was read disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

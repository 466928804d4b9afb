"""Structured outputs: a request's text held to a grammar while it decodes, by a token mask in its
own sampler (runtimes/decoding/logits.py's processors), under continuous batching: each request has its own
matcher and masks its own logits row, so a grammar never touches another request's row.

The grammars are llguidance's (guidance-ai; the engine vLLM's `guidance` backend runs): OpenAI's
`response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar` in llguidance's Lark dialect, `json_object`) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. llguidance over xgrammar: it computes each
mask on the fly from the grammar (no compile step per schema, so 64 requests with 64 different
schemas cost nothing up front), it works on numpy (xgrammar's masks are torch tensors), and its
JSON-schema coverage is the wider. JSON is compact (no free whitespace): a free-whitespace grammar
lets a weak model emit blanks until its token budget runs out, which is never valid JSON.

A tool call's grammar (`tool_choice` required or named: the calling module's) ends where the model
ends: once a call has closed, the grammar would admit EOS or another call, and masking alone would
turn a model that means to stop (or to write prose, which no grammar here admits) into one more
forced call. So from a call's close until the text opens another (its first non-blank token), the
model's own draw decides (`Grammar`): where it is a token the grammar cannot take, the reply ends
there. Every call written stays whole and valid; a second one begins only when the model opens it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Sequence

import numpy as np

from tk.runtimes.decoding.sampling import NO_TOKEN, Sampler, SamplingConfig
from tk.toolkit.serving.openai.api import ApiError

MISSING = "structured outputs need llguidance: pip install 'tk[serve]'"
JSON_OPTIONS = {"whitespace_flexible": False}


def _one_line(message: str) -> str:
    return re.sub(r"\s+", " ", message.split("<state>")[0]).strip()


def requested(body) -> tuple[str, str, object] | None:
    """The body's one constraint: (field, kind, spec) with kind json, json_object, regex, choice or
    grammar; None when it asks for none; a 400 when it asks for more than one."""
    found = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", None))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format", "json", rf.json_schema.schema_))
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]
        given += [("json_object", None)] if so.json_object else []
        found += [("structured_outputs", kind, spec) for kind, spec in given]
    found += [(f"guided_{kind}", kind, spec) for kind, spec in (("json", body.guided_json), ("regex", body.guided_regex),
                                                                ("choice", body.guided_choice),
                                                                ("grammar", body.guided_grammar)) if spec is not None]
    if len(found) > 1:
        raise ApiError(400, f"{', '.join(f for f, _, _ in found)}: give one constraint per request", found[1][0])
    return found[0] if found else None


class Compiler:
    """Turns a body's constraint into a `Grammar` factory, checked up front (a bad schema, regex or
    grammar is a 400 naming the field). llguidance's tokenizer is built on first use, on a worker
    thread (about a second for a large vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self._llg_tokenizer, self._lock = None, threading.Lock()

    def _llg(self):
        try:
            import llguidance
        except ImportError:
            raise ApiError(400, MISSING, kind="invalid_request_error") from None
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = self._make_tokenizer(llguidance)
        return llguidance, self._llg_tokenizer

    def _make_tokenizer(self, llguidance):
        folder = self.tokenizer.folder
        if (folder / "tokenizer.json").is_file():
            return llguidance.LLTokenizer((folder / "tokenizer.json").read_text(), n_vocab=self.vocab_size,
                                          eos_token=self.eos_ids)
        from llguidance.hf import from_tokenizer

        return from_tokenizer(self.tokenizer.hf, n_vocab=self.vocab_size, eos_token=self.eos_ids)

    def compile(self, body, tool_grammar: str | None = None) -> "Constraint | None":
        """The body's constraint, or `tool_grammar` (a required or named tool call's, in llguidance's
        Lark dialect: the calling module's), which admits no other."""
        found = requested(body)
        if tool_grammar is not None:
            if found is not None:
                raise ApiError(400, f"{found[0]}: a required or named tool call (tool_choice) runs under a grammar of "
                                    "its own; leave this constraint out", found[0])
            found = ("tool_choice", "grammar", tool_grammar)
        if found is None:
            return None
        field, kind, spec = found
        if not self.eos_ids:
            raise ApiError(400, f"{field}: structured outputs need the model's EOS token, and this artifact names none")
        llg, tok = self._llg()
        try:
            if kind == "json" and isinstance(spec, str):
                spec = json.loads(spec)
            if kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            elif kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = llg.grammar_from("choice", spec)
            else:
                grammar = llg.LLMatcher.grammar_from_lark(spec)
            limits = llg.LLParserLimits(verbose_errors=False)
            failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=limits)
        except Exception as e:  # noqa: BLE001: a client's schema may be nested too deep to build (RecursionError, ...)
            failed, messages = True, [f"{type(e).__name__}: {e}"]
        if failed:
            raise ApiError(400, f"{field}: not a valid {kind.replace('_', ' ')} constraint: "
                                f"{_one_line(messages[0]) if messages else 'refused'}", field)
        return Constraint(llg, tok, grammar, self.vocab_size, model_ends=field == "tool_choice")


class Constraint:
    """A compiled grammar; `start(sampling)` gives one generation its own `Grammar` (frontend.Constraint).
    `model_ends`: the model's own draws may end the reply between calls (a tool call's grammar)."""

    def __init__(self, llg, tokenizer, grammar: str, vocab_size: int, model_ends: bool = False):
        self.llg, self.tokenizer, self.grammar, self.vocab_size = llg, tokenizer, grammar, vocab_size
        self.model_ends = model_ends

    def start(self, sampling: SamplingConfig | None = None) -> "Grammar":
        return Grammar(self, sampling if self.model_ends else None)


def own_draws(sampling: SamplingConfig) -> Sampler:
    """A sampler that draws as the request's does (greedy, or its temperature, top-k and top-p), from
    a stream of its own derived from the request's seed: the model's own choice, before a mask. (The
    repetition penalty is left out: it needs the prompt's tokens, and it only reorders near-ties.)"""
    seed = int(np.random.SeedSequence([sampling.seed, 1]).generate_state(1, np.uint64)[0]) >> 1
    return Sampler(dataclasses.replace(sampling, repetition_penalty=1.0, seed=seed))


class Grammar:
    """One generation's matcher, as a logits processor: it feeds the matcher the tokens kept since
    its last call, then bans every token the grammar forbids next (a new array: the raw logits stay
    what log-probabilities are computed from). `complete(tokens)`: nothing may follow but EOS.

    With `sampling` (a tool call's grammar), between calls (`between`: the grammar has accepted, and
    no non-blank token has followed) the model's own draw from the logits it is given comes first:
    where the grammar cannot take it, every token is banned, so the row draws NO_TOKEN and ends with
    its text as it is. The request's sampler then draws from the masked logits only when the model's
    own draw was a token the grammar takes, so a reply ends exactly as often as the model leaves the
    format, greedy or sampled."""

    def __init__(self, c: Constraint, sampling: SamplingConfig | None = None):
        from llguidance.numpy import allocate_token_bitmask

        self.matcher = c.llg.LLMatcher(c.tokenizer, c.grammar, log_level=0,
                                       limits=c.llg.LLParserLimits(verbose_errors=False))
        self.bits = allocate_token_bitmask(1, c.vocab_size)
        self.vocab_size, self.fed, self.tokenizer = c.vocab_size, 0, c.tokenizer
        self.own = own_draws(sampling) if sampling is not None else None
        self.between = False  # a call has closed, and nothing of another is written yet

    def _feed(self, tokens: Sequence[int]) -> None:
        for token in tokens[self.fed:]:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}: {_one_line(self.matcher.get_error())}")
            if self.matcher.is_accepting():
                self.between = True
            elif self.between and self.tokenizer.decode_bytes([token]).strip():
                self.between = False  # the model opened another call: the grammar holds it to a whole one
        self.fed = len(tokens)

    def __call__(self, logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask

        self._feed(tokens)
        fill_next_token_bitmask(self.matcher, self.bits)
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
        if self.between and self.own is not None:
            own = int(self.own(logits)[0])
            if own == NO_TOKEN or own >= self.vocab_size or not allowed[own]:  # the model leaves the format
                return np.full_like(logits, -np.inf, dtype=np.float32)
        return np.where(allowed[None, : logits.shape[-1]], logits, np.float32(-np.inf))

    def complete(self, tokens: Sequence[int]) -> bool:
        self._feed(tokens)
        return self.matcher.is_stopped()

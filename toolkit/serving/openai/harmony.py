"""gpt-oss's replies in harmony, read as text for `tk serve --reasoning-parser openai_gptoss` (vLLM's
name): each message a header, `<|message|>`, a body and an end (`<|end|>`, `<|call|>`, `<|return|>`,
or the reply's end: gpt-oss's EOS tokens are `<|return|>` and `<|call|>`, which never reach the
text). A header is what its template writes after `<|start|>assistant` (the generation prompt):
`<|channel|>analysis`, `<|channel|>final`, `<|channel|>commentary to=functions.NAME <|constrain|>json`
(a call), or the recipient first, `to=functions.NAME<|channel|>commentary json`, as the template
renders past calls.

`HarmonyStream` turns the text, as it arrives, into the analysis channel's text (reasoning, streamed),
the final channel's and any other message's text (content, streamed), and each call message, whole,
in one form, `<|channel|>commentary to=NAME <|constrain|>json<|message|>ARGS<|call|>`, which the
tool_formats module's `openai` format reads into a call (so `tool_choice`, the request's functions
and a malformed call staying content are tool calling's own rules). Text that does not begin with a
header (a model that writes plain text) is content as written. What openai-harmony's
`StreamableParser` makes of the same reply (over gpt-oss's o200k_harmony token ids, which tk's text
path does not have for other tokenizers) is checked against this in tests/test_reasoning.py.
"""

from __future__ import annotations

import re

from tk.toolkit.serving.openai.tools import Delta, Trim, held

HEADS = ("<|start|>", "<|channel|>", " to=", "<|constrain|>")  # what a header begins with
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # a message's end
OPENS = "<|start|>"  # the next message's beginning, which also ends one left open
MESSAGE = "<|message|>"
MAX_HEADER = 256  # characters: a longer "header" is text
TOKENS = ("<|start|>", "<|channel|>", "<|constrain|>", MESSAGE, *ENDS)  # the special tokens the text must keep
_CHANNEL, _RECIPIENT = re.compile(r"<\|channel\|>\s*([^\s<]+)"), re.compile(r"(?:^|\s|>)to=([^\s<]+)")


class HarmonyStream:
    """One reply's harmony messages as its text arrives (module doc): `feed(piece, final)` -> deltas of
    reasoning and of the rest (content, and call messages for the tool format)."""

    def __init__(self, prompt_tail: str = ""):
        self.text, self.header, self.channel, self.recipient = "", True, None, None
        self.trim = Trim()  # reasoning, as strip() leaves it
        self.skip = 0  # characters of the header read so far that are the prompt's
        start = prompt_tail.rfind(OPENS)
        if start >= 0:  # the prompt opened the reply's first message (its role, a header, ...)
            self.feed(prompt_tail[start:], False)
            self.skip = len(self.text)

    def feed(self, piece: str, final: bool) -> list[Delta]:
        self.text += piece
        out: list[Delta] = []
        while self.text or final:
            if not (self._header(final, out) if self.header else self._body(final, out)):
                return out
            if final and not self.text:
                return out
        return out

    def _header(self, final: bool, out: list[Delta]) -> bool:
        """Read a header once it is whole (True: go on). Text that cannot begin one is a body of no
        channel: content as written."""
        at = self.text.find(MESSAGE)
        head = self.text[:at] if at >= 0 else self.text
        inner = head[len(OPENS):] if head.startswith(OPENS) else head
        clean = len(head) <= MAX_HEADER and not any(e in inner for e in (*ENDS, OPENS))
        lead = head[self.skip:]  # the reply's own part
        if clean and (not lead or lead.startswith(HEADS) or at < 0 and any(h.startswith(lead) for h in HEADS)):
            if at >= 0:
                channel, recipient = _CHANNEL.search(head), _RECIPIENT.search(head)
                self.channel, self.recipient = channel and channel.group(1), recipient and recipient.group(1)
                self.text, self.header, self.skip = self.text[at + len(MESSAGE):], False, 0
                return True
            if not final:
                return False  # wait for the header's end
        self.header, self.channel, self.recipient = False, None, None
        self.text, self.skip = self.text[self.skip:], 0  # (the prompt's part is not the reply's)
        if self.text.startswith(OPENS):  # (a body reads up to the next one)
            out.append(Delta(content=OPENS))
            self.text = self.text[len(OPENS):]
        return True

    def _body(self, final: bool, out: list[Delta]) -> bool:
        """Hand out the body read so far; at its end, go back to headers (True: go on)."""
        ends = [(i, e) for i, e in ((self.text.find(e), e) for e in (*ENDS, OPENS)) if i >= 0]
        at, end = min(ends) if ends else (None, None)
        if at is None:
            if self.recipient is not None and not final:
                return False  # a call is handed over whole
            at = len(self.text) if final else held(self.text, (*ENDS, OPENS), False)
        body, self.text = self.text[:at], self.text[at + (len(end) if end in ENDS else 0):]
        if self.recipient is not None:
            if end is not None or final:
                out.append(Delta(content=f"<|channel|>commentary to={self.recipient} <|constrain|>json"
                                         f"{MESSAGE}{body}<|call|>"))
        elif self.channel == "analysis":
            if kept := self.trim(body):
                out.append(Delta(reasoning=kept))
        elif body:
            out.append(Delta(content=body))
        if end is not None:
            self.header, self.channel, self.recipient = True, None, None
        return end is not None

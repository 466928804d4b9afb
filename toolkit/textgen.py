"""Text in, text out around the backend-agnostic loop: tokenizer loading, chat templates, and an
incremental detokenizer that streaming and stop strings consume token by token (each new token
decodes a short window, not the whole text so far). This is where tokenization lives; the loop
knows none.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Callable, Sequence

from tk.models.spec.manifest import ArtifactError
from tk.runtimes.base import InputError, Runtime
from tk.runtimes.decoding.generate import Generation, GenerationResult
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.runtimes.decoding.speculative import Speculation

_HF_LOCK = threading.Lock()


class Tokenizer:
    """tokenizer.json through `tokenizers` (fast, light); other formats through transformers."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        self.folder, self._hf = folder, None  # _hf: transformers' tokenizer, for chat templates
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as _Tok

            tok = _Tok.from_file(str(folder / "tokenizer.json"))
            self._encode = lambda text, special: tok.encode(text, add_special_tokens=special).ids
            self._decode = lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)
            self.vocab = lambda: tok.get_vocab(with_added_tokens=True)
        elif any((folder / f).is_file() for f in ("tokenizer.model", "vocab.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(folder))
            self._encode = lambda text, special: tok.encode(text, add_special_tokens=special)
            self._decode = lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)
            self.vocab = tok.get_vocab  # token -> id, added tokens included
        else:
            raise ArtifactError(f"{folder} has no tokenizer files; pass --prompt-ids instead of --prompt")

    @classmethod
    def find(cls, folder: Path) -> "Tokenizer | None":
        """The folder's tokenizer, or None where it has none."""
        try:
            return cls(folder)
        except ArtifactError:
            return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, add_special_tokens)

    def chat(self, message: str, system: str | None = None) -> list[int]:
        """The prompt ids of one user turn (after a system turn, if given), ready for the reply."""
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": message}]
        return self.chat_messages(messages)

    @property
    def hf(self):
        """transformers' tokenizer of the folder (chat templates, grammars), loaded on first use:
        a server loads it at start (`tk serve`), so that no request waits for it."""
        with _HF_LOCK:  # transformers' lazy imports are not safe from two threads at once
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(self.folder))
        return self._hf

    def chat_messages(self, messages: list[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of a conversation as the checkpoint's chat template renders it, ready for
        the assistant's reply: transformers' apply_chat_template with add_generation_prompt (and the
        tools the reply may call, as OpenAI's tool dicts, and the variables the template reads,
        `template_kwargs`: `enable_thinking`, ...), from chat_template.jinja or tokenizer_config.json."""
        if not self.hf.chat_template:
            raise InputError(f"{self.folder} has no chat template (no chat_template.jinja, and no chat_template in "
                             "tokenizer_config.json): it is not an instruction-tuned checkpoint; use --prompt")
        from jinja2 import TemplateError

        try:
            return list(self._hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=False,
                                                     **({"tools": tools} if tools else {}), **(template_kwargs or {})))
        except TemplateError as e:  # the template's own raise_exception: roles out of order, say
            raise InputError(f"the chat template refused these messages: {e}") from None
        except (TypeError, KeyError, AttributeError, ValueError) as e:  # a template that reads a field a turn lacks
            raise InputError(f"the chat template could not render these messages ({type(e).__name__}: {e})") from None

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model the tools it may call (a probe tool's name
        appears in the rendered prompt), as llama.cpp's server asks of a template before it takes `tools`."""
        probe = {"type": "function", "function": {"name": "tk_probe_tool", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.hf.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
                                               add_generation_prompt=True)
        except Exception:  # noqa: BLE001: a template that fails on tools does not render them
            return False
        return isinstance(text, str) and "tk_probe_tool" in text

    def info(self, max_context: int) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's class and settings (tokenizer_config.json's), the
        special tokens, the chat template and the context."""
        import json

        config = self.folder / "tokenizer_config.json"
        settings = json.loads(config.read_text()) if config.is_file() else {}
        settings.pop("added_tokens_decoder", None)  # hundreds of entries: /tokenize names any token
        hf = self.hf
        return {**settings, "tokenizer_class": type(hf).__name__, "model_max_length": max_context,
                "vocab_size": len(hf), "eos_token": hf.eos_token, "bos_token": hf.bos_token,
                "pad_token": hf.pad_token, "chat_template": hf.chat_template}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(list(ids), skip_special_tokens)

    @functools.lru_cache(maxsize=65536)
    def token_text(self, token: int) -> str:
        """One token's text as log-probabilities name it: its decode alone, special tokens included."""
        return self._decode([token], False)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise InputError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    return ids  # an empty one is refused with the rest of a row's checks (runtimes/rows.RowPolicy.check)


def stop_at(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Cut `text` at the first stop string; report whether one was found."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


class TextStream:
    """One row's text as its tokens arrive (vLLM's incremental detokenization): each token decodes
    the tokens since the last complete piece, so a row of n tokens costs O(n), not O(n^2). Holds back
    an incomplete UTF-8 sequence, and whatever could still become a stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (), special_tokens: bool = False):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.skip = not special_tokens  # special tokens are left out of the text unless asked for
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # tokens[prefix:read] decode to the text's last complete piece
        self.text = ""  # decoded so far
        self.shown = 0  # characters of `text` handed out
        self.stopped = False

    def add(self, token: int, check_stops: bool = True) -> str:
        """The new text this token makes safe to show ("" while it is pending); sets `stopped` when a
        stop string appears (the text is then cut before it), unless `check_stops` is off."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix : self.read])
        now = self._decode(self.tokens[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        hold = max((len(s) for s in self.stops), default=1) - 1
        if self.stops and check_stops:
            window = self.text[max(0, self.shown - hold):]
            cut, found = stop_at(window, self.stops)
            if found:
                self.text, self.stopped = self.text[: max(0, self.shown - hold)] + cut, True
                return self._take(len(self.text))
        return self._take(len(self.text) - hold if self.stops else len(self.text))

    def finish(self) -> str:
        """Everything not yet shown (at the end of the row)."""
        if not self.stopped:
            rest = self._decode(self.tokens[self.prefix :])
            self.text += rest[len(self._decode(self.tokens[self.prefix : self.read])):]
            self.text = stop_at(self.text, self.stops)[0]
        return self._take(len(self.text))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip)

    def _take(self, upto: int) -> str:
        out = self.text[self.shown : max(upto, self.shown)]
        self.shown += len(out)
        return out


def generate_text(runtime: Runtime, tokenizer: Tokenizer | None, prompts: list[list[int]], max_new_tokens: int,
                  sampling: SamplingConfig, eos_ids: Sequence[int], stops: Sequence[str] = (),
                  ignore_eos: bool = False, stream: Callable[[str], None] | None = None,
                  speculation: Speculation | None = None, processors=None) -> tuple[GenerationResult, list[str]]:
    """Generate and detokenize. `stream` receives the new text of a single prompt as it arrives;
    `speculation`: a proposer's guesses verified a run at a time (the same tokens, greedy);
    `processors(row)`: a row's logits processors (penalties, logit bias, a grammar)."""
    if stops and tokenizer is None:
        raise InputError("--stop needs the artifact's tokenizer to read the generated text")
    texts = [TextStream(tokenizer, stops) for _ in prompts] if tokenizer else None
    show = stream if stream and texts and len(prompts) == 1 else None
    with runtime:
        gen = Generation(runtime, prompts, max_new_tokens, sampling, eos_ids, ignore_eos, speculation, processors)
        for event in gen:
            if texts is None:
                continue
            text = texts[event.row]
            piece = text.add(event.token) if event.token is not None else text.finish()
            if event.token is not None and text.stopped:
                gen.stop(event.row)
            if show and piece:
                show(piece)
    return gen.result, [t.text for t in texts] if texts else [""] * len(prompts)

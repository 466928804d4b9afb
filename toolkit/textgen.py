"""Text in, text out around the backend-agnostic loop: tokenizer loading, backend selection from an
artifact, stop strings and streaming. This is where tokenization lives; the loop knows none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from runtimes.base import ArtifactError, InputError, Runtime, read_manifest
from runtimes.generate import GenerationResult, generate
from runtimes.sampling import SamplingConfig

BACKENDS = ("torch", "ort", "trt")


class Tokenizer:
    """tokenizer.json through `tokenizers` (fast, light); other formats through transformers."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        self.folder = folder
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as _Tok

            tok = _Tok.from_file(str(folder / "tokenizer.json"))
            self._encode = lambda text: tok.encode(text).ids
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        elif any((folder / f).is_file() for f in ("tokenizer.model", "vocab.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(folder))
            self._encode = lambda text: tok.encode(text)
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        else:
            raise ArtifactError(f"{folder} has no tokenizer files; pass --prompt-ids instead of --prompt")

    @classmethod
    def find(cls, folder: Path) -> "Tokenizer | None":
        """The folder's tokenizer, or None where it has none."""
        try:
            return cls(folder)
        except ArtifactError:
            return None

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def chat(self, message: str, system: str | None = None) -> list[int]:
        """The prompt ids of one user turn (after a system turn, if given) as the checkpoint's chat
        template renders them, ready for the assistant's reply: transformers' apply_chat_template
        with add_generation_prompt, from chat_template.jinja or tokenizer_config.json."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.folder))
        if not tok.chat_template:
            raise InputError(f"{self.folder} has no chat template (no chat_template.jinja, and no chat_template in "
                             "tokenizer_config.json): it is not an instruction-tuned checkpoint; use --prompt")
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": message}]
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))


def open_runtime(artifact: Path, backend: str, threads: int | None = None, device: str = "auto") -> Runtime:
    """A runtime for `backend` over the artifact (not yet activated)."""
    manifest = read_manifest(artifact)
    if backend == "torch":
        from toolkit.artifact import reference_runtime

        return reference_runtime(artifact, manifest, dtype=manifest["dtype"], device=device)
    if backend == "ort":
        from runtimes.ort_runtime import open_ort

        return open_ort(artifact, threads=threads)
    if backend == "trt":
        from runtimes.trt_runtime import TrtRuntime

        return TrtRuntime(artifact)
    raise InputError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise InputError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise InputError("empty prompt: --prompt-ids needs at least one id")
    return ids


def stop_at(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Cut `text` at the first stop string; report whether one was found."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


class _Streamer:
    """Prints row 0's text as it grows, holding back an incomplete UTF-8 sequence or a stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], out: Callable[[str], None]):
        self.tokenizer, self.stops, self.out = tokenizer, stops, out
        self.tokens: list[int] = []
        self.shown = ""

    def __call__(self, row: int, token: int) -> None:
        if row == 0:
            self.tokens.append(token)
            self.flush(stop_at(self.tokenizer.decode(self.tokens), self.stops)[0])

    def flush(self, text: str, final: bool = False) -> None:
        """Show what `text` adds; an incomplete UTF-8 sequence at its end waits for more, unless final."""
        if len(text) > len(self.shown) and text.startswith(self.shown) and (final or not text.endswith("\ufffd")):
            self.out(text[len(self.shown):])
            self.shown = text


def generate_text(runtime: Runtime, tokenizer: Tokenizer | None, prompts: list[list[int]], max_new_tokens: int,
                  sampling: SamplingConfig, eos_ids: Sequence[int], stops: Sequence[str] = (),
                  ignore_eos: bool = False, stream: Callable[[str], None] | None = None
                  ) -> tuple[GenerationResult, list[str]]:
    """Generate and detokenize. `stream` receives the new text of a single prompt as it arrives."""
    if stops and tokenizer is None:
        raise InputError("--stop needs the artifact's tokenizer to read the generated text")
    stop = (lambda row, tokens: stop_at(tokenizer.decode(tokens), stops)[1]) if stops else None
    streamer = _Streamer(tokenizer, stops, stream) if stream and tokenizer and len(prompts) == 1 else None
    with runtime:
        result = generate(runtime, prompts, max_new_tokens, sampling, eos_ids, ignore_eos, stop, streamer)
    texts = [stop_at(tokenizer.decode(r.tokens), stops)[0] if tokenizer else "" for r in result.rows]
    if streamer is not None:
        streamer.flush(texts[0], final=True)
    return result, texts

"""Inside Triton: the decoupled python model's work, over the same engine as `tk serve`.

`execute()` only turns each Triton request into a `tk.runtimes.batching.Request` and submits it;
the engine's thread runs continuous batching (the pattern of Triton's vLLM backend, which
FACTS.md measured at 3x Triton's own iterative sequence batching) and sends each token as a
response through the request's response sender (`stream` true), or one response at the end.
The last response carries `finish_reason` and the FINAL flag. A request Triton reports
cancelled (a client that went away) is cancelled in the engine, which frees its slot. A bad
request gets one error response with a one-line message.

Inputs (all optional but one of `text_input`, `prompt_ids`): text_input (string), prompt_ids
(int64[-1]), max_tokens (int32, default 32 as `tk generate`), temperature, top_p,
repetition_penalty (fp32), top_k (int32), seed (int64), stop (string[-1]), ignore_eos, stream
(bool). Outputs: text_output (string), token_ids (int64[-1]), finish_reason (string, "" until the
last response). `pb` is triton_python_backend_utils, passed in: this module imports no Triton.
The engine's gauges and counters (tk_active_slots, tk_queue_depth, tk_generation_tokens,
tk_requests_finished by reason) appear on Triton's own metrics endpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from tk.models.artifact import Manifest
from tk.models.errors import TkError
from tk.runtimes.batching import FINISH_REASONS, Engine, Request
from tk.runtimes.sampling import SamplingConfig
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.textgen import TextStream, Tokenizer

log = logging.getLogger("tk.triton")
FINISHED = ("eos", "stop", "length")
DEFAULTS = {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "seed": 0,
            "ignore_eos": False, "stream": False}


class TkModel:
    def __init__(self, pb, params: dict[str, str], model_dir: str, name: str = "tk"):
        self.pb = pb
        artifact = Path(params["artifact"])
        artifact = artifact if artifact.is_absolute() else Path(model_dir) / artifact
        manifest = Manifest.read(artifact)
        self.tokenizer = Tokenizer.find(artifact)
        threads = int(params["threads"]) if params.get("threads") else None
        options = BackendOptions(threads=threads, prepack=params.get("prepack", "1") == "1", static_cache=True)
        runtime = open_runtime(artifact, params.get("backend", "ort"), options)
        self.engine = Engine(runtime, int(params["slots"]), int(params["max_queue"]), manifest.eos_token_ids).start()
        self.drain_s = float(params.get("drain", "10"))
        self.metrics = _Metrics(pb, name)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except (TkError, ValueError, UnicodeDecodeError) as e:  # the client's mistake: one line, to it
                sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(str(e).splitlines()[0])),
                            flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.metrics.update(self.engine)
        return None

    def finalize(self) -> None:
        self.engine.close(timeout=self.drain_s)
        self.metrics.close()

    def _value(self, request, name: str):
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            return DEFAULTS.get(name)
        array = tensor.as_numpy().reshape(-1)
        if array.dtype == object:  # TYPE_STRING: bytes
            return [v.decode() if isinstance(v, bytes) else str(v) for v in array]
        if name == "prompt_ids":
            return array.astype(np.int64).tolist()
        if array.size != 1:
            raise ValueError(f"input {name} takes one value, got {array.size}")
        return array.item()

    def _submit(self, request, sender) -> None:
        text, ids = self._value(request, "text_input"), self._value(request, "prompt_ids")
        if (text is None) == (ids is None):
            raise ValueError("give one of the inputs text_input or prompt_ids")
        if text is not None:
            if self.tokenizer is None:
                raise ValueError("this artifact has no tokenizer; send prompt_ids")
            ids = self.tokenizer.encode(text[0])
        get = lambda name: self._value(request, name)  # noqa: E731
        stops = get("stop") or []
        if stops and self.tokenizer is None:
            raise ValueError("stop needs the artifact's tokenizer")
        sampling = SamplingConfig(temperature=float(get("temperature")), top_k=int(get("top_k")),
                                  top_p=float(get("top_p")), repetition_penalty=float(get("repetition_penalty")),
                                  seed=int(get("seed")))
        job = _Job(self, sender, stops, bool(get("stream")))
        job.request = Request(ids, int(get("max_tokens")), sampling, bool(get("ignore_eos")), job.on_event,
                              lambda _: job.text is not None and job.text.stopped)
        self.engine.submit(job.request)


@dataclasses.dataclass(eq=False)
class _Job:
    model: TkModel
    sender: object
    stops: list[str]
    stream: bool
    request: Request | None = None

    def __post_init__(self):
        tok = self.model.tokenizer
        self.text = TextStream(tok, self.stops) if tok is not None else None

    def on_event(self, event) -> None:  # the engine's thread
        pb, final = self.model.pb, event.token is None
        if final:
            self.model.metrics.finished(self.model.engine, event.finish_reason, len(self.request.tokens))
        if not final and self.sender.is_cancelled():
            self.model.engine.cancel(self.request)
            return
        if final and event.finish_reason not in FINISHED:
            message = self.request.error or f"the request was {event.finish_reason}"
            return self._send(pb.InferenceResponse(error=pb.TritonError(message)), True)
        if not final:
            piece = self.text.add(event.token) if self.text else ""
            if self.stream:
                self._send(self._response(piece, [event.token], ""), False)
            return
        rest = self.text.finish() if self.text else ""
        if self.stream:
            self._send(self._response(rest, [], event.finish_reason), True)
        else:
            self._send(self._response(self.text.text if self.text else "", self.request.tokens,
                                      event.finish_reason), True)

    def _response(self, text: str, tokens: list[int], reason: str):
        pb = self.model.pb
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("text_output", np.array([text.encode()], dtype=object)),
            pb.Tensor("token_ids", np.array(tokens, dtype=np.int64)),
            pb.Tensor("finish_reason", np.array([reason.encode()], dtype=object))])

    def _send(self, response, final: bool) -> None:
        flags = self.model.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            self.sender.send(response, flags=flags)
        except Exception:  # noqa: BLE001: the client is gone; its request ends with the next event
            log.warning("could not send a response for request %s", self.request.id, exc_info=True)
            if not final:
                self.model.engine.cancel(self.request)


class _Metrics:
    """The engine's gauges and counters on Triton's metrics endpoint (the python backend's custom
    metrics), labelled with the model's name; updated when requests arrive and finish."""

    def __init__(self, pb, model: str):
        family = getattr(pb, "MetricFamily", None)  # Triton 23.05+
        self.on = family is not None
        if not self.on:
            return
        labels = {"model": model}
        gauge, counter = family.GAUGE, family.COUNTER
        self.families = {name: family(name=name, description=what, kind=kind) for name, what, kind in [
            ("tk_active_slots", "Slots running a request", gauge), ("tk_queue_depth", "Requests waiting for a slot", gauge),
            ("tk_generation_tokens", "Tokens generated", counter),
            ("tk_requests_finished", "Generations by finish reason", counter)]}  # kept: a metric outlives no family
        metric = lambda name, **extra: self.families[name].Metric(labels={**labels, **extra})  # noqa: E731
        self.active, self.queue, self.tokens = metric("tk_active_slots"), metric("tk_queue_depth"), metric(
            "tk_generation_tokens")
        self.reasons = {r: metric("tk_requests_finished", reason=r) for r in FINISH_REASONS}

    def update(self, engine: Engine) -> None:
        if self.on:
            self.active.set(engine.running)
            self.queue.set(engine.waiting)

    def close(self) -> None:
        """Metrics first, then their families (Triton refuses the other order)."""
        if self.on:
            self.active = self.queue = self.tokens = None
            self.reasons.clear()
            self.families.clear()
            self.on = False

    def finished(self, engine: Engine, reason: str, tokens: int) -> None:
        if self.on:
            self.reasons[reason].increment(1)
            self.tokens.increment(tokens)
            self.update(engine)

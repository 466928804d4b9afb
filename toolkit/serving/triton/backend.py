"""Inside Triton: the decoupled python model's work, over the same batcher as `tk serve`.

`execute()` only turns each Triton request into a job (toolkit/serving/frontend.py: its batcher
`Request`, its text and stop strings) and submits it; the batcher's thread runs continuous
batching (the pattern of Triton's vLLM backend, measured at 3x the throughput of Triton's own
iterative sequence batching) and sends each token as a response through the request's response
sender (`stream` true), or one response at the end. The last response carries `finish_reason`
and the FINAL flag. A request Triton reports cancelled (a client that went away) is cancelled in
the batcher, which frees its slot. A bad request gets one error response with a one-line message.

Inputs (all optional but one of `text_input`, `prompt_ids`): text_input (string), prompt_ids
(int64[-1]), max_tokens (int32, default 32 as `tk generate`), temperature, top_p,
repetition_penalty (fp32), top_k (int32), seed (int64), stop (string[-1]), ignore_eos, stream
(bool). Outputs: text_output (string), token_ids (int64[-1]), finish_reason (string, "" until the
last response). A client's mistake (an input missing or malformed, a prompt that does not fit) is
an InputError, and any TkError gets the error response; anything else is a bug, and stays one. `pb`
is triton_python_backend_utils, passed in: this module imports no Triton.
The batcher's gauges and counters (tk_active_slots, tk_queue_depth, tk_generation_tokens,
tk_requests_finished by reason) appear on Triton's own metrics endpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tk.models.spec.manifest import Manifest
from tk.models.spec.errors import TkError
from tk.runtimes.errors import InputError
from tk.runtimes.serving.batching import Batcher, BatcherLimits
from tk.runtimes.decoding.rows import FinishReason
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.serving import frontend
from tk.toolkit.serving.frontend import METRICS
from tk.toolkit.textgen import Tokenizer

log = logging.getLogger("tk.triton")
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
        options = BackendOptions(threads=threads, prepack=params.get("prepack", "1") == "1", static_cache=True,
                                 quant_compute=params.get("quant_compute", "int8"))
        runtime = open_runtime(artifact, params.get("backend", "ort"), options)
        limits = BatcherLimits(slots=int(params["slots"]), max_queue=int(params["max_queue"]))
        self.batcher = Batcher(runtime, limits=limits, eos_ids=manifest.eos_token_ids).start()
        self.drain_s = float(params.get("drain", "10"))
        self.metrics = _TritonMetrics(pb, name, self.batcher)

    def execute(self, requests):
        with self.batcher.arriving():  # an idle batcher's first step waits for all of them (a burst)
            self._execute(requests)

    def _execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except TkError as e:  # the client's mistake: one line, to it
                sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(str(e).splitlines()[0])),
                            flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.metrics.update()
        return None

    def finalize(self) -> None:
        self.batcher.close(timeout=self.drain_s)
        self.metrics.close()

    def _value(self, request, name: str):
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            return DEFAULTS.get(name)
        array = tensor.as_numpy().reshape(-1)
        if array.dtype == object:  # TYPE_STRING: bytes
            try:
                return [v.decode() if isinstance(v, bytes) else str(v) for v in array]
            except UnicodeDecodeError as e:
                raise InputError(str(e)) from None
        if name == "prompt_ids":
            return array.astype(np.int64).tolist()
        if array.size != 1:
            raise InputError(f"input {name} takes one value, got {array.size}")
        return array.item()

    def _submit(self, request, sender) -> None:
        text, ids = self._value(request, "text_input"), self._value(request, "prompt_ids")
        if (text is None) == (ids is None):
            raise InputError("give one of the inputs text_input or prompt_ids")
        if text is not None:
            if self.tokenizer is None:
                raise InputError("this artifact has no tokenizer; send prompt_ids")
            ids = self.tokenizer.encode(text[0])
        get = lambda name: self._value(request, name)  # noqa: E731
        params = frontend.Params(max_tokens=int(get("max_tokens")), temperature=float(get("temperature")),
                                 top_k=int(get("top_k")), top_p=float(get("top_p")),
                                 repetition_penalty=float(get("repetition_penalty")), seed=int(get("seed")),
                                 ignore_eos=bool(get("ignore_eos")), stop=get("stop") or [])
        _TritonJob(self, sender, ids, params, bool(get("stream"))).submit()


class _TritonJob(frontend.Job):
    """One Triton request's generation: its pieces of text leave as responses through its sender."""

    def __init__(self, model: TkModel, sender, prompt: list[int], params: frontend.Params, stream: bool):
        super().__init__(model.batcher, prompt, params, tokenizer=model.tokenizer, metrics=model.metrics)
        self.pb, self.sender, self.stream = model.pb, sender, stream

    def listening(self) -> bool:
        return not self.sender.is_cancelled()

    def deliver(self, piece: str, event) -> None:  # the batcher's thread
        pb, reason = self.pb, event.finish_reason
        if event.token is not None:
            if self.stream:
                self._send(self._response(piece, [event.token], ""), False)
        elif not reason.completed:
            self._send(pb.InferenceResponse(error=pb.TritonError(self.request.error or f"the request was {reason}")),
                       True)
        elif self.stream:
            self._send(self._response(piece, [], reason), True)
        else:
            self._send(self._response(self.text.text if self.text else "", self.request.tokens, reason), True)

    def _response(self, text: str, tokens: list[int], reason: str):
        pb = self.pb
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("text_output", np.array([text.encode()], dtype=object)),
            pb.Tensor("token_ids", np.array(tokens, dtype=np.int64)),
            pb.Tensor("finish_reason", np.array([reason.encode()], dtype=object))])

    def _send(self, response, final: bool) -> None:
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            self.sender.send(response, flags=flags)
        except Exception:  # noqa: BLE001: the client is gone; its request ends with the next event
            log.warning("could not send a response for request %s", self.request.id, exc_info=True)
            if not final:
                self.cancel()


class _TritonMetrics(frontend.Metrics):
    """The batcher's gauges and counters on Triton's metrics endpoint (the python backend's custom
    metrics; frontend.METRICS' names), labelled with the model's name; updated when requests
    arrive and finish (each update is a message to Triton's process: not one per token)."""

    def __init__(self, pb, model: str, batcher: Batcher):
        self.batcher = batcher
        family = getattr(pb, "MetricFamily", None)  # Triton 23.05+
        self.on = family is not None
        if not self.on:
            return
        labels = {"model": model}
        gauge, counter = family.GAUGE, family.COUNTER
        self.families = {name: family(name=name, description=METRICS[name], kind=kind) for name, kind in [
            ("tk_active_slots", gauge), ("tk_queue_depth", gauge), ("tk_generation_tokens", counter),
            ("tk_requests_finished", counter)]}  # kept: a metric outlives no family
        metric = lambda name, **extra: self.families[name].Metric(labels={**labels, **extra})  # noqa: E731
        self.active, self.queue, self.tokens = metric("tk_active_slots"), metric("tk_queue_depth"), metric(
            "tk_generation_tokens")
        self.reasons = {r: metric("tk_requests_finished", reason=r.value) for r in FinishReason}

    def update(self) -> None:
        if self.on:
            self.active.set(self.batcher.running)
            self.queue.set(self.batcher.waiting)

    def close(self) -> None:
        """Metrics first, then their families (Triton refuses the other order)."""
        if self.on:
            self.active = self.queue = self.tokens = None
            self.reasons.clear()
            self.families.clear()
            self.on = False

    def finished(self, reason: FinishReason, tokens: int) -> None:
        if self.on:
            self.reasons[reason].increment(1)
            self.tokens.increment(tokens)
            self.update()

"""tk triton: the model repository, served by the tritonserver that nvidia-pytriton bundles (CPU,
127.0.0.1), streamed over gRPC with Triton's own client and over the generate/SSE endpoint."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tk.models.spec.manifest import Manifest
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.cli.main import main
from tk.toolkit.textgen import Tokenizer, generate_text

pytestmark = pytest.mark.slow
PROMPTS = ["the cat", "a mat and then it ran", "owls", "the dark wood where owls sing and the cat sat on a mat",
           "far away", "then", "it ran far", "sing"]


def _write(artifact, out, *flags):
    result = CliRunner().invoke(main, ["triton", str(artifact), "-o", str(out), *flags])
    assert result.exit_code == 0, result.output
    return out


def _options_of(params: dict, model_dir: Path, monkeypatch) -> BackendOptions:
    """The BackendOptions the repository's python model opens its runtime with, from its parameters."""
    from tk.toolkit.serving.triton import backend

    class Opened(Exception):
        pass

    def opened(artifact, name, options):
        raise Opened(options)

    monkeypatch.setattr(backend, "open_runtime", opened)
    with pytest.raises(Opened) as e:
        backend.TkModel(None, params, str(model_dir))
    return e.value.args[0]


def test_every_config_is_valid_for_triton_and_limits_are_recorded(serve_artifact, tmp_path, monkeypatch):
    text_format = pytest.importorskip("google.protobuf.text_format", reason="protobuf (a tritonclient dependency)")
    pb = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient: pip install -e '.[triton]'")
    repo = _write(serve_artifact, tmp_path / "repo", "--model-name", "tiny", "--slots", "3", "--native",
                  "--copy-artifact", "--quant-compute", "float")
    configs = {p.parent.name: text_format.Parse(p.read_text(), pb.ModelConfig()) for p in repo.glob("*/config.pbtxt")}
    assert sorted(configs) == ["tiny", "tiny_decode", "tiny_prefill"]
    tiny = configs["tiny"]
    assert tiny.backend == "python" and tiny.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in tiny.parameters.items()}
    assert params["slots"] == "3" and params["max_context"] == "128" and params["artifact"] == "artifact"
    assert params["quant_compute"] == "float" and params["prepack"] == "1"
    assert _options_of(params, repo / "tiny" / "1", monkeypatch) == BackendOptions(
        prepack=True, static_cache=True, quant_compute="float")  # what the model's batcher runs with
    assert Manifest.read(repo / "tiny" / "1" / "artifact").dims.kv_capacity == 128
    assert configs["tiny_prefill"].platform == "onnxruntime_onnx"
    assert (repo / "tiny_decode" / "1" / "model.onnx").is_file() and (repo / "tiny_decode" / "1" / "weights.onnx.data").is_file()
    again = CliRunner().invoke(main, ["triton", str(serve_artifact), "-o", str(repo)])
    assert again.exit_code == 2 and "--force" in again.output
    assert not list(tmp_path.glob(".tk-triton-*"))  # nothing half-written left behind


def _slots(repo: Path) -> str:
    return re.search(r'key: "slots" value: \{ string_value: "(\d+)" \}', (repo / "tiny" / "config.pbtxt").read_text())[1]


def test_force_replaces_a_repository_whole_or_not_at_all(serve_artifact, tmp_path, monkeypatch):
    from tk.toolkit.serving.triton import repo as triton_repo

    repo = _write(serve_artifact, tmp_path / "repo", "--model-name", "tiny", "--slots", "3")
    (repo / "tiny" / "stale.txt").write_text("from the old repository")
    _write(serve_artifact, repo, "--model-name", "tiny", "--slots", "2", "--force")
    assert _slots(repo) == "2" and not (repo / "tiny" / "stale.txt").exists()
    monkeypatch.setattr(triton_repo, "python_config", lambda *a: 1 / 0)  # a failure half way through writing
    failed = CliRunner().invoke(main, ["triton", str(serve_artifact), "-o", str(repo), "--model-name", "tiny",
                                       "--slots", "4", "--force"])
    assert isinstance(failed.exception, ZeroDivisionError)
    assert _slots(repo) == "2" and (repo / "tiny" / "1" / "model.py").is_file()  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no temporary or set-aside folder left


class _Sender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append((response.error, flags))


class _Request(dict):
    """A Triton request: its inputs by name (numpy arrays) and its response sender."""

    def __init__(self, **inputs):
        super().__init__(inputs)
        self.sender = _Sender()

    def get_response_sender(self):
        return self.sender


def _model(tokenizer):
    """The Triton model's request handling, without a runtime: a pb of its own, no batcher submitted to."""
    from types import SimpleNamespace

    from tk.toolkit.serving.triton.backend import TkModel

    tensor = lambda array: SimpleNamespace(as_numpy=lambda: array)  # noqa: E731
    pb = SimpleNamespace(InferenceResponse=lambda error=None, output_tensors=None: SimpleNamespace(error=error),
                         TritonError=str, TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
                         get_input_tensor_by_name=lambda request, name: (tensor(request[name]) if name in request
                                                                         else None))
    model = TkModel.__new__(TkModel)
    model.pb, model.tokenizer, model.metrics = pb, tokenizer, SimpleNamespace(update=lambda: None)
    model.batcher = SimpleNamespace(arriving=contextlib.nullcontext)  # (reached only to say requests are arriving)
    return model


def test_a_clients_mistake_gets_an_error_response_and_a_bug_stays_a_bug():
    from types import SimpleNamespace

    text = np.array([b"the cat"], dtype=object)
    for request, words in [(_Request(), "give one of the inputs text_input or prompt_ids"),
                           (_Request(text_input=text), "this artifact has no tokenizer; send prompt_ids"),
                           (_Request(text_input=np.array([b"\xff"], dtype=object)), "can't decode byte 0xff"),
                           (_Request(prompt_ids=np.array([1]), max_tokens=np.array([4, 5])), "takes one value")]:
        _model(None).execute([request])
        [(error, flags)] = request.sender.sent
        assert words in error and flags == 1
    broken = SimpleNamespace(encode=lambda text: int(text))  # a plain ValueError inside tk is a bug, not a 4xx
    request = _Request(text_input=text)
    with pytest.raises(ValueError, match="invalid literal"):
        _model(broken).execute([request])
    assert request.sender.sent == []


def test_a_dynamic_cache_artifact_is_refused(tiny_artifact, tmp_path):
    result = CliRunner().invoke(main, ["triton", str(tiny_artifact), "-o", str(tmp_path / "repo")])
    assert result.exit_code == 2 and "--for serve" in result.output and not (tmp_path / "repo").exists()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def tritonserver(serve_artifact, tmp_path_factory):
    """The bundled tritonserver over a `tk triton` repository, every endpoint on 127.0.0.1."""
    pytriton = pytest.importorskip("pytriton", reason="nvidia-pytriton (bundles tritonserver): pip install -e '.[triton]'")
    pytest.importorskip("tritonclient.grpc", reason="tritonclient: pip install -e '.[triton]'")
    root = tmp_path_factory.mktemp("triton")
    repo = _write(serve_artifact, root / "repo", "--model-name", "tiny", "--slots", "4")
    server = Path(pytriton.__file__).parent / "tritonserver"
    backends = root / "backends" / "python"  # the python backend, with the stub for this Python (FACTS.md)
    shutil.copytree(server / "backends" / "python", backends)
    shutil.copy2(server / "python_backend_stubs" / "3.11" / "triton_python_backend_stub", backends)
    libs = [sysconfig.get_config_var("LIBDIR"), str(server.parents[1] / "nvidia_pytriton.libs")]
    http, grpc, metrics = _free_ports(3)
    log = open(root / "tritonserver.log", "w")
    proc = subprocess.Popen(
        [str(server / "bin" / "tritonserver"), "--model-repository", str(repo), "--backend-directory",
         str(root / "backends"), "--http-address", "127.0.0.1", "--http-port", str(http), "--grpc-address",
         "127.0.0.1", "--grpc-port", str(grpc), "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics)],
        stdout=log, stderr=subprocess.STDOUT,
        # the stub's embedded Python finds its prefix through PATH: this venv's, whose numpy < 2 the
        # stub's bindings need (the base interpreter may have numpy 2), activated or not
        env={**os.environ, "LD_LIBRARY_PATH": ":".join(libs),
             "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])})
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/tiny/ready", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        else:
            pytest.fail(f"tritonserver did not get ready: {(root / 'tritonserver.log').read_text()[-3000:]}")
        yield http, grpc, metrics
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


@pytest.fixture(scope="module")
def solo(serve_artifact):
    manifest, tok = Manifest.read(serve_artifact), Tokenizer(serve_artifact)
    runtime = open_runtime(serve_artifact, "ort", BackendOptions(static_cache=True))

    def run(text, n, sampling=SamplingConfig()):
        result, texts = generate_text(runtime, tok, [tok.encode(text)], n, sampling, manifest.eos_token_ids)
        return result.rows[0].tokens, texts[0]

    return run


def _inputs(grpcclient, text: str, n: int, seed: int | None = None):
    values = [("text_input", np.array([text.encode()], dtype=object), "BYTES"),
              ("max_tokens", np.array([n], dtype=np.int32), "INT32"), ("stream", np.array([True]), "BOOL")]
    if seed is not None:
        values += [("temperature", np.array([0.8], dtype=np.float32), "FP32"),
                   ("seed", np.array([seed], dtype=np.int64), "INT64")]
    out = []
    for name, array, kind in values:
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def test_concurrent_grpc_streams_get_their_solo_tokens(tritonserver, solo):
    import tritonclient.grpc as grpcclient

    _, grpc, _ = tritonserver
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    budgets = {str(i): 4 + 5 * i for i in range(len(PROMPTS))}
    for i, text in enumerate(PROMPTS):  # all in flight at once, over 4 slots
        client.async_stream_infer("tiny", _inputs(grpcclient, text, budgets[str(i)], seed=i if i % 3 == 2 else None),
                                  request_id=str(i))
    tokens = {k: [] for k in budgets}
    texts = {k: "" for k in budgets}
    open_ = set(budgets)
    deadline = time.monotonic() + 60
    while open_ and time.monotonic() < deadline:
        result, error = results.get(timeout=30)
        assert error is None, error
        rid = result.get_response().id
        tokens[rid] += result.as_numpy("token_ids").tolist()
        texts[rid] += result.as_numpy("text_output")[0].decode()
        if result.as_numpy("finish_reason")[0]:
            open_.discard(rid)
    client.stop_stream()
    assert not open_
    for i, text in enumerate(PROMPTS):
        sampling = SamplingConfig(temperature=0.8, seed=i) if i % 3 == 2 else SamplingConfig()
        assert (tokens[str(i)], texts[str(i)]) == solo(text, budgets[str(i)], sampling), f"request {i}"


def test_the_generate_stream_endpoint_and_bad_requests(tritonserver, solo):
    http, _, _ = tritonserver
    url = f"http://127.0.0.1:{http}/v2/models/tiny"
    body = json.dumps({"text_input": "the cat", "max_tokens": 9, "stream": True}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/generate_stream", body), timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    got = [t for e in events for t in (e["token_ids"] if isinstance(e["token_ids"], list) else [e["token_ids"]])]
    assert (got, "".join(e["text_output"] for e in events)) == solo("the cat", 9)
    assert events[-1]["finish_reason"] == "length"
    for bad, words in [({"max_tokens": 4}, "text_input or prompt_ids"),
                       ({"text_input": "the cat " * 100, "max_tokens": 4}, "exceeds the model's context")]:
        req = urllib.request.Request(url + "/generate", json.dumps(bad).encode())
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert words in err.value.read().decode()
    assert urllib.request.urlopen(url + "/ready", timeout=5).status == 200  # still up


def _metric(metrics_port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") and ",".join(sorted(line[len(name) + 1:line.index("}")].split(","))) == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_cancelled_stream_frees_its_slot(tritonserver):
    import tritonclient.grpc as grpcclient

    _, grpc, metrics = tritonserver
    before = _metric(metrics, "tk_requests_finished", model="tiny", reason="cancelled")
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = _inputs(grpcclient, "the", 125)
    ignore = grpcclient.InferInput("ignore_eos", [1], "BOOL")
    ignore.set_data_from_numpy(np.array([True]))
    client.async_stream_infer("tiny", inputs + [ignore], request_id="long")
    assert results.get(timeout=30)[1] is None  # its first token came
    client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metric(metrics, "tk_requests_finished", model="tiny", reason="cancelled") == before:
        time.sleep(0.1)
    assert _metric(metrics, "tk_requests_finished", model="tiny", reason="cancelled") == before + 1
    assert _metric(metrics, "tk_active_slots", model="tiny") == 0

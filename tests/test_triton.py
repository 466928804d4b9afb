"""tk triton: the model repository, served by the tritonserver that nvidia-pytriton bundles (CPU,
127.0.0.1), streamed over gRPC with Triton's own client and over the generate/SSE endpoint."""

from __future__ import annotations

import json
import os
import queue
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


def test_every_config_is_valid_for_triton_and_limits_are_recorded(serve_artifact, tmp_path):
    text_format = pytest.importorskip("google.protobuf.text_format", reason="protobuf (a tritonclient dependency)")
    pb = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient: pip install -e '.[triton]'")
    repo = _write(serve_artifact, tmp_path / "repo", "--model-name", "tiny", "--slots", "3", "--native",
                  "--copy-artifact")
    configs = {p.parent.name: text_format.Parse(p.read_text(), pb.ModelConfig()) for p in repo.glob("*/config.pbtxt")}
    assert sorted(configs) == ["tiny", "tiny_decode", "tiny_prefill"]
    tiny = configs["tiny"]
    assert tiny.backend == "python" and tiny.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in tiny.parameters.items()}
    assert params["slots"] == "3" and params["max_context"] == "128" and params["artifact"] == "artifact"
    assert Manifest.read(repo / "tiny" / "1" / "artifact").dims.kv_capacity == 128
    assert configs["tiny_prefill"].platform == "onnxruntime_onnx"
    assert (repo / "tiny_decode" / "1" / "model.onnx").is_file() and (repo / "tiny_decode" / "1" / "weights.onnx.data").is_file()
    again = CliRunner().invoke(main, ["triton", str(serve_artifact), "-o", str(repo)])
    assert again.exit_code == 2 and "--force" in again.output
    assert not list(tmp_path.glob(".tk-triton-*"))  # nothing half-written left behind


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

"""`tk serve` and `tk triton`: the serving commands (tk.toolkit.cli.main adds them to its group).
Option parsing only; the OpenAI server's process module and the Triton repository writer do the work."""

from __future__ import annotations

from pathlib import Path

import click

from tk.toolkit.backends import BackendOptions
from tk.toolkit.cli.options import (BackendName, backend_options, progress, quant_compute_option, speculation_from,
                                   speculation_options)
from tk.toolkit.serving.openai.reasoning import PARSERS as REASONING
from tk.toolkit.serving.openai.tool_formats import PARSERS


def batcher_options(f):
    """--slots, --max-queue: the continuous batcher's limits."""
    f = click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
                     help="Requests that may wait for a slot; beyond it requests are refused (HTTP 429).")(f)
    return click.option("--slots", default=8, show_default=True, type=click.IntRange(min=1),
                        help="Requests decoded together (rows of the static cache).")(f)


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--backend", default="ort", show_default=True, type=BackendName())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0: any free port.")
@batcher_options
@click.option("--model-name", help="The `model` clients send [default: the artifact folder's name].")
@click.option("--drain", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds in-flight requests get to finish at shutdown before they are cancelled.")
@click.option("--api-key", envvar="TK_API_KEY", help="Require `Authorization: Bearer KEY` on every endpoint but "
                                                     "/health and the API's documentation, /docs and /openapi.json "
                                                     "(also from $TK_API_KEY).")
@click.option("--max-body-bytes", default=8 * 2**20, show_default=True, type=click.IntRange(min=1024),
              help="Larger request bodies are refused (HTTP 413).")
@click.option("--step-tokens", type=click.IntRange(min=1),
              help="Tokens a step computes while requests decode (vLLM's --max-num-batched-tokens): a decode token "
                   "for each first, then chunks of the prompts coming in [default: the decode tokens, and for "
                   "the prompts 16 each or what computes in the step's own measured run time, whichever is "
                   "more; a step where nothing decodes takes up to 512 each].")
@click.option("--prefix-cache-mib", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Host memory for cached prompt prefixes (their keys and values); least recently used go first.")
@click.option("--no-prefix-cache", is_flag=True, help="Prefill every prompt whole: reuse no cached prefix.")
@backend_options(prepack=True)
@speculation_options
@click.option("--speculate-max-rows", type=click.IntRange(min=1),
              help="With --lookup or --draft: guess only while at most this many requests decode (vLLM's "
                   "disable_by_batch_size) [default: no cap: each step guesses where the runs' measured cost says "
                   "it gains, within --step-tokens].")
@click.option("--tool-call-parser", type=click.Choice(list(PARSERS)),
              help="How the model writes tool calls (vLLM's names) [default: what the chat template teaches: "
                   "<tool_call> is hermes, [TOOL_CALLS] mistral, <|tool_call|> granite, <|python_tag|> llama3_json].")
@click.option("--bare-tool-calls/--no-bare-tool-calls", default=None,
              help="Under tool_choice auto, read a reply that is nothing but a JSON call of one of the tools (valid "
                   "against its schema), without the format's tags, as that call [default: on for hermes and granite, "
                   "whose models write calls so].")
@click.option("--reasoning-parser", type=click.Choice([*REASONING, "none"]),
              help="How the model writes its reasoning, returned as reasoning_content apart from content (vLLM's "
                   "names) [default: what the chat template shows: <|channel|> is openai_gptoss, <think> qwen3 "
                   "(deepseek_r1 with DeepSeek's); none: read no reasoning].")
@click.option("--enable-auto-tool-choice", is_flag=True, hidden=True,
              help="vLLM's flag, accepted so that its command lines run: tk answers tool_choice auto whenever the "
                   "format is known.")
@click.pass_context
def serve(ctx: click.Context, artifact: Path, backend: str, host: str, port: int, slots: int, max_queue: int,
          model_name: str | None, drain: float, api_key: str | None, max_body_bytes: int, step_tokens: int | None,
          prefix_cache_mib: int, no_prefix_cache: bool, options: BackendOptions, speculate_max_rows: int | None,
          tool_call_parser: str | None, bare_tool_calls: bool | None, reasoning_parser: str | None,
          enable_auto_tool_choice: bool) -> None:
    """Serve an ARTIFACT (static cache) over the OpenAI API, with continuous batching.

    \b
    Agents (tool calling): send `tools` to /v1/chat/completions and read `tool_calls`; the model's
    own chat template renders the tools, and tool_choice auto, required, none or a named function
    work as OpenAI's do (required and named run under a grammar, so their arguments always
    validate). An agent's loop, with the openai client:
      tools = [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
      reply = client.chat.completions.create(model=M, messages=msgs, tools=tools)
      call = reply.choices[0].message.tool_calls[0]        # finish_reason "tool_calls"
      msgs += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
      answer = client.chat.completions.create(model=M, messages=msgs, tools=tools)
    The Responses API (/v1/responses: the Agents SDK's default model) takes the same tools, as
    `input` items; a required call ends where the model ends, and under auto a reply that is
    nothing but a JSON call of a tool (hermes, granite) is that call (--no-bare-tool-calls: not).
    A reasoning model's thinking (Qwen3's <think>, gpt-oss's analysis channel) comes back as
    reasoning_content (--reasoning-parser); chat_template_kwargs (enable_thinking, ...) reach the template.
    """
    from tk.runtimes.errors import InputError
    from tk.runtimes.serving.scheduler import BatcherLimits
    from tk.toolkit.serving.openai.process import ServeOptions, open_server, run

    try:
        limits = BatcherLimits(slots=slots, max_queue=max_queue, step_tokens=step_tokens,
                               prefix_cache_bytes=0 if no_prefix_cache else prefix_cache_mib * 2**20)
    except InputError as e:  # (--slots and --max-queue are checked by click)
        raise click.BadParameter(str(e), param_hint="--step-tokens") from None

    speculation = speculation_from(ctx, max_rows=speculate_max_rows)
    if host not in LOOPBACK:
        click.echo(f"tk serve: warning: --host {host} is reachable from other machines"
                   f"{'' if api_key else ' and no --api-key is set: anyone who reaches it can use it'}; "
                   "--host 127.0.0.1 keeps it on this one", err=True)
    serving = ServeOptions(host=host, port=port, limits=limits, model_name=model_name, drain_s=drain, api_key=api_key,
                           max_body=max_body_bytes, speculation=speculation,
                           tool_parser=tool_call_parser, bare_tool_calls=bare_tool_calls,
                           reasoning_parser=reasoning_parser)
    server, sock = open_server(artifact, backend, options, serving)
    url = f"http://{host}:{sock.getsockname()[1]}"
    click.echo(f"tk serve: {server.model_name} on {url}/v1 ({backend}, {slots} slots); Ctrl-C stops", err=True)
    run(server, sock)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="The model repository to write.")
@click.option("--model-name", help="Triton's name for the model [default: the artifact folder's name].")
@click.option("--backend", default="ort", show_default=True, type=BackendName(), help="What the batcher runs on.")
@batcher_options
@click.option("--threads", type=click.IntRange(min=1), help="ONNX Runtime intra-op threads.")
@click.option("--prepack/--no-prepack", default=True, show_default=True,
              help="ONNX Runtime: repack the weights in each session (batched decode needs it to be fast).")
@quant_compute_option()
@click.option("--copy-artifact", is_flag=True, help="Copy the artifact into the repository (self-contained, "
                                                    "for a container); default: point at ARTIFACT where it is.")
@click.option("--native", is_flag=True, help="Also add the raw prefill/decode graphs (and TensorRT plans, where "
                                             "built) as models of Triton's onnxruntime/tensorrt backends.")
@click.option("--sys-path/--no-sys-path", default=True, show_default=True,
              help="Record where tk is installed here, for Triton's python stub (which ignores PYTHONPATH).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def triton(artifact: Path, out: Path, model_name: str | None, backend: str, slots: int, max_queue: int,
           threads: int | None, prepack: bool, quant_compute: str, copy_artifact: bool, native: bool, sys_path: bool,
           force: bool) -> None:
    """Write a Triton model repository that serves ARTIFACT (static cache) with tk's batcher."""
    from tk.runtimes.serving.scheduler import BatcherLimits
    from tk.toolkit.serving.triton.repo import write_repository

    click.echo(str(write_repository(artifact, out, name=model_name, backend=backend,
                                    limits=BatcherLimits(slots=slots, max_queue=max_queue), threads=threads,
                                    prepack=prepack, quant_compute=quant_compute, copy_artifact=copy_artifact, native=native, sys_path=sys_path,
                                    force=force, progress=progress)))

"""Planted models for tk serve's tests: the tiny model's own graphs, with logits added to what they
compute, so that an untrained model writes what a test needs it to mean (a call, prose after it, an
agent's turns), through the whole server: the batcher, grammars, parsers and the HTTP API."""

from __future__ import annotations

import dataclasses

import numpy as np


def planted_server(artifact, plant, *, slots: int = 4, **options):
    """A `Server` of `artifact` on ONNX Runtime whose graphs' logits (B, S, V) become
    `plant(graph, input_ids, logits)` ("prefill" for a prompt's run, through either graph, with all its
    ids, or "decode" with as many as there are logits); no prefix cache, so that each prompt is prefilled
    whole. `options`: the Server's (reasoning_parser, ...)."""
    from tk.models.spec.manifest import Manifest
    from tk.runtimes.serving.batching import Batcher
    from tk.runtimes.serving.scheduler import BatcherLimits
    from tk.toolkit.backends import BackendOptions, open_runtime
    from tk.toolkit.serving.openai.server import Server
    from tk.toolkit.textgen import Tokenizer

    runtime = open_runtime(artifact, "ort", dataclasses.replace(BackendOptions().for_runs("ort"), static_cache=True))
    run = runtime.run

    def planted(graph, feeds, past, session, in_place=False):
        out, present = run(graph, feeds, past, session, in_place)
        b, s = out.logits.shape[:2]
        # a prompt's first run is "prefill" to the plant, through either graph (the decode graph's writes from 0),
        # with all its ids (a run returns its last position's logits, or each one's)
        first = graph == "prefill" or ("write_indices" in feeds and not np.asarray(feeds["write_indices"]).any())
        ids = feeds["input_ids"][:b] if first else feeds["input_ids"][:b, -s:]
        return dataclasses.replace(out, logits=plant("prefill" if first else graph, ids, out.logits)), present
    runtime.run = planted
    # a prompt in one prefill run (no prefix cache; an idle step's budget over any context): a Script
    # reads each prefill run as a new request
    batcher = Batcher(runtime, limits=BatcherLimits(slots=slots, max_queue=16, prefix_cache_bytes=0,
                                                    idle_tokens=runtime.max_context),
                      eos_ids=Manifest.read(artifact).eos_token_ids).start()
    return Server(batcher, Tokenizer(artifact), "tiny", **options)


def bigram(table: dict[int, int], vocab: int = 512, margin: float = 30.0):
    """A plant: after token a (the graph's input), +margin on token table[a]."""
    added = np.zeros((vocab, vocab), dtype=np.float32)
    for a, b in table.items():
        added[a, b] = margin

    def plant(graph, ids, logits):
        return logits + added[ids[:, -logits.shape[1]:]]
    return plant


class Script:
    """A plant for a server of one slot: a model that means one reply to each conversation,
    `reply_for(prompt_text)`, then EOS: each position's logits get +margin on its next token."""

    def __init__(self, tokenizer, eos: int, reply_for, margin: float = 50.0):
        self.tokenizer, self.eos, self.reply_for, self.margin = tokenizer, eos, reply_for, margin
        self.target, self.at = [eos], 0

    def __call__(self, graph, ids, logits):
        if graph == "prefill":  # a new request (one slot: every decode step after it is its own)
            prompt = self.tokenizer.decode(ids[0].tolist(), False)
            self.target, self.at = [*self.tokenizer.encode(self.reply_for(prompt), False), self.eos], 0
        else:
            self.at += 1
        out = logits.copy()
        out[:, -1, self.target[min(self.at, len(self.target) - 1)]] += self.margin
        return out

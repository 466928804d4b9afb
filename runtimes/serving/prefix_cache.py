"""Prefix caching: the keys and values of prompts' leading blocks, kept for later prompts that start
with the same tokens (a shared system prompt, each turn of a chat that extends the last).

A prompt's blocks are its first `block` tokens, the next `block`, and so on (whole blocks only).
Block i is named by a hash of its tokens and of block i - 1's name (vLLM's hash chain), and the
chain starts from the cache's `root`, the identity of the model the keys and values came from: a
name stands for the whole prefix up to its block, and never matches under another root (another
model, or another export of it). `PrefixCache` maps names to payloads (the batcher stores a host
copy of a block's cache positions: runtimes/serving/batching.py) with their sizes, and evicts the least
recently used block that no other cached block extends beyond `max_bytes`, so a cached block's
parent is always cached too (eviction takes a chain from its end). Counters: `queried` and `reused` prompt tokens
(the hit rate is their ratio), `hits` (prompts that reused at least one block). Standard library
only; not thread-safe (the batcher's loop thread owns it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any, Sequence

DEFAULT_BLOCK = 16  # tokens per block: vLLM's and llama.cpp's granularity on CPUs too


class PrefixCache:
    def __init__(self, root: str, block: int = DEFAULT_BLOCK, max_bytes: int = 1 << 30):
        if block < 1 or max_bytes < 0:
            raise ValueError(f"a prefix cache needs blocks of >= 1 token and a limit >= 0, got {block} and {max_bytes}")
        self.root = hashlib.blake2b(root.encode(), digest_size=16).digest()
        self.block, self.max_bytes = block, max_bytes
        # name -> [payload, bytes, parent's name (None: the root), cached children]; least recently used first
        self._blocks: OrderedDict[bytes, list] = OrderedDict()
        self.bytes = 0
        self.queried = self.reused = self.hits = self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def hit_rate(self) -> float:
        """The share of queried prompt tokens that came from the cache."""
        return self.reused / self.queried if self.queried else 0.0

    def names(self, tokens: Sequence[int], count: int | None = None) -> list[bytes]:
        """The names of the first `count` (None: every) whole blocks of `tokens`."""
        n = len(tokens) // self.block if count is None else min(count, len(tokens) // self.block)
        out, parent = [], self.root
        for i in range(n):
            ids = array("q", tokens[i * self.block:(i + 1) * self.block]).tobytes()
            parent = hashlib.blake2b(parent + ids, digest_size=16).digest()
            out.append(parent)
        return out

    def match(self, tokens: Sequence[int], limit: int) -> list[Any]:
        """The payloads of the longest cached prefix of `tokens` in whole blocks, at most `limit`
        tokens (a prompt keeps at least its last token to compute: its logits are the first draw).
        Counts the query; touches what it returns."""
        found = []
        for name in self.names(tokens, limit // self.block):
            if name not in self._blocks:
                break
            found.append(name)
        for name in found:
            self._blocks.move_to_end(name)
        self.queried += len(tokens)
        self.reused += len(found) * self.block
        self.hits += bool(found)
        return [self._blocks[name][0] for name in found]

    def __contains__(self, name: bytes) -> bool:
        return name in self._blocks

    def put(self, name: bytes, parent: bytes | None, payload: Any, nbytes: int) -> bool:
        """Keep a block whose parent (None: the first block) is kept; the least recently used leaves
        go to make room. False where it cannot be kept (over the limit alone, or its parent is gone)."""
        if name in self._blocks:
            self._blocks.move_to_end(name)
            return True
        if nbytes > self.max_bytes or (parent is not None and parent not in self._blocks):
            return False
        while self.bytes + nbytes > self.max_bytes:
            if not self._evict(keep=parent):  # the parent's chain alone fills the cache
                return False
        self._blocks[name] = [payload, nbytes, parent, 0]
        if parent is not None:
            self._blocks[parent][3] += 1
        self.bytes += nbytes
        return True

    def _evict(self, keep: bytes | None) -> bool:
        victim = next((n for n, b in self._blocks.items() if b[3] == 0 and n != keep), None)
        if victim is None:
            return False
        _, size, parent, _ = self._blocks.pop(victim)
        if parent is not None:
            self._blocks[parent][3] -= 1
        self.bytes -= size
        self.evicted += 1
        return True

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0

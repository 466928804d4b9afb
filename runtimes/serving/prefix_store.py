"""The prefix cache's write policy over the batcher's slots: what of a slot's cache positions the
`PrefixCache` keeps, and when. A prompt's whole blocks are copied out as its chunks come in (so a
prompt that shares them can start from them while this one still prefills); a request that
completed leaves its generated tokens' whole blocks too (the next turn of a chat extends them); a
request whose prompt matched cached blocks gets them copied into its slot as it enters. A cache
that cannot keep a finished request's blocks is logged, never a reason to fail the request. A
request in its slot is the loop's `Occupant` (runtimes/serving/stepping.py): its slot, its prompt,
its row's tokens and how many of its blocks the cache holds (`stored`).
"""

from __future__ import annotations

import logging
from typing import Sequence

from tk.runtimes.base import Runtime
from tk.runtimes.serving.prefix_cache import PrefixCache
from tk.runtimes.slots import Slots

log = logging.getLogger("tk.batcher")


class PrefixStore:
    """Blocks between a batcher's `Slots` and its `PrefixCache` (`cache`: its counters for metrics)."""

    def __init__(self, runtime: Runtime, rows: Slots, max_bytes: int):
        self.cache = PrefixCache(runtime.identity, max_bytes=max_bytes)
        self.rows = rows
        self.block_bytes = runtime.dims.kv_bytes_per_token() * self.cache.block  # what one block holds

    def enter(self, r, cached: list) -> None:
        """Copy a matched prefix's blocks into the request's slot."""
        self.rows.load(r.slot, cached)
        r.stored = len(cached)

    def prompt(self, r, upto: int) -> None:
        """Keep the prompt's whole blocks below position `upto` (what its chunks have computed)."""
        self._store(r, r.row.prompt, upto)

    def leave(self, r) -> None:
        """Keep a completed request's whole blocks: its prompt's and every fed-back token's."""
        try:
            self._store(r, [*r.row.prompt, *r.row.tokens], self.rows.written(r.slot))
        except Exception:  # noqa: BLE001: a cache that could not keep it is no reason to fail the request
            log.exception("the prefix cache could not keep a finished request's blocks")

    def _store(self, r, tokens: Sequence[int], upto: int) -> None:
        """Keep the whole blocks of `tokens` whose positions (below `upto`) are in the slot's cache."""
        cache = self.cache
        names, block = cache.names(tokens, upto // cache.block), cache.block
        for i in range(r.stored, len(names)):
            parent = names[i - 1] if i else None
            part = None if names[i] in cache else self.rows.read(r.slot, i * block, (i + 1) * block)
            if not cache.put(names[i], parent, part, self.block_bytes):
                break
            r.stored = i + 1

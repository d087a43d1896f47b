"""Cache-aware routing: which replica holds the longest cached prefix of a prompt.

Each replica caches the full KV blocks of the prompts it ran and shares them with later prompts that
start the same way (`model/blocks.py`, prefix caching). Sending a request where its prefix already is
skips that prefill; sending it elsewhere computes it again. The router cannot see the replicas' caches,
so it keeps its own approximate copy, as SGLang's cache-aware router keeps an approximate radix tree:
per replica, the chained hashes of the full prompt blocks it placed there, least recently used first,
at most as many as the replica's KV blocks (so what the replica evicted, the index forgets too).

A chained hash names a block together with everything before it (h_i = hash(h_{i-1}, block i)), so the
longest cached prefix is the longest run of leading hashes found. Pure Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

DEFAULT_BLOCKS = 4096  # a replica's index size before it reports its KV capacity


def block_hashes(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of `tokens` (a partial last block is never shared)."""
    out, h = [], 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[i : i + block_size])))
        out.append(h)
    return tuple(out)


class PrefixIndex:
    """Per replica, the block hashes it is taken to hold (an LRU of bounded size)."""

    def __init__(self, n_replicas: int) -> None:
        self.held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_replicas)]
        self.capacity = [DEFAULT_BLOCKS] * n_replicas

    def matched(self, replica: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` replica `replica` holds."""
        held, n = self.held[replica], 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def placed(self, replica: int, hashes: Sequence[int]) -> None:
        """The replica runs a prompt of these blocks: it holds them now, most recently used."""
        held = self.held[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity[replica]:
            held.popitem(last=False)

    def resize(self, replica: int, blocks: int) -> None:
        self.capacity[replica] = max(1, blocks)

    def forget(self, replica: int) -> None:
        """The replica is gone, and its cache with it."""
        self.held[replica].clear()

    def best(self, hashes: Sequence[int], choices: list[int], loads: dict[int, int], slack: int) -> int | None:
        """The replica among `choices` holding the longest prefix of `hashes` (least loaded among equals),
        unless none holds any, or it has `slack` or more requests outstanding beyond the least loaded
        choice (then caching would buy less than the queue costs): None, the caller balances instead."""
        if not hashes:
            return None
        got = {i: self.matched(i, hashes) for i in choices}
        top = max(got.values())
        if top == 0:
            return None
        r = min((i for i in choices if got[i] == top), key=lambda i: (loads[i], i))
        return r if loads[r] - min(loads[i] for i in choices) < slack else None

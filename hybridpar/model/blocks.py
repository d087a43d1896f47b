"""The free list of a paged KV cache's blocks, with prefix sharing (vLLM's automatic prefix caching,
Kwon et al. 2023; SGLang's RadixAttention, Zheng et al. 2024, shares prefixes the same way).

Pure Python: the replica's driver owns it; the stages only read the block tables it sends. A block is
held by any number of sequences (a reference count). Once a sequence's block is full its content is
registered under a key naming every token up to the block's end — (the previous block's key, this
block's tokens), nested, so keys are exact (no hash collisions) and each costs one block of tokens. A
later sequence whose tokens start with the same full blocks takes those blocks instead of computing them
again (`match`); only full blocks are shared and a sequence writes only past what it matched, so nobody
writes into a shared block. A block nobody holds goes back to the free list but keeps its content and
key until the free list hands it out again, least recently freed first: a finished request's prompt
serves the next request with the same prefix, and a preempted one's own blocks may still be there when
it comes back.
"""

from __future__ import annotations

Key = tuple  # (previous block's key or None, this block's tokens)


class BlockAllocator:
    def __init__(self, n_blocks: int, block_size: int) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free: dict[int, None] = dict.fromkeys(range(n_blocks))  # insertion order: least recently freed first
        self._refs = [0] * n_blocks
        self._key_of: dict[int, Key] = {}
        self._block_of: dict[Key, int] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.n_blocks - len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold `n_tokens` tokens."""
        return -(-n_tokens // self.block_size)

    def _take(self, b: int) -> None:
        if self._refs[b] == 0:
            del self._free[b]
        self._refs[b] += 1

    def grow(self, table: list[int], n_tokens: int) -> bool:
        """Extend `table` in place to hold `n_tokens` tokens; False (table unchanged) if blocks run out."""
        need = self.blocks_for(n_tokens) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            b = next(iter(self._free))
            if (key := self._key_of.pop(b, None)) is not None:  # reused: its old content is gone
                del self._block_of[key]
            self._take(b)
            table.append(b)
        return True

    def release(self, table: list[int]) -> None:
        """A sequence lets go of its blocks (its table is emptied); blocks nobody holds become free."""
        assert len(set(table)) == len(table) and all(self._refs[b] > 0 for b in table), "block freed twice"
        for b in reversed(table):  # the sequence's last blocks are reused first, its prefix kept longest
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
        table.clear()

    def match(self, tokens: list[int]) -> list[int]:
        """The registered blocks holding the longest run of whole blocks that `tokens` starts with — leaving
        at least one token to compute (its logits are needed) — each now also held by the caller."""
        bs, key, out = self.block_size, None, []
        for i in range((len(tokens) - 1) // bs):
            key = (key, tuple(tokens[i * bs : (i + 1) * bs]))
            if (b := self._block_of.get(key)) is None:
                break
            self._take(b)
            out.append(b)
        return out

    def commit(self, table: list[int], tokens: list[int], done: int) -> int:
        """Register the full blocks of a sequence whose first len(tokens) tokens are in the cache, from its
        block `done` on (those before are registered already); returns the new count of registered blocks."""
        bs = self.block_size
        full = len(tokens) // bs
        key = None
        for i in range(full):
            key = (key, tuple(tokens[i * bs : (i + 1) * bs]))
            b = table[i]
            # Content that has a block already keeps that one (two sequences prefilled the same prompt at once).
            if i >= done and key not in self._block_of and b not in self._key_of:
                self._key_of[b], self._block_of[key] = key, b
        return max(done, full)

"""The paged key/value cache of incremental (serving) forwards, shared by every model family.

A stage's forward takes an optional `KVStep`: without it, attention is plain causal attention over
the sequence (training, and the reference that serving is tested against); with it, each layer writes
its new keys and values into the cache and its queries attend to everything the row has seen. The
same modules and weights run either way, so tensor parallelism works unchanged: the row-parallel
projections all-reduce, the vocabulary-parallel embedding sums, the head gathers.

Paging (vLLM's PagedAttention, Kwon et al. 2023): each stage holds, per layer, one pool of fixed-size
blocks (n_blocks + 1, kv_heads, block_size, head_dim) of this rank's kv heads and layers, so the cache is
sharded over tp (heads) × pp (layers) like the model. A sequence owns a list of blocks (its block
table, kept by the replica's driver with a `BlockAllocator`), so sequences of any length join and leave
a batch without copying anyone's cache, and a freed block serves the next sequence at once.

A step is a batch of rows, each with its own start position, its own number of real tokens (the rest is
right padding: a prefill next to decodes) and its own block table. Each layer writes the row's new
keys/values through its block table, then gathers the row's blocks into a contiguous (B, kv, L, hd)
tensor for attention. The gather copies the row's past once per layer per step: simple and exact (the
same values, the same mask, the same kernel as a contiguous cache), not a paged attention kernel.
Padding tokens write to the extra last block (the scratch block, owned by nobody), and every key a
query must not see — another row's blocks behind a short table, positions past the row's own — is masked.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


class BlockAllocator:
    """The free list of a pool of `n_blocks` blocks of `block_size` tokens (pure Python: the driver's
    bookkeeping; the stages only read the block tables it sends)."""

    def __init__(self, n_blocks: int, block_size: int) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.n_blocks - len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold `n_tokens` tokens."""
        return -(-n_tokens // self.block_size)

    def grow(self, table: list[int], n_tokens: int) -> bool:
        """Extend `table` in place to hold `n_tokens` tokens; False (table unchanged) if blocks run out."""
        need = self.blocks_for(n_tokens) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            table.append(self._free.pop())
        return True

    def release(self, table: list[int]) -> None:
        """Return a sequence's blocks to the free list and empty its table."""
        assert len(set(table)) == len(table) and not set(table) & set(self._free), "block freed twice"
        self._free.extend(reversed(table))
        table.clear()


class KVCache:
    """The block pools of one stage (this rank's kv heads and layers): per layer, keys and values of
    shape (n_blocks + 1, kv_heads, block_size, head_dim); block n_blocks is the scratch block."""

    def __init__(
        self,
        layer_ids: Iterable[str],
        kv_heads: int,
        head_dim: int,
        n_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (n_blocks + 1, kv_heads, block_size, head_dim)
        self.k = {lid: torch.zeros(shape, device=device, dtype=dtype) for lid in layer_ids}
        self.v = {lid: torch.zeros(shape, device=device, dtype=dtype) for lid in layer_ids}

    @property
    def scratch(self) -> int:
        return self.n_blocks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


class KVStep:
    """One step of B rows over the paged cache. pos (B,): position of each row's first token; n_valid (B,):
    real tokens per row (the rest of the T is right padding); tables (B, NB): each row's blocks, padded
    with the scratch block."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, n_valid: torch.Tensor, T: int, tables: torch.Tensor) -> None:
        B, dev, bs = pos.shape[0], pos.device, cache.block_size
        self.cache, self.n_valid = cache, n_valid
        self.max_len = tables.shape[1] * bs  # positions this step can address (the rope tables' length)
        t = torch.arange(T, device=dev).view(1, T)
        real = t < n_valid.view(B, 1)  # (B, T)
        last = (pos + n_valid - 1).clamp(min=0).view(B, 1)
        # A padding token sits at its row's last real position: a valid position for every family
        # (learned positions included); its query's output is never read.
        self.positions = torch.where(real, pos.view(B, 1) + t, last)  # (B, T)
        blk = tables.gather(1, (self.positions // bs).clamp(max=tables.shape[1] - 1))
        # (block, offset) of each token's new key/value (B, T): padding goes to the scratch block.
        self.write = (torch.where(real, blk, cache.scratch), self.positions % bs)
        self.L = int(self.positions.max()) + 1  # keys in use this step
        j = torch.arange(self.L, device=dev)
        self.read = (tables[:, j // bs], (j % bs).view(1, -1).expand(B, -1))  # (block, offset) of each key (B, L)
        # Query t of row b sees keys j <= positions[b, t] (causal within the row, all of its past).
        self.mask = j.view(1, 1, 1, self.L) <= self.positions.view(B, 1, T, 1)

    def layer(self, lid: str) -> LayerKV:
        return LayerKV(self, lid)

    def last_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, d) -> those of each row's last real token (B, 1, d): all the head needs."""
        B = h.shape[0]
        return h[torch.arange(B, device=h.device), (self.n_valid - 1).clamp(min=0)].unsqueeze(1)


class LayerKV:
    """A step's view of one layer's pools."""

    def __init__(self, step: KVStep, lid: str) -> None:
        self.step, self.lid = step, lid

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this step's keys/values (B, kv, T, hd) into their blocks; return every key and value the
        rows use (B, kv, L, hd), gathered from their blocks, and the attention mask (B, 1, T, L)."""
        s, c = self.step, self.step.cache
        out = []
        for pool, new in ((c.k[self.lid], k), (c.v[self.lid], v)):
            slots = pool.permute(0, 2, 1, 3)  # (n + 1, bs, kv, hd) view of the pool
            # Advanced indices on the two leading dims: the target is (B, T, kv, hd).
            slots[s.write] = new.transpose(1, 2)
            out.append(slots[s.read].transpose(1, 2))  # (B, kv, L, hd)
        return out[0], out[1], s.mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV | None) -> torch.Tensor:
    """Causal attention of q (B, h, T, hd) over k, v (B, kv, T, hd) -> (B, h, T, hd); with `kv`, over the
    row's cached past as well. kv < h heads: grouped-query attention, each kv head shared by a group."""
    mask = None
    if kv is not None:
        k, v, mask = kv.update(k, v)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

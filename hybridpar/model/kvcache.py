"""The paged key/value cache of incremental (serving) forwards, shared by every model family.

A stage's forward takes an optional `KVStep`: without it, attention is plain causal attention over
the sequence (training, and the reference that serving is tested against); with it, each layer writes
its new keys and values into the cache and its queries attend to everything the row has seen. The
same modules and weights run either way, so tensor parallelism works unchanged: the row-parallel
projections all-reduce, the vocabulary-parallel embedding sums, the head gathers.

Paging (vLLM's PagedAttention, Kwon et al. 2023): each stage holds, per layer, one pool of fixed-size
blocks (n_blocks + 1, kv_heads, block_size, head_dim) of this rank's kv heads and layers, so the cache is
sharded over tp (heads) × pp (layers) like the model. A sequence owns a list of blocks (its block
table, kept by the replica's driver with a `blocks.BlockAllocator`), so sequences of any length join and leave
a batch without copying anyone's cache, and a freed block serves the next sequence at once
(`model/blocks.py`: the free list, with prefix sharing).

A step is a batch of sequences, each with its own start position, its own number of new tokens (a
prefill next to one-token decodes) and its own block table, their tokens packed into one row (`KVStep`).
Each layer writes the new keys/values through the block tables, then gathers the sequences' blocks into
one contiguous tensor for attention. The gather copies every sequence's past once per layer per step:
simple and exact (the same values and the same kernel as a contiguous cache; every key a token must not
see — another sequence's, positions after its own — is masked), not a fused paged-attention kernel.
Block tables are padded with the extra last block (the scratch block, owned by nobody).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


class KVCache:
    """The block pools of one stage (this rank's kv heads and layers): per layer, keys and values of
    shape ((n_blocks + 1) * block_size, kv_heads, head_dim), token slot i of block b at b * block_size + i
    (token-major, so a gather is one index_select); block n_blocks is the scratch block."""

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
        shape = ((n_blocks + 1) * block_size, kv_heads, head_dim)
        self.k = {lid: torch.zeros(shape, device=device, dtype=dtype) for lid in layer_ids}
        self.v = {lid: torch.zeros(shape, device=device, dtype=dtype) for lid in layer_ids}

    @property
    def scratch(self) -> int:
        return self.n_blocks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


class KVStep:
    """One step of R sequences over the paged cache, their tokens packed into one row (no padding):
    x is (1, N) with N = n_valid.sum(), row r's tokens after row r-1's. pos (R,): position of each
    sequence's first token here; n_valid (R,): its tokens here (a whole prompt, or 1 to decode); tables
    (R, NB): its blocks (padded with the scratch block, never read). Attention is over the keys of every
    sequence gathered into one (1, kv, S, hd) run, S = sum(pos + n_valid), with a mask that lets a token
    see only its own sequence's keys up to its position: no padding in the matmuls, at the price of
    N x S scores (quadratic in the batch; a varlen kernel would skip the masked blocks)."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, n_valid: torch.Tensor, tables: torch.Tensor) -> None:
        R, dev, bs = pos.shape[0], pos.device, cache.block_size
        self.cache = cache
        self.max_len = tables.shape[1] * bs  # positions this step can address (the rope tables' length)
        seqs = torch.arange(R, device=dev)
        row = torch.repeat_interleave(seqs, n_valid)  # (N,) sequence of each token
        ends = torch.cumsum(n_valid, 0)
        self.ends = ends - 1  # (R,) index of each sequence's last token
        positions = pos[row] + torch.arange(row.shape[0], device=dev) - (ends - n_valid)[row]  # (N,)
        self.positions = positions.view(1, -1)  # (1, N)
        self.write = tables[row, positions // bs] * bs + positions % bs  # (N,) slot of each new key/value
        lens = pos + n_valid  # keys of each sequence
        krow = torch.repeat_interleave(seqs, lens)  # (S,)
        j = torch.arange(krow.shape[0], device=dev) - (torch.cumsum(lens, 0) - lens)[krow]  # key positions
        self.read = tables[krow, j // bs] * bs + j % bs  # (S,) slot of each key
        # Token i sees key k iff k is its own sequence's and not after it (causal, with all of its past).
        mask = (krow.view(1, -1) == row.view(-1, 1)) & (j.view(1, -1) <= positions.view(-1, 1))
        self.mask = mask.view(1, 1, *mask.shape)  # (1, 1, N, S)

    def layer(self, lid: str) -> LayerKV:
        return LayerKV(self, lid)

    def last_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (1, N, d) -> those of each sequence's last token (R, 1, d): all the head needs."""
        return h[0, self.ends].unsqueeze(1)


class LayerKV:
    """A step's view of one layer's pools."""

    def __init__(self, step: KVStep, lid: str) -> None:
        self.step, self.lid = step, lid

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this step's keys/values (1, kv, N, hd) into their blocks; return every key and value the
        sequences use (1, kv, S, hd), gathered from their blocks, and the attention mask (1, 1, N, S)."""
        s, c = self.step, self.step.cache
        out = []
        for pool, new in ((c.k[self.lid], k), (c.v[self.lid], v)):
            pool.index_copy_(0, s.write, new[0].transpose(0, 1))
            out.append(pool.index_select(0, s.read).transpose(0, 1).unsqueeze(0))  # (1, kv, S, hd)
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

"""The paged key/value cache of incremental (serving) forwards, shared by every model family.

A stage's forward takes an optional `KVStep`: without it, attention is plain causal attention over
the sequence (training, and the reference that serving is tested against); with it, each layer writes
its new keys and values into the cache and its queries attend to everything the row has seen. The
same modules and weights run either way, so tensor parallelism works unchanged: the row-parallel
projections all-reduce, the vocabulary-parallel embedding sums, the head gathers.

Paging (vLLM's PagedAttention, Kwon et al. 2023): each stage holds, per layer, one pool of fixed-size
blocks ((n_blocks + 1) x block_size token slots of kv_heads x head_dim) of this rank's kv heads and
layers, so the cache is sharded over tp (heads) x pp (layers) like the model. A sequence owns a list of
blocks (its block table, kept by the replica's driver with a `blocks.BlockAllocator`), so sequences of
any length join and leave a batch without copying anyone's cache, and a freed block serves the next
sequence at once (`model/blocks.py`: the free list, with prefix sharing).

A step is a batch of sequences, each with its own start position, its own number of new tokens (a
prefill next to one-token decodes) and its own block table, their tokens packed into one row (`KVStep`).
Each layer writes the new keys/values through the block tables, then gathers each sequence's blocks into
a contiguous tensor for attention (the one-token decodes together, each prefill alone). The gather copies
every sequence's past once per layer per step: simple and exact (the same values and the same kernel as a
contiguous cache; keys past a sequence's own are masked), not a fused paged-attention kernel.
Block tables are padded with the extra last block (the scratch block, owned by nobody).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
    """One step of R sequences over the paged cache, their new tokens packed into one row (no padding):
    x is (1, N) with N = n_valid.sum(), sequence r's tokens after sequence r-1's. pos (R,): position of
    each sequence's first token here; n_valid (R,): its tokens here (a whole prompt, or 1 to decode);
    tables (R, NB): its blocks (padded with the scratch block).

    The matmuls run on the packed row; attention runs per part (`parts`): every one-token decode together,
    each over its own keys padded to the longest (masked), so the scores grow with the batch times the
    context, not its square; each prefill alone, over exactly its keys."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, n_valid: torch.Tensor, tables: torch.Tensor) -> None:
        R, dev, bs = pos.shape[0], pos.device, cache.block_size
        self.cache = cache
        self.max_len = tables.shape[1] * bs  # positions this step can address (the rope tables' length)
        row = torch.repeat_interleave(torch.arange(R, device=dev), n_valid)  # (N,) sequence of each token
        ends = torch.cumsum(n_valid, 0)
        self.ends = ends - 1  # (R,) index of each sequence's last token
        positions = pos[row] + torch.arange(row.shape[0], device=dev) - (ends - n_valid)[row]  # (N,)
        self.positions = positions.view(1, -1)  # (1, N)
        self.write = tables[row, positions // bs] * bs + positions % bs  # (N,) slot of each new key/value
        lens = pos + n_valid  # keys of each sequence
        # (tokens (P, T), key slots (P, L), mask (P, 1, T, L)) of each part
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        dec = (n_valid == 1).nonzero().flatten()
        if dec.numel():
            j = torch.arange(int(lens[dec].max()), device=dev)
            read = tables[dec][:, j // bs] * bs + j % bs  # (D, L): past its length, any slot (masked)
            self.parts.append((self.ends[dec].view(-1, 1), read, (j < lens[dec].view(-1, 1)).view(len(dec), 1, 1, -1)))
        for r in (n_valid > 1).nonzero().flatten().tolist():
            j = torch.arange(int(lens[r]), device=dev)
            tok = torch.arange(int(ends[r] - n_valid[r]), int(ends[r]), device=dev)
            mask = j.view(1, -1) <= positions[tok].view(-1, 1)  # causal, after all of its past
            self.parts.append(
                (tok.view(1, -1), (tables[r, j // bs] * bs + j % bs).view(1, -1), mask.view(1, 1, *mask.shape))
            )

    def layer(self, lid: str) -> LayerKV:
        return LayerKV(self, lid)

    def last_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (1, N, d) -> those of each sequence's last token (R, 1, d): all the head needs."""
        return h[0, self.ends].unsqueeze(1)


class LayerKV:
    """A step's view of one layer's pools."""

    def __init__(self, step: KVStep, lid: str) -> None:
        self.step, self.lid = step, lid

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, saves: Any = None) -> torch.Tensor:
        """Write this step's keys/values (1, kv, N, hd) into their blocks; return the attention of the
        queries (1, h, N, hd) over their own sequences' keys, gathered from the blocks, part by part.
        (`saves`: serving saves nothing for a backward.)"""
        s, c = self.step, self.step.cache
        pk, pv = c.k[self.lid], c.v[self.lid]
        pk.index_copy_(0, s.write, k[0].transpose(0, 1))
        pv.index_copy_(0, s.write, v[0].transpose(0, 1))
        out = torch.empty_like(q)
        h, kvh, hd = q.shape[1], k.shape[1], q.shape[3]
        for tok, read, mask in s.parts:
            (P, T), L = tok.shape, read.shape[1]
            qq = q[0][:, tok.flatten()].view(h, P, T, hd).transpose(0, 1)  # (P, h, T, hd)
            kk, vv = (p.index_select(0, read.flatten()).view(P, L, kvh, hd).transpose(1, 2) for p in (pk, pv))
            o = sdpa(qq, kk, vv, mask)  # (P, h, T, hd)
            out[0][:, tok.flatten()] = o.transpose(0, 1).reshape(h, P * T, hd)
        return out


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, saves: Any = None
) -> torch.Tensor:
    """kv < h heads: grouped-query attention, each kv head shared by a group of query heads. `saves`: the
    block's saved-tensor hooks (model/regather.py), told which tensors are k, v repeated, to keep one head of
    each group for the backward. (torch's enable_gqa=True would keep none, but sums dk, dv in another order:
    measured, a bf16 error 14% larger.)"""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if saves is not None:
            k, v = saves.repeated(k, rep), saves.repeated(v, rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV | None, saves: Any = None) -> torch.Tensor:
    """Causal attention of q (B, h, T, hd) over k, v (B, kv, T, hd) -> (B, h, T, hd); with `kv`, over each
    sequence's cached past as well (B = 1: the step's packed row). `saves`: as sdpa's."""
    return sdpa(q, k, v, None, saves) if kv is None else kv.attend(q, k, v, saves)


def attention_kernel(q_heads: int, seq_len: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel `sdpa` dispatches a training forward of this shape to (torch's own choice among flash,
    memory-efficient, cuDNN and math, asked with the very arguments `sdpa` passes: causal, no mask, the
    kv heads already repeated): 'FLASH_ATTENTION' on CPU and on recent GPUs for fp32/bf16 inputs,
    'MATH' where no fused kernel applies (the unfused reference: slower, more memory)."""
    from torch.nn.attention import SDPBackend

    q = torch.empty((1, q_heads, seq_len, head_dim), device=device, dtype=dtype, requires_grad=True)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, None, 0.0, True)).name

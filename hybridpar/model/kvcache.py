"""The key/value cache of incremental (serving) forwards, shared by every model family.

A stage's forward takes an optional `KVStep`: without it, attention is plain causal attention over
the sequence (training, and the reference that serving is tested against); with it, each layer writes
its new keys and values into the cache and its queries attend to everything the row has seen. The
same modules and weights run either way, so tensor parallelism works unchanged: the row-parallel
projections all-reduce, the vocabulary-parallel embedding sums, the head gathers.

A group of B sequences shares one cache per layer, (B, kv_heads, max_len, head_dim). Rows may have
different lengths: a prefill is right-padded to the longest prompt, and each row carries its own
start position, so a decode step writes row b's new key at position lens[b]. Padded positions hold
garbage that no valid query ever attends to: a row's key j is attended only by queries at positions
>= j of that row, and slot j is rewritten by the decode step at position j before anything reads it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of one request group on one stage (this rank's kv heads only)."""

    def __init__(
        self,
        layer_ids: Iterable[str],
        kv_heads: int,
        head_dim: int,
        batch: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_len = max_len
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = {lid: torch.zeros(shape, device=device, dtype=dtype) for lid in layer_ids}
        self.v = {lid: torch.zeros(shape, device=device, dtype=dtype) for lid in layer_ids}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


class KVStep:
    """One prefill (T tokens per row) or decode (T = 1) step over a group's cache. pos (B,): position of
    each row's first token; n_valid (B,): real tokens per row (the rest is right padding)."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, n_valid: torch.Tensor, T: int) -> None:
        B, dev = pos.shape[0], pos.device
        self.cache, self.max_len, self.n_valid = cache, cache.max_len, n_valid
        positions = pos.view(B, 1) + torch.arange(T, device=dev).view(1, T)  # (B, T)
        self.positions = positions.clamp(max=cache.max_len - 1)  # padding past the end of a short row's cache
        self.L = int(self.positions.max()) + 1  # keys in use this step
        # Query t of row b sees keys j <= positions[b, t] (causal within the row, all of its past).
        self.mask = torch.arange(self.L, device=dev).view(1, 1, 1, self.L) <= self.positions.view(B, 1, T, 1)
        self.rows = torch.arange(B, device=dev).view(B, 1).expand(B, T)

    def layer(self, lid: str) -> LayerKV:
        return LayerKV(self, lid)

    def last_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, d) -> those of each row's last real token (B, 1, d): all the head needs."""
        B = h.shape[0]
        return h[torch.arange(B, device=h.device), (self.n_valid - 1).clamp(min=0)].unsqueeze(1)


class LayerKV:
    """A step's view of one layer's cache."""

    def __init__(self, step: KVStep, lid: str) -> None:
        self.step, self.lid = step, lid

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this step's keys/values (B, kv, T, hd) at their positions; return every key and value in
        use (B, kv, L, hd) and the attention mask (B, 1, T, L)."""
        s, c = self.step, self.step.cache
        # Advanced indices around a slice put their dims first: the target is (B, T, kv, hd).
        c.k[self.lid][s.rows, :, s.positions] = k.transpose(1, 2)
        c.v[self.lid][s.rows, :, s.positions] = v.transpose(1, 2)
        return c.k[self.lid][:, :, : s.L], c.v[self.lid][:, :, : s.L], s.mask


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

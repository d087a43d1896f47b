"""Incremental (KV-cached) forward of one `LlamaStage`, for inference only.

The training forward in `model/llama.py` is left untouched (it stays bit-identical); this walks the
same modules with the same weights, so tensor parallelism works unchanged: the row-parallel
projections' forward hooks all-reduce, the vocabulary-parallel embedding sums, the head gathers.

A group of B sequences shares one cache per layer, (B, kv_heads, max_len, head_dim). Rows may have
different lengths: a prefill is right-padded to the longest prompt, and each row carries its own
start position, so a decode step writes row b's new key at position lens[b]. Padded positions hold
garbage that no valid query ever attends to: a row's key j is attended only by queries at positions
>= j of that row, and slot j is rewritten by the decode step at position j before anything reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridpar.model.llama import LlamaStage, _rotate_half, rope_tables


class GroupCache:
    """Keys and values of one request group on one stage (this rank's kv heads only)."""

    def __init__(self, stage: LlamaStage, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.max_len = max_len
        hd = stage.cfg.head_dim
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        for lid, layer in stage.model.layers.items():
            kvh = layer.self_attn.k_proj.weight.shape[0] // hd  # kv heads held by this tp rank
            self.k[lid] = torch.zeros(batch, kvh, max_len, hd, device=device, dtype=dtype)
            self.v[lid] = torch.zeros(batch, kvh, max_len, hd, device=device, dtype=dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


class CachedStage:
    """Runs a stage's slice of the model over a KV cache: prefill (T tokens per row) or decode (T = 1)."""

    def __init__(self, stage: LlamaStage) -> None:
        self.stage = stage
        self._rope: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _tables(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0] < n:
            cfg = self.stage.cfg
            cos, sin = rope_tables(max(n, 256), cfg.head_dim, cfg.rope_theta, device)
            self._rope = (cos.shape[0], cos, sin)
        return self._rope[1], self._rope[2]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, cache: GroupCache, pos: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        """x: ids (B, T) on the first stage, hidden (B, T, d) elsewhere. pos (B,): position of each row's
        first token; n_valid (B,): real tokens per row (the rest is right padding).
        Returns hidden (B, T, d), or on the last stage the logits at each row's last real token (B, V)."""
        st = self.stage
        h = st.model.embed_tokens(x) if st.first else x  # (B, T, d)
        B, T = h.shape[:2]
        positions = pos.view(B, 1) + torch.arange(T, device=h.device).view(1, T)  # (B, T)
        positions = positions.clamp(max=cache.max_len - 1)  # padding past the end of a short row's cache
        cos_t, sin_t = self._tables(cache.max_len, h.device)
        cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)  # (B, 1, T, hd)
        L = int(positions.max()) + 1  # keys in use this step
        # Query t of row b sees keys j <= positions[b, t] (causal within the row, all of its past).
        mask = torch.arange(L, device=h.device).view(1, 1, 1, L) <= positions.view(B, 1, T, 1)  # (B, 1, T, L)
        rows = torch.arange(B, device=h.device).view(B, 1).expand(B, T)
        for lid, layer in st.model.layers.items():
            h = h + self._attention(layer.self_attn, layer.input_layernorm(h), cache, lid, rows, positions,
                                    cos, sin, mask, L)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if not st.last:
            return h
        last = h[torch.arange(B, device=h.device), (n_valid - 1).clamp(min=0)]  # (B, d)
        return st.lm_head(st.model.norm(last.unsqueeze(1)))[:, 0].float()  # (B, V)

    def _attention(self, attn: torch.nn.Module, x: torch.Tensor, cache: GroupCache, lid: str, rows: torch.Tensor,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                   L: int) -> torch.Tensor:
        B, T, _ = x.shape
        hd = attn.head_dim
        q = attn.q_proj(x).view(B, T, -1, hd).transpose(1, 2)  # (B, h, T, hd)
        k = attn.k_proj(x).view(B, T, -1, hd).transpose(1, 2)  # (B, kv, T, hd)
        v = attn.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Advanced indices around a slice put their dims first: the target is (B, T, kv, hd).
        cache.k[lid][rows, :, positions] = k.transpose(1, 2)
        cache.v[lid][rows, :, positions] = v.transpose(1, 2)
        keys, vals = cache.k[lid][:, :, :L], cache.v[lid][:, :, :L]
        if keys.shape[1] != q.shape[1]:  # grouped-query attention
            rep = q.shape[1] // keys.shape[1]
            keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)  # (B, h, T, hd)
        return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))

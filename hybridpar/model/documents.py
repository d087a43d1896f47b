"""Attention inside documents only (data.document_mask): a training window that holds the end of one
document and the start of the next attends causally within each, never across the boundary, and each
document's positions start at 0 (Megatron's reset_attention_mask with reset_position_ids), so every
document's tokens get the logits they would get alone: the same rows of the rotary tables (Llama) or of
the position embedding (GPT-2), the same keys.

`DocumentMask` is handed to a stage's forward where serving hands its `KVStep`: the families read
per-row positions (`positions`, `max_len`), each layer's view (`layer`), which attends with the mask
(`attend`: this step's keys and values, no cache), and the head's rows (`last_tokens`: all of them). So
the model's code has one path for both, and the pipeline carries only the (B, T) document numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridpar.model.kvcache import sdpa


class DocumentMask:
    """Per-row positions and a block-diagonal causal mask from `documents` (B, T): each token's document
    number, equal within a document and rising at each boundary (e.g. numbered from the window's first)."""

    def __init__(self, documents: torch.Tensor) -> None:
        B, T = documents.shape
        dev = documents.device
        t = torch.arange(T, device=dev).expand(B, T)
        new = torch.ones(B, T, dtype=torch.bool, device=dev)
        new[:, 1:] = documents[:, 1:] != documents[:, :-1]  # a document starts here
        first = torch.where(new, t, torch.zeros_like(t)).cummax(dim=1).values  # (B, T): its document's start
        self.positions = t - first  # (B, T): restarting at 0 in each document
        self.max_len = T
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        self.mask = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]  # (B, 1, T, T)

    def layer(self, lid: str) -> DocumentMask:
        return self

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, saves: Any = None) -> torch.Tensor:
        """Attention of q (B, h, T, hd) over this step's keys and values (nothing cached), within documents.
        `saves`: the block's saved-tensor hooks, as kvcache.sdpa's (training keeps one head of each kv group)."""
        return sdpa(q, k, v, self.mask, saves)

    def last_tokens(self, h: torch.Tensor) -> torch.Tensor:
        return h  # training and evaluation need every position's logits


def document_masks(documents: list[torch.Tensor] | None) -> list[DocumentMask] | None:
    """One `DocumentMask` per microbatch (None: attention over the whole window, as without documents)."""
    return None if documents is None else [DocumentMask(d) for d in documents]

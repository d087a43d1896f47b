"""Tensor parallelism as a plan keyed by module name, applied to the parallel-agnostic model
(Megatron-LM layout, Shoeybi et al. 2019), with explicit column/row-parallel layers.

Per decoder layer each block's input goes through `f` (identity forward, all-reduce of the input
gradient backward) once, its q/k/v or gate/up projections are column-parallel (each rank owns a slice
of the heads / FFN width), and o_proj / down_proj are row-parallel followed by `g` (all-reduce forward,
identity backward): two all-reduces forward and two backward per layer. The embedding is
vocabulary-parallel; the head is column-parallel with its logits gathered, so the loss is computed on
full logits identically on every tp rank. Norm gains stay replicated: their inputs, hence their
gradients, are identical on every tp rank.

Why not DTensor's `parallelize_module` (the default in DESIGN.md): measured on this machine
(docs/tensor-parallel.md) it was 3x slower per step at tp=2 — it issues one backward all-reduce per
projection (q, k and v separately: 7 per layer instead of 4) and adds Python dispatch per op. It also
returned a Replicate gradient for the Shard(0) embedding, which norms over shards then double-count.

A sharded parameter carries `tp_dim` (the dimension it is split along); everything that reduces,
clips or gathers parameters reads that attribute.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridpar.model.llama import LlamaStage

TP_PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn": "copy_in",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp": "copy_in",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather",
}


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: the input is used by every tp rank; their input gradients are partial sums."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: sum the ranks' partial outputs; the output gradient is already the same on all."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _GatherLastDim(torch.autograd.Function):
    """Concatenate the ranks' slices of the last dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g.chunk(ctx.n, dim=-1)[ctx.rank].contiguous(), None


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding table; tokens outside look up zeros, and g sums the ranks."""

    def __init__(self, weight: torch.Tensor, lo: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = weight
        self.lo, self.hi, self.group = lo, lo + weight.shape[0], group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        h = F.embedding((ids - self.lo).masked_fill(outside, 0), self.weight)
        return _ReduceFromTP.apply(h.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


def _shard(p: nn.Parameter, dim: int, rank: int, n: int) -> nn.Parameter:
    local = nn.Parameter(p.detach().chunk(n, dim=dim)[rank].clone())
    local.tp_dim = dim  # type: ignore[attr-defined]
    return local


def apply_tp(stage: LlamaStage, group: dist.ProcessGroup | None) -> LlamaStage:
    """Shard `stage` in place over the tp `group` following TP_PLAN. A no-op without tp."""
    if group is None or dist.get_world_size(group) == 1:
        return stage
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for name, mod in list(stage.named_modules()):
        style = next((s for pat, s in TP_PLAN.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style == "copy_in":
            mod.register_forward_pre_hook(lambda m, args: (_CopyToTP.apply(args[0], group), *args[1:]))
        elif style == "colwise":
            mod.weight = _shard(mod.weight, 0, rank, n)
        elif style == "rowwise":
            mod.weight = _shard(mod.weight, 1, rank, n)
            mod.register_forward_hook(lambda m, args, out: _ReduceFromTP.apply(out, group))
        elif style == "colwise_gather":
            mod.weight = _shard(mod.weight, 0, rank, n)
            mod.register_forward_pre_hook(lambda m, args: (_CopyToTP.apply(args[0], group), *args[1:]))
            mod.register_forward_hook(lambda m, args, out: _GatherLastDim.apply(out, group))
        elif style == "vocab":
            w = _shard(mod.weight, 0, rank, n)
            stage.model.embed_tokens = VocabParallelEmbedding(w, rank * w.shape[0], group)
    if stage.cfg.tie_embeddings and stage.first and stage.last:
        stage.lm_head.weight = stage.model.embed_tokens.weight  # both are the same row shard: re-tie
    return stage


def is_sharded(p: torch.Tensor) -> bool:
    """True for a parameter split over tp (its tensor is this rank's slice of the full one)."""
    return hasattr(p, "tp_dim")


def full_tensor(p: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full parameter (collective over the tp group for a sharded one)."""
    if not is_sharded(p) or group is None:
        return p.detach()
    parts = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, p.detach().contiguous(), group=group)
    return torch.cat(parts, dim=p.tp_dim)  # type: ignore[attr-defined]

"""Tensor parallelism as a plan keyed by module name, applied to the parallel-agnostic model
(Megatron-LM layout, Shoeybi et al. 2019), with explicit column/row-parallel layers.

Each family's stage carries its plan (`Stage.TP_PLAN`, module-name pattern -> style). Per decoder
layer each block's input goes through `f` (identity forward, all-reduce of the input gradient backward)
once, its input projections are column-parallel (each rank owns a slice of the heads / FFN width, and
of their biases), and its output projections are row-parallel: `g` (all-reduce forward, identity
backward) sums the ranks' partial products, then the bias is added once — replicated, since its
gradient is the output gradient, the same on every rank. Two all-reduces forward and two backward per
layer. The embedding is vocabulary-parallel; the head is column-parallel with its logits gathered, so
the loss is computed on full logits identically on every tp rank. Norm gains (and learned positions)
stay replicated: their inputs, hence their gradients, are identical on every tp rank.

Why not DTensor's `parallelize_module` (the default in DESIGN.md): measured on this machine
(docs/tensor-parallel.md) it was 3x slower per step at tp=2 — it issues one backward all-reduce per
projection (q, k and v separately: 7 per layer instead of 4) and adds Python dispatch per op. It also
returned a Replicate gradient for the Shard(0) embedding, which norms over shards then double-count.

A sharded parameter carries `tp_dim` (the dimension it is split along); everything that reduces,
clips or gathers parameters reads that attribute.

Sequence parallelism (`apply_tp(..., sequence_parallel=True)`; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models"): between the tp-sharded matmuls — the norms, the
residual stream, the embedding's output, the messages between pipeline stages — each tp rank holds only
its 1/tp of the sequence (B, T/tp, d) instead of a full copy. `f` becomes an all-gather of the sequence
(its backward a reduce-scatter of the input gradient) and `g` a reduce-scatter (its backward an
all-gather): the same bytes as the two all-reduces they replace, since an all-reduce is a
reduce-scatter plus an all-gather. A replicated parameter (norm gain, row-parallel bias, learned
positions) then sees only this rank's tokens, so its gradient is a partial sum over tp
(dataparallel/grads.py `sync_sequence_parallel` sums it).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridpar.model.regather import BlockSaves
from hybridpar.model.stage import Stage
from hybridpar.topology.collectives import all_gather_single, reduce_scatter_single

# torch 2.11 (the GPU image's) traced g's autograd Function (an all-reduce into a fresh tensor) into a compiled
# layer's graph with no gradient reaching the layer's parameters: compiled tp 2 trained with every layer's
# gradient zero (aot_eager, measured). torch 2.13 traces f and g right (tests/test_equivalence.py). Before 2.13
# they run eagerly between the layer's graphs (`_collective`), as the zero-bubble split's linears do.
COLLECTIVES_IN_GRAPH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


@torch.compiler.disable
def _eager(fn: Any, *args: Any) -> torch.Tensor:
    return fn(*args)


def _collective(fn: Any, *args: Any) -> torch.Tensor:
    """fn(*args), f's or g's apply: inside a compiled layer's graph where this torch traces it right, else
    eagerly beside it (COLLECTIVES_IN_GRAPH)."""
    return fn(*args) if COLLECTIVES_IN_GRAPH else _eager(fn, *args)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: the input is used by every tp rank; their input gradients are partial sums."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.tp_f = group, True  # tp_f: the block's saved-tensor hooks look behind it (model/regather.py)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone() if torch.compiler.is_compiling() else g.contiguous()
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


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    # The collectives split and concatenate dimension 0: put the sequence there, (T, B, d).
    return x.transpose(0, 1).contiguous()


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T/n, ...) on each of the n ranks -> the whole (B, T, ...), ranks' slices in rank order."""
    xs = _seq_first(x)
    out = xs.new_empty((xs.shape[0] * dist.get_world_size(group), *xs.shape[1:]))
    all_gather_single(out, xs, group=group)
    # Contiguous: the projections that read it (q, k, v; gate, up) then save this one tensor for their
    # backward, where a strided view would have each flatten, and save, a copy of its own.
    return out.transpose(0, 1).contiguous()


def scatter_seq_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/n, ...) slice of their sum."""
    xs = _seq_first(x)
    out = xs.new_empty((xs.shape[0] // dist.get_world_size(group), *xs.shape[1:]))
    reduce_scatter_single(out, xs, group=group)
    return out.transpose(0, 1).contiguous()


class _GatherSeq(torch.autograd.Function):
    """Sequence-parallel f: every rank needs the whole sequence; its gradient is a partial sum whose
    rows belonging to each rank's slice are summed onto that rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.tp_f = group, True  # as _CopyToTP's
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return scatter_seq_sum(g, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """Sequence-parallel g: sum the ranks' partial outputs, each keeping its slice of the sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return scatter_seq_sum(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_seq(g.contiguous(), ctx.group), None


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

    def __init__(self, weight: torch.Tensor, lo: int, group: dist.ProcessGroup, reduce: Any) -> None:
        super().__init__()
        self.weight = weight
        self.lo, self.hi, self.group = lo, lo + weight.shape[0], group
        self.reduce = reduce  # g: _ReduceFromTP, or _ScatterSeq under sequence parallelism

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        h = F.embedding((ids - self.lo).masked_fill(outside, 0), self.weight)
        return self.reduce.apply(h.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class RowParallelLinear(nn.Linear):
    """y = g(x_r W_r^T) + b: this rank's slice of the input times its columns of the weight, summed over
    the tp ranks, then the (replicated) bias once. Still an nn.Linear, for the zero-bubble B/W split.

    `forward` is the local product only; g and the bias are a forward hook, so the zero-bubble capture
    (a hook put before it) sees the product and its gradient: under sequence parallelism g's output holds
    1/tp of the sequence, the product (and dW = g^T x) all of it."""

    def __init__(self, linear: nn.Linear, rank: int, n: int, group: dist.ProcessGroup, reduce: Any) -> None:
        nn.Module.__init__(self)  # the weight exists already: skip nn.Linear's allocation
        self.in_features, self.out_features = linear.in_features // n, linear.out_features
        self.weight = _shard(linear.weight, 1, rank, n)
        self.register_parameter("bias", linear.bias)
        self.group, self.reduce = group, reduce
        self.register_forward_hook(RowParallelLinear._sum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    @staticmethod
    def _sum(mod: RowParallelLinear, args: tuple, partial: torch.Tensor) -> torch.Tensor:
        y = _collective(mod.reduce.apply, partial, mod.group)
        return y if mod.bias is None else y + mod.bias


def _shard(p: nn.Parameter, dim: int, rank: int, n: int) -> nn.Parameter:
    local = nn.Parameter(p.detach().chunk(n, dim=dim)[rank].clone())
    local.tp_dim = dim  # type: ignore[attr-defined]
    return local


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent), attr, new)


def apply_tp(
    stage: Stage, group: dist.ProcessGroup | None, sequence_parallel: bool = False, sp_backward: str = "saved"
) -> Stage:
    """Shard `stage` in place over the tp `group` following its family's TP_PLAN. A no-op without tp.
    `sequence_parallel`: the regions between the sharded matmuls hold 1/tp of the sequence (module doc);
    `sp_backward`: "regather" keeps only the 1/tp slice of their gathered inputs (model/regather.py).
    Without tp too: each block gets its saved-tensor hooks (model/regather.py), which rebuild what they can."""
    install_saves(stage)
    if group is None or dist.get_world_size(group) == 1:
        return stage
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    f, g = (_GatherSeq, _ScatterSeq) if sequence_parallel else (_CopyToTP, _ReduceFromTP)
    if sequence_parallel:
        stage.seq_rank, stage.seq_shards = rank, n
    for name, mod in list(stage.named_modules()):
        style = next((s for pat, s in stage.TP_PLAN.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style in ("colwise", "colwise_gather"):
            mod.weight = _shard(mod.weight, 0, rank, n)
            if mod.bias is not None:
                mod.bias = _shard(mod.bias, 0, rank, n)
        if style in ("copy_in", "colwise_gather"):
            mod.register_forward_pre_hook(lambda m, args: (_collective(f.apply, args[0], group), *args[1:]))
        if style == "colwise_gather":
            mod.register_forward_hook(lambda m, args, out: _GatherLastDim.apply(out, group))
        elif style == "rowwise":
            _replace(stage, name, RowParallelLinear(mod, rank, n, group, g))
        elif style == "vocab":
            w = _shard(mod.weight, 0, rank, n)
            _replace(stage, name, VocabParallelEmbedding(w, rank * w.shape[0], group, g))
    if sequence_parallel and sp_backward == "regather":
        _regather(stage, group)
    stage.tie_()  # embedding and head are the same row shard: re-tie
    return stage


def _blocks(stage: Stage) -> list[nn.Module]:
    """Each block whose input f gathers or copies (TP_PLAN's copy_in): its column-parallel layers read it."""
    return [
        mod
        for name, mod in stage.named_modules()
        if next((s for p, s in stage.TP_PLAN.items() if fnmatch.fnmatchcase(name, p)), None) == "copy_in"
    ]


def install_saves(stage: Stage) -> None:
    """Each block's saved-tensor hooks (model/regather.py: the re-gather, the rebuilds), once per block."""
    for block in _blocks(stage):
        if not isinstance(getattr(block, "saves", None), BlockSaves):
            block.saves = BlockSaves(stage)


def _regather(stage: Stage, group: dist.ProcessGroup) -> None:
    """Each block whose input f gathers keeps its column-parallel layers' 1/tp slice (model/regather.py);
    `stage.sp_regather` switches it (the runtime turns it off where a zero-bubble W keeps the input)."""
    for block in _blocks(stage):
        block.saves.set_group(group)
    stage.sp_regather, stage.sp_backward = True, "regather"


def rebind_regather(stage: Stage) -> None:
    """Point the re-gathers of `stage`'s blocks at it: a layer moved here by a live re-partition (built apart,
    or from another of this rank's stages) then follows this stage's recomputation and split backward."""
    for mod in stage.modules():
        r = getattr(mod, "saves", None)
        if isinstance(r, BlockSaves):
            r.stage = stage


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


def tp_dims(stage: Stage) -> dict[str, int | None]:
    """{parameter name: the dimension `apply_tp` shards it along (None: replicated)}, read from the
    stage's plan without sharding anything (a meta-device stage will do): the memory model's shapes."""
    out: dict[str, int | None] = {}
    for name, mod in stage.named_modules():
        style = next((s for pat, s in stage.TP_PLAN.items() if fnmatch.fnmatchcase(name, pat)), None)
        for attr, p in mod.named_parameters(recurse=False):
            dim = {"colwise": 0, "colwise_gather": 0, "vocab": 0, "rowwise": 1 if attr == "weight" else None}
            out[f"{name}.{attr}" if name else attr] = dim.get(style)
    return out

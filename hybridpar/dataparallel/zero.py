"""ZeRO-1 and ZeRO-2 over the data-parallel axis (`--parallel.zero 1` / `2`): each dp rank keeps the AdamW
state of 1/dp of every parameter it holds, steps that slice, and the ranks all-gather the updated slices.
ZeRO-2 also keeps only that slice of each gradient once the step's reduce-scatters are done (grads.py's
finish() calls `keep_slice` parameter by parameter): the whole gradients still exist while the microbatches
of the step accumulate into them (reduced once per step), and from the reduction to the next step's
backward each rank holds its 1/dp slices — through clipping and the optimizer step.

Slicing: a parameter (its tp shard, under tensor parallelism) is cut along its first dimension, which
is contiguous in its storage whatever tensor parallelism shards: each dp rank holds n // dp rows, and dp
rank 0 also the n % dp rows left over, ahead of its share (Megatron's distributed optimizer cuts the flat
buffer likewise). So every slice is one block of the storage and of the whole tensor, and its optimizer
state is the same block of the full AdamW state. A parameter with fewer rows than dp ranks lives on rank
0 alone (the others' slices are empty).

Each slice is stepped in place by plain `torch.optim.AdamW`: the tensor it steps is a view of the
parameter's own storage (no shadow copy), with the decay group of the parameter it comes from. AdamW is
elementwise, so the slices together take the very step the whole parameter would. Gradients arrive
reduce-scattered (grads.py, bucketed and overlapped with the backward as without ZeRO): this rank's
slice of each gradient holds the sum over dp, the rest does not, and only the slice (a view) is read
here. Reduce-scatter plus the all-gather of parameters move the bytes of the one all-reduce that plain
data parallelism does.

Both collectives work inside the tensors themselves, with no buffer of ours: the reduce-scatter reads
the gradient's equal rows and writes this rank's share of them, the all-gather reads this rank's share
of the parameter and writes the equal rows (NCCL's in-place forms); the left-over rows are reduced to and
broadcast from dp rank 0. An output inside its own input is safe on gloo too (torch 2.13's
ProcessGroupGloo): its reduce-scatter clones each input as the collective is issued, all-reduces the clone
and copies this rank's chunk into the output only when the work is waited for (on the waiting thread); its
all-gather copies its input into a buffer of its own before it writes any output. Each work holds its
tensors, and ZeRO-3 frees a parameter's storage only after its gather's works are waited for (zero3.py).
On gloo the shares are all-gathered one tensor at a time, never through its coalesced all-gather, which
corrupts the heap of a rank that computes while one is in flight (`_gather_shares`). (Cutting a column-parallel
weight along its columns, as this module once did, put each slice in dp strided pieces that went
through padded flat buffers: at dp 64 about the whole tensors again, for the step's all-gather and the
gradients' reduce-scatter.)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.config import TrainConfig
from hybridpar.model.optim import adamw_options, lr_at, param_groups
from hybridpar.topology.collectives import all_gather_single
from hybridpar.topology.mesh import Topology


@dataclass(frozen=True)
class Slice:
    dim: int | None  # None: not sliced (every dp rank holds the whole state)
    offsets: tuple[int, ...]  # start of each dp rank's rows along `dim` (0: the first dimension)
    sizes: tuple[int, ...]  # rows each dp rank holds (0: empty)


def slice_of(shape: torch.Size, tp_dim: int | None, dp: int) -> Slice:
    """How one parameter (its tp-local shape) is cut among dp ranks: along the local tensor's first
    dimension, whichever dimension tensor parallelism shards (`tp_dim` does not change the cut: a tp shard
    is a tensor of its own, contiguous). Every rank gets n // dp rows and rank 0 also the n % dp rows left
    over, first, so that each slice is one block of the storage and the other rows split equally."""
    if dp == 1 or len(shape) == 0:
        return Slice(None, (0,) * dp, (0,) * dp)
    share, left = divmod(shape[0], dp)
    return Slice(0, (0,) + tuple(left + r * share for r in range(1, dp)), (share + left,) + (share,) * (dp - 1))


def part(p: torch.Tensor, s: Slice, r: int) -> torch.Tensor:
    """dp rank r's slice of `p` (a view)."""
    return p if s.dim is None else p.narrow(s.dim, s.offsets[r], s.sizes[r])


def left_over(s: Slice) -> int:
    """Rows dp rank 0 holds beyond the equal share (the first rows of the tensor)."""
    return 0 if s.dim is None else s.sizes[0] - s.sizes[-1]


def equal_rows(p: torch.Tensor, s: Slice) -> torch.Tensor:
    """The flat view of the rows after the left-over ones: every dp rank's equal share, in rank order."""
    return p.narrow(0, left_over(s), p.shape[0] - left_over(s)).view(-1)


def share(mine: torch.Tensor, s: Slice, r: int) -> torch.Tensor:
    """The flat equal share inside dp rank r's slice `mine` (rank 0's follows its left-over rows)."""
    return mine.narrow(0, left_over(s) if r == 0 else 0, s.sizes[-1]).view(-1)


def summed_grad(p: torch.Tensor, s: Slice, r: int) -> torch.Tensor | None:
    """dp rank r's summed slice of p's gradient: the slice ZeRO-2 kept (`p.grad_slice`, its own tensor,
    the whole gradient freed), else the view of the whole gradient where the reduce-scatter left it."""
    kept = getattr(p, "grad_slice", None)
    if kept is not None:
        return kept
    return None if p.grad is None else part(p.grad, s, r)


def keep_slice(p: torch.Tensor, s: Slice, r: int) -> None:
    """ZeRO-2: once p's gradient is reduce-scattered, keep rank r's summed slice in a tensor of its own
    (`p.grad_slice`, Megatron's `main_grad` idea: `.grad` must keep the parameter's shape) and free the
    whole gradient. Not sliced (s.dim None): the whole gradient is this rank's part and stays."""
    if s.dim is not None and p.grad is not None:
        p.grad_slice = part(p.grad, s, r).clone()
        p.grad = None


def start_gather(pieces: list[tuple[torch.Tensor, torch.Tensor, Slice]], r: int, group: Any) -> list[dist.Work]:
    """Start gathering every dp rank's slices into whole tensors, in place (no buffer of ours): `pieces` are
    (whole tensor, this rank's slice of it — a view of it, or a tensor of its own —, the cut). The equal
    shares are all-gathered (`_gather_shares`) into the tensor's rows after the left-over ones (each rank's
    share already sits where it belongs: NCCL's in-place form); the left-over rows are broadcast from dp
    rank 0. Returns the works to wait for."""
    even = [x for x in pieces if x[2].sizes[-1]]
    works = _gather_shares(even, r, group) if even else []
    for whole, mine, s in pieces:
        if left_over(s):
            rows = whole.narrow(0, 0, left_over(s))
            if r == 0 and mine.data_ptr() != whole.data_ptr():
                rows.copy_(mine.narrow(0, 0, left_over(s)))
            works.append(dist.broadcast(rows, group=group, async_op=True, group_src=0))
    return works


def _gather_shares(even: list[tuple[torch.Tensor, torch.Tensor, Slice]], r: int, group: Any) -> list[dist.Work]:
    """Start the all-gathers of the equal shares: one coalesced call (NCCL), or on gloo one all-gather per
    tensor. gloo's coalesced all-gather (torch 2.13's AsyncAllgatherCoalescedWork) corrupts the heap of a
    rank that computes while one is in flight, as ZeRO-3's prefetch does: a stress of in-place gathers with
    a prefetch in flight (the CI failure's "malloc(): unaligned tcache chunk detected", aborting in a gloo
    worker thread as it allocated) failed 11 of 127 runs so, 0 of 105 with one all-gather per tensor."""
    if dist.get_backend(group) == "gloo":
        return [
            all_gather_single(equal_rows(whole, s), share(mine, s, r), group=group, async_op=True)
            for whole, mine, s in even
        ]
    with dist._coalescing_manager(group, async_ops=True) as cm:
        for whole, mine, s in even:
            all_gather_single(equal_rows(whole, s), share(mine, s, r), group=group)
    return cm.works


class ShardedAdamW(torch.optim.AdamW):
    """AdamW over this dp rank's slices of `named` (stage-qualified name, parameter), each a view of its
    parameter; `step()` steps them in place and all-gathers the parameters over dp (collective)."""

    def __init__(
        self,
        named: Iterable[tuple[str, nn.Parameter]],
        t: TrainConfig,
        topo: Topology,
        carry: dict[torch.Tensor, dict[str, torch.Tensor]] | None = None,
        own: bool = False,
        given: dict[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.topo, self.dp, self.r = topo, topo.dims.dp, topo.dp_rank
        # ZeRO-3 (zero3.py): each slice is a tensor of its own, the parameters' storages are freed, and a
        # step leaves the parameters sharded (no all-gather: zero3.Zero3 gathers them where they are used).
        # `given`: ZeRO-3's slices by parameter, when the parameters are empty (after a layer move,
        # balance/migrate.py); `carry` then holds the slices' state, which `load_full_state` keeps as is.
        self.own = own
        self.group = topo.group("dp") if self.dp > 1 else None
        self.full: list[nn.Parameter] = []  # the model's parameters, in order
        self.slices: list[Slice] = []
        self.views: list[nn.Parameter] = []  # this rank's slice of each (a view of its storage), stepped by AdamW
        for name, p in named:
            s = slice_of(p.shape, getattr(p, "tp_dim", None), self.dp)
            self.full.append(p)
            self.slices.append(s)
            self.views.append(self._view(p, s, given))
        # ZeRO-3: what the gathers of each parameter read at rest (zero3.Zero3): the slice AdamW steps, or
        # under bf16 working copies (copies.py) a bf16 slice rounded from it
        self.kept: list[torch.Tensor] = list(self.views)
        groups = param_groups([(f"{i}", q) for i, q in enumerate(self.views)], t.weight_decay)
        fast = adamw_options(t, self.views[0].device) if self.views else {}
        super().__init__(groups, lr=lr_at(0, t), betas=(t.beta1, t.beta2), eps=t.eps, **fast)
        if carry is not None:
            self.load_full_state(carry)

    def _view(self, p: nn.Parameter, s: Slice, given: dict[torch.Tensor, torch.Tensor] | None) -> nn.Parameter:
        """The tensor AdamW steps for p: this rank's slice of it (a view, or under ZeRO-3 a tensor of its own).
        Keeps `ndim` (narrow does), so param_groups puts the slice in its parameter's decay group."""
        if s.dim is None:
            return p
        if given is not None:
            return nn.Parameter(given[p].detach())
        mine = part(p.detach(), s, self.r)
        return nn.Parameter(mine.clone() if self.own else mine)

    def step(self, closure: Any = None) -> Any:
        for p, s, q in zip(self.full, self.slices, self.views):
            if q is not p:  # the summed slice of the gradient (ZeRO-2's kept slice, or a view of .grad)
                q.grad = summed_grad(p, s, self.r)
        out = super().step(closure)
        if not self.own:
            self._gather()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.full:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)
            p.grad_slice = None  # ZeRO-2's slice: made anew by each step's reduction

    @torch.no_grad()
    def _gather(self) -> None:
        """Every rank's updated slices into every rank's parameters, in place (`start_gather`)."""
        if self.group is None:
            return
        cut = [(p.detach(), s) for p, s in zip(self.full, self.slices) if s.dim is not None]
        pieces = [(p, part(p, s, self.r), s) for p, s in cut]
        for work in start_gather(pieces, self.r, self.group):
            work.wait(timedelta(seconds=self.topo.timeout_s))

    def local_state(self) -> dict[torch.Tensor, tuple[dict[str, torch.Tensor], Slice]]:
        """This rank's AdamW state of each model parameter (that of its slice), with the slice it covers."""
        return {p: (self.state[q], s) for p, s, q in zip(self.full, self.slices, self.views)}

    @torch.no_grad()
    def gather_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Collective over dp: the whole AdamW state of every parameter, keyed by the model's parameter
        (for checkpoints and layer moves, which work on whole parameters)."""
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for p, s, q in zip(self.full, self.slices, self.views):
            st = self.state[q]
            full: dict[str, torch.Tensor] = {}
            pieces = []
            for k in sorted(st):
                v = st[k]
                if s.dim is None or v.shape != q.shape:
                    full[k] = v.clone()  # whole already (or the step counter, the same on every rank)
                    continue
                full[k] = torch.empty(p.shape, dtype=v.dtype, device=v.device)
                pieces.append((full[k], v, s))
            if pieces:
                for work in start_gather(pieces, self.r, self.group):
                    work.wait(timedelta(seconds=self.topo.timeout_s))
            out[p] = full
        return out

    @torch.no_grad()
    def load_full_state(self, full: dict[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        """Keep this rank's slice of each parameter's whole state (no communication)."""
        for p, s, q in zip(self.full, self.slices, self.views):
            if not full.get(p):
                continue
            self.state[q] = {
                k: (part(v, s, self.r).clone() if v.shape == p.shape else v.clone()) for k, v in full[p].items()
            }


def full_optimizer_state(opt: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """Whole AdamW state by parameter (collective over dp under ZeRO-1: the slices are gathered)."""
    return opt.gather_state() if isinstance(opt, ShardedAdamW) else opt.state

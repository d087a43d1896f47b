"""ZeRO-1 and ZeRO-2 over the data-parallel axis (`--parallel.zero 1` / `2`): each dp rank keeps the AdamW
state of 1/dp of every parameter it holds, steps that slice, and the ranks all-gather the updated slices.
ZeRO-2 also keeps only that slice of each gradient once the step's reduce-scatters are done (grads.py's
finish() calls `keep_slice` parameter by parameter): the whole gradients still exist while the microbatches
of the step accumulate into them (reduced once per step), and from the reduction to the next step's
backward each rank holds its 1/dp slices — through clipping and the optimizer step.

Slicing: a parameter is cut along one dimension into dp chunks with torch.chunk's rule (ceil-sized
chunks, the last ones smaller or empty), along its first dimension that tensor parallelism does not
shard — so a slice of a tp shard is a block of rows or columns, and its optimizer state is the same
block of the full AdamW state. A parameter whose only dimension is tp-sharded (a column-parallel bias)
keeps its whole state on every dp rank: it is a few hundred numbers.

Each slice is stepped in place by plain `torch.optim.AdamW`: the tensor it steps is a view of the
parameter's own storage (no shadow copy), with the decay group of the parameter it comes from. AdamW is
elementwise, so the slices together take the very step the whole parameter would. Gradients arrive
reduce-scattered (grads.py, bucketed and overlapped with the backward as without ZeRO): this rank's
slice of each gradient holds the sum over dp, the rest does not, and only the slice (a view) is read
here. Reduce-scatter plus the all-gather of parameters move the bytes of the one all-reduce that plain
data parallelism does.

Where a parameter's dp slices are equal and contiguous in its storage (`in_place`: cut along its first
dimension, which every parameter is unless tensor parallelism shards that dimension), both collectives
work inside the tensors themselves: the reduce-scatter reads the whole gradient and writes this rank's
slice of it, the all-gather reads this rank's slice of the parameter and writes the whole parameter
(NCCL's in-place forms; gloo stages through its own buffers). Only the others (column slices of
tp-sharded rows, uneven chunks) go through padded flat buffers of ours.
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
from hybridpar.topology.mesh import Topology


@dataclass(frozen=True)
class Slice:
    dim: int | None  # None: not sliced (every dp rank holds the whole state)
    offsets: tuple[int, ...]  # start of each dp rank's chunk along `dim`
    sizes: tuple[int, ...]  # length of each dp rank's chunk (0: empty)


def slice_of(shape: torch.Size, tp_dim: int | None, dp: int) -> Slice:
    """How one parameter (its tp-local shape) is cut among dp ranks: torch.chunk's rule along the first
    dimension that tensor parallelism does not shard."""
    free = [d for d in range(len(shape)) if d != tp_dim]
    if dp == 1 or not free:
        return Slice(None, (0,) * dp, (0,) * dp)
    dim = free[0]
    n = shape[dim]
    chunk = -(-n // dp)
    offsets = tuple(min(n, r * chunk) for r in range(dp))
    sizes = tuple(min(n, o + chunk) - o for o in offsets)
    return Slice(dim, offsets, sizes)


def part(p: torch.Tensor, s: Slice, r: int) -> torch.Tensor:
    """dp rank r's slice of `p` (a view)."""
    return p if s.dim is None else p.narrow(s.dim, s.offsets[r], s.sizes[r])


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


def in_place(shape: torch.Size | tuple[int, ...], s: Slice) -> bool:
    """Whether the dp slices of a tensor of `shape` lie one after another in its storage, equally long:
    then the flat tensor is the all-gather of its slices and the reduce-scatter's input, in place."""
    lead = 1
    for x in shape[: s.dim or 0]:
        lead *= x
    return s.dim is not None and lead == 1 and len(set(s.sizes)) == 1


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
        self.gather_bytes = 0  # bytes of the last step's padded all-gather buffers (memory accounting)
        for name, p in named:
            s = slice_of(p.shape, getattr(p, "tp_dim", None), self.dp)
            self.full.append(p)
            self.slices.append(s)
            self.views.append(self._view(p, s, given))
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
        """Every rank's updated slices into every rank's parameters: one coalesced in-place all-gather
        per parameter whose slices allow it, one flat padded all-gather for the others."""
        self.gather_bytes = 0
        if self.group is None:
            return
        timeout = timedelta(seconds=self.topo.timeout_s)
        flat = [(p.detach(), s) for p, s in zip(self.full, self.slices) if in_place(p.shape, s)]
        if flat:
            with dist._coalescing_manager(self.group, async_ops=True) as cm:
                for p, s in flat:
                    dist.all_gather_single(p.view(-1), part(p, s, self.r).reshape(-1), group=self.group)
            for work in cm.works:
                work.wait(timeout)
        rest = [(p, s) for p, s in zip(self.full, self.slices) if s.dim is not None and not in_place(p.shape, s)]
        if not rest:
            return
        seg = [sum(part(p, s, r).numel() for p, s in rest) for r in range(self.dp)]
        mine = torch.zeros(max(seg), dtype=rest[0][0].dtype, device=rest[0][0].device)
        torch.cat([part(p, s, self.r).reshape(-1) for p, s in rest], out=mine[: seg[self.r]])
        outs = [torch.empty_like(mine) for _ in range(self.dp)]
        self.gather_bytes = (1 + self.dp) * mine.numel() * mine.element_size()
        dist.all_gather(outs, mine, group=self.group, async_op=True).wait(timeout)
        for r, buf in enumerate(outs):
            at = 0
            for p, s in rest:
                piece = part(p, s, r)
                piece.copy_(buf[at : at + piece.numel()].view(piece.shape))
                at += piece.numel()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds, counted from its tensors."""
        return sum(
            v.numel() * v.element_size() for st in self.state.values() for v in st.values() if torch.is_tensor(v)
        )

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
            for k in sorted(st):
                v = st[k]
                if s.dim is None or v.shape != q.shape:
                    full[k] = v.clone()  # whole already (or the step counter, the same on every rank)
                    continue
                whole = torch.empty(p.shape, dtype=v.dtype, device=v.device)
                self._gather_one(whole, v, s)
                full[k] = whole
            out[p] = full
        return out

    def _gather_one(self, whole: torch.Tensor, mine: torch.Tensor, s: Slice) -> None:
        width = max(s.sizes) * (whole.numel() // whole.shape[s.dim])
        pad = torch.zeros(width, dtype=mine.dtype, device=mine.device)
        pad[: mine.numel()] = mine.reshape(-1)
        outs = [torch.empty_like(pad) for _ in range(self.dp)]
        dist.all_gather(outs, pad, group=self.group, async_op=True).wait(timedelta(seconds=self.topo.timeout_s))
        for r, buf in enumerate(outs):
            piece = part(whole, s, r)
            piece.copy_(buf[: piece.numel()].view(piece.shape))

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

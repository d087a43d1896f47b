"""Gradients summed in one fixed binary tree over the step's microbatches (`parallel.grad_sum tree`), so
that the sum, bit for bit, does not depend on how the microbatches are spread over data-parallel
replicas.

Floating-point addition is commutative but not associative: the default path (grads.py) accumulates a
replica's microbatches in order, ((u0 + u1) + u2) + u3, and all-reduces the replicas' sums in whatever
order the collective picks, so a run at dp 2 and the same run at dp 4 end a few ulps apart. Here the
step's U = dp x m microbatch gradients (replica r holds microbatches r·m … r·m + m − 1: the data loader
gives each replica a contiguous block) are summed as the balanced tree over U leaves:

- inside a replica, each microbatch's gradient is taken from `p.grad` by a post-accumulate hook and
  merged like a binary counter (two partial sums of equal height are added, the earlier first), which
  with m a power of two leaves exactly the subtree over the replica's block, at a cost of at most
  log2(m) gradients held beside the one being computed;
- across replicas, recursive doubling: at level l each replica exchanges its partial sum with the
  replica r XOR 2^l and adds — a + b equals b + a bit for bit, so both ends hold the same node of the
  tree, and after log2(dp) levels every replica holds the root.

With dp and m powers of two, the tree over U leaves is the same whichever (dp, m) with dp x m = U runs
it, so a checkpoint resumed at another dp (dp x microbatches and the global batch kept) continues the
uninterrupted run's exact trajectory. The price: no overlap with the backward (the exchanges follow
it), log2(dp) full-size exchanges instead of one all-reduce. The rules it needs (powers of two, equal
microbatches, weight gradients accumulated by autograd) are checked before launch (config/validate.py).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hybridpar.model.stage import Stage
from hybridpar.topology.mesh import Topology


class TreeGrads:
    """The data-parallel reducer of `parallel.grad_sum tree` (same interface as DataParallelGrads)."""

    slices = None  # gradients are summed whole
    overlapped = 0  # nothing is reduced during the backward

    def __init__(self, topo: Topology, stages: dict[int, Stage], bucket_bytes: int = 4 << 20) -> None:
        self.topo, self.stages, self.bucket_bytes = topo, stages, bucket_bytes
        self.m: int | None = None  # set by the step; unused (the counter needs no count)
        self.peak_bytes = 0  # the receive buffer of the largest exchange, plus the counter's partial sums
        self._partial: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._held = 0
        self._params = [p for st in stages.values() for p in st.parameters()]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def _on_grad(self, p: torch.Tensor) -> None:
        """One microbatch's gradient of `p` is complete: merge it into the binary counter."""
        g, height = p.grad, 0
        p.grad = None  # the next microbatch accumulates into a fresh tensor
        stack = self._partial.setdefault(id(p), [])
        while stack and stack[-1][0] == height:
            _, earlier = stack.pop()
            g, height = earlier.add_(g), height + 1
        stack.append((height, g))
        self._held = max(self._held, sum(t.numel() * t.element_size() for _, t in stack[:-1]))

    def stage_done(self, s: int) -> None:
        pass  # the exchanges wait for every stage: they follow the backward

    def finish(self) -> None:
        for p in self._params:
            stack = self._partial.pop(id(p), [])
            if not stack:
                continue
            total = stack.pop()[1]
            while stack:  # m not a power of two (dp = 1 only, see validate.py): still one fixed order
                total = stack.pop()[1].add_(total)
            p.grad = total
        dp = self.topo.dims.dp
        grads = [p.grad for p in self._params if p.grad is not None]
        widest = 0
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            level = 1
            while level < dp:
                self._exchange_add(flat, self.topo.dp_rank ^ level)
                level <<= 1
            for g, piece in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(piece.view_as(g))
            widest = max(widest, flat.numel() * flat.element_size())
        self.peak_bytes = self._held + (2 * widest if dp > 1 else 0)
        self._held = 0

    def _exchange_add(self, flat: torch.Tensor, peer_dp: int) -> None:
        other = torch.empty_like(flat)
        peer = self.topo.dims.moved(self.topo.rank, dp=peer_dp)
        ops = [dist.P2POp(dist.isend, flat, peer), dist.P2POp(dist.irecv, other, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait(timedelta(seconds=self.topo.timeout_s))
        flat.add_(other)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _buckets(grads: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if size >= limit:
            out.append([])
            size = 0
        out[-1].append(g)
        size += g.numel() * g.element_size()
    return [b for b in out if b]

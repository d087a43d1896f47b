"""Gradient reductions across the mesh: data-parallel sum (overlapped with the pipeline's backward),
embedding/head tie across pipeline stages, and the global gradient norm for clipping.

Losses are pre-scaled by 1 / (tokens in the global batch), so the data-parallel reduction is a plain
SUM: replicas holding unequal numbers of tokens still yield exactly the gradient of the global token
mean, which a mean over replicas would not.

Under ZeRO-1 (zero.py) a rank steps only its slice of each parameter, so it needs only that slice of the
summed gradient: buckets are reduce-scattered instead of all-reduced, half the bytes of an all-reduce,
and with the optimizer's all-gather of parameters the step moves what plain data parallelism moves. A
gradient is then summed only on the rank's slice (the rest holds this replica's own contribution):
the norm for clipping is taken over the slices (`clip_grad_norm(..., slices)`). Under ZeRO-2 each
gradient's slice is then kept in a tensor of its own and the whole gradient freed (zero.keep_slice).
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.dataparallel.zero import Slice, equal_rows, keep_slice, left_over, part, share, slice_of, summed_grad
from hybridpar.model.stage import Stage
from hybridpar.model.tp import is_sharded
from hybridpar.topology.collectives import reduce_scatter_single
from hybridpar.topology.mesh import Topology

BUCKET_BYTES = 4 << 20  # about this many gradient bytes per data-parallel bucket


class DataParallelGrads:
    """Bucketed all-reduce of gradients over dp, overlapped with the backward (as DDP does).

    Each stage's parameters are grouped, in reverse definition order (the order backward produces
    them), into buckets of about `bucket_bytes`. A parameter's gradient is final once its
    post-accumulate hook has fired for every microbatch; a bucket whose gradients are all final starts
    its async all-reduce at once, while earlier layers are still in backward. Whatever a hook cannot
    see — gradients written outside autograd's accumulation, as the zero-bubble W actions do — is
    reduced when the runtime reports the stage done. `finish()` waits and writes the sums back.

    `sharded` (ZeRO-1): reduce-scatter each bucket so that this rank receives the sum of its own slices
    (`slices`, zero.slice_of's cut), in place in each gradient (no flat copy: a sliced bucket holds no
    buffer of ours); parameters that are not sliced (none, at dp > 1) are all-reduced whole.
    `keep_slices` (ZeRO-2): `finish()` then keeps each summed slice and frees the whole gradient."""

    def __init__(
        self,
        topo: Topology,
        stages: dict[int, Stage],
        microbatches: int | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        sharded: bool = False,
        keep_slices: bool = False,
    ) -> None:
        self.topo, self.stages, self.m = topo, stages, microbatches
        # Context-parallel peers hold the same parameters and each a part of every sequence's gradient:
        # summed over dp x cp at once, or (ZeRO, whose slices are cut over dp) over cp first.
        self.group = topo.group("dp_cp") if topo.dims.dp * topo.dims.cp > 1 else None
        self.cp_group = topo.group("cp") if sharded and topo.dims.cp > 1 else None
        if self.cp_group is not None:
            self.group = topo.group("dp")
        self.slices: dict[int, Slice] | None = None
        self.keep_slices = keep_slices and sharded
        self.whole_bytes = 0  # ZeRO-2: bytes of the whole gradients finish() freed (their peak, held.py)
        if sharded:
            dp = topo.dims.dp
            ps = [p for st in stages.values() for p in st.parameters()]
            self.slices = {id(p): slice_of(p.shape, getattr(p, "tp_dim", None), dp) for p in ps}
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
        self._in_place: list[dist.Work] = []
        self._buckets: dict[int, list[list[nn.Parameter]]] = {}
        self._bucket_of: dict[int, tuple[int, int]] = {}
        self._fired: dict[int, int] = {}
        self._ready: dict[tuple[int, int], int] = {}
        self._launched: set[tuple[int, int]] = set()
        self.overlapped = 0  # buckets whose reduction started from a hook, i.e. during backward
        self.handed = {"all_reduce": 0, "reduce_scatter": 0}  # gradient elements given to each collective
        self.peak_bytes = 0  # most bytes of flattened buckets in flight at once (memory accounting)
        self._in_flight = 0
        self._hooks: list = []  # removed by close(), when the stages change (live re-partition)
        if self.group is None:
            return
        for s, stage in stages.items():
            buckets: list[list[nn.Parameter]] = [[]]
            size = 0
            for p in reversed(list(stage.parameters())):
                if size >= bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append(p)
                size += p.numel() * p.element_size()
                self._bucket_of[id(p)] = (s, len(buckets) - 1)
                if microbatches:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
            self._buckets[s] = buckets

    def _on_grad(self, p: torch.Tensor) -> None:
        n = self._fired.get(id(p), 0) + 1
        self._fired[id(p)] = n
        if n == self.m:
            key = self._bucket_of[id(p)]
            self._ready[key] = self._ready.get(key, 0) + 1
            if self._ready[key] == len(self._buckets[key[0]][key[1]]):
                self._launch(key)
                self.overlapped += 1

    def _launch(self, key: tuple[int, int]) -> None:
        self._launched.add(key)
        params = self._buckets[key[0]][key[1]]
        if self.cp_group is not None:  # the cp sum first (blocking: the dp reduce-scatter reads it)
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.cp_group, async_op=True).wait(timedelta(seconds=self.topo.timeout_s))
            _unflatten(flat, grads)
        if self.slices is not None:
            cut = [(p.grad, self.slices[id(p)]) for p in params if self.slices[id(p)].dim is not None]
            params = [p for p in params if self.slices[id(p)].dim is None]
            if cut:
                self._scatter_in_place(cut)
        if params:
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.handed["all_reduce"] += flat.numel()
            self._pending.append((grads, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
            self._count(flat)

    def _scatter_in_place(self, cut: list[tuple[torch.Tensor, Slice]]) -> None:
        """Each gradient's equal rows reduce-scattered into this rank's share of them (one coalesced
        collective), its left-over rows reduced to dp rank 0 (zero.slice_of): in place, no buffer of ours."""
        r = self.topo.dp_rank
        even = [(g, s) for g, s in cut if s.sizes[-1]]
        if even:
            with dist._coalescing_manager(self.group, async_ops=True) as cm:
                for g, s in even:
                    reduce_scatter_single(share(part(g, s, r), s, r), equal_rows(g, s), group=self.group)
            self._in_place += cm.works
        for g, s in cut:
            if left_over(s):
                rows = g.narrow(0, 0, left_over(s))
                self._in_place.append(dist.reduce(rows, group=self.group, async_op=True, group_dst=0))
        self.handed["reduce_scatter"] += sum(g.numel() for g, _ in cut)

    def _count(self, flat: torch.Tensor) -> None:
        """Memory accounting: bucket buffers live from their launch until finish()."""
        self._in_flight += flat.numel() * flat.element_size()
        self.peak_bytes = max(self.peak_bytes, self._in_flight)

    def stage_done(self, s: int) -> None:
        if self.group is None:
            return
        for b in range(len(self._buckets[s])):
            if (s, b) not in self._launched:
                self._launch((s, b))

    def finish(self) -> None:
        timeout = timedelta(seconds=self.topo.timeout_s)
        for work in self._in_place:
            work.wait(timeout)
        for grads, flat, work in self._pending:
            work.wait(timeout)
            _unflatten(flat, grads)
        if self.keep_slices and self.group is not None:
            ps = [p for st in self.stages.values() for p in st.parameters() if p.grad is not None]
            self.whole_bytes = sum({p.grad.data_ptr(): p.grad.untyped_storage().nbytes() for p in ps}.values())
            for p in ps:  # one parameter at a time: at most one slice more than the whole gradients
                keep_slice(p, self.slices[id(p)], self.topo.dp_rank)
        self._pending.clear()
        self._in_place.clear()
        self._in_flight = 0
        self._fired.clear()
        self._ready.clear()
        self._launched.clear()

    def close(self) -> None:
        """Detach from the parameters (before the stages are rebuilt and a new reducer made)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class PlaneGrads:
    """Data-parallel reduction when replicas hold different pipeline partitions (after a live
    rebalance that moved layers in one replica only): a layer's copies then sit on different pipeline
    ranks, so its gradient is summed over the whole (dp x pp) plane of ranks sharing our tp rank.
    Each rank lays every layer's gradient out at a fixed offset of one flat buffer (zeros for layers
    it does not hold; adding zeros is exact) and all-reduces it once after the backward. The
    embedding, final norm and head never move: they are reduced over the dp group as usual."""

    def __init__(self, topo: Topology, stages: dict[int, Stage], n_layers: int, plane: dist.ProcessGroup) -> None:
        self.topo, self.stages, self.n_layers, self.plane = topo, stages, n_layers, plane
        self.dp_group = topo.group("dp")
        self.overlapped = 0
        self.slices = None  # gradients are summed whole (the optimizer is not sharded across the plane)
        self.peak_bytes = 0  # not counted for this rebalanced layout

    def stage_done(self, s: int) -> None:
        pass  # everything is reduced in finish(): the buffer spans layers of several stages

    def close(self) -> None:
        pass

    def finish(self) -> None:
        timeout = timedelta(seconds=self.topo.timeout_s)
        layer_grads: dict[int, list[torch.Tensor]] = {}
        other: list[torch.Tensor] = []
        for stage in self.stages.values():
            for i, layer in stage.layers.items():
                layer_grads[int(i)] = [p.grad for p in layer.parameters()]
            ids = {id(p) for layer in stage.layers.values() for p in layer.parameters()}
            other += [p.grad for p in stage.parameters() if id(p) not in ids]
        per_layer = sum(g.numel() for g in next(iter(layer_grads.values())))
        ref = next(iter(layer_grads.values()))[0]
        flat = torch.zeros(self.n_layers * per_layer, dtype=ref.dtype, device=ref.device)
        for i, grads in layer_grads.items():
            flat[i * per_layer : (i + 1) * per_layer] = torch.cat([g.reshape(-1) for g in grads])
        works = [(flat, dist.all_reduce(flat, group=self.plane, async_op=True))]
        if other:  # stage 0 and the last stage hold them in every replica: the dp group has them all
            rest = torch.cat([g.reshape(-1) for g in other])
            works.append((rest, dist.all_reduce(rest, group=self.dp_group, async_op=True)))
        for _, w in works:
            w.wait(timeout)
        for i, grads in layer_grads.items():
            _unflatten(flat[i * per_layer : (i + 1) * per_layer], grads)
        if other:
            _unflatten(works[1][0], other)


def _unflatten(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_tied_embeddings(topo: Topology, stages: dict[int, Stage], n_stages: int, kept: bool = False) -> int:
    """With tied embeddings split over pipeline stages, the first stage's embedding and the last stage's
    head are two copies of one weight: sum their gradients (Megatron's embedding group). Every pp rank
    takes part; ranks holding neither copy contribute zeros. `kept` (ZeRO-2): the copies are the kept
    dp slices (the two are cut alike), summed slice by slice. Returns the bytes of the buffer summed in."""
    first = stages.get(0)
    last = stages.get(n_stages - 1)
    cfg = next(iter(stages.values())).cfg
    if not (cfg.tied and topo.dims.pp > 1):
        return 0
    shape = torch.Size((cfg.vocab_size // topo.dims.tp, cfg.dim))
    mine = ([first.get_parameter(first.EMBED)] if first is not None else []) + (
        [last.get_parameter(last.HEAD)] if last is not None else []
    )
    copies = [p.grad_slice if kept else p.grad for p in mine]
    if kept:  # the embedding is vocab-sharded (dim 0) under tensor parallelism
        cut = slice_of(shape, 0 if topo.dims.tp > 1 else None, topo.dims.dp)
        shape = part(torch.empty(shape, device="meta"), cut, topo.dp_rank).shape
    grad = torch.zeros(shape, device=topo.device)
    for g in copies:
        grad += g
    dist.all_reduce(grad, group=topo.group("pp"))
    for g in copies:
        g.copy_(grad)
    return grad.numel() * grad.element_size()


def sync_sequence_parallel(topo: Topology, stages: dict[int, Stage]) -> int:
    """Under sequence parallelism a replicated parameter (norm gain, row-parallel bias, learned
    positions) saw only this tp rank's slice of the sequence: sum its gradient over tp (Megatron's
    all-reduce of the layernorm gradients). After the dp reduction, as sums commute; under ZeRO-2 the
    kept dp slice where the whole gradient was freed (cut alike on every tp rank). Returns the elements summed."""
    grads = [
        p.grad if p.grad is not None else getattr(p, "grad_slice", None)
        for st in stages.values()
        if st.seq_shards > 1
        for p in st.parameters()
        if not is_sharded(p)
    ]
    grads = [g for g in grads if g is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=topo.group("tp"))
    _unflatten(flat, grads)
    return flat.numel()


def clip_grad_norm(
    topo: Topology, stages: dict[int, Stage], max_norm: float, slices: dict[int, Slice] | None = None
) -> float:
    """Global L2 norm of the whole model's gradient (every parameter counted once: tp shards summed,
    replicated norm gains counted on tp rank 0 only, pipeline stages summed, dp replicas identical),
    then torch's clip rule: scale by min(1, max_norm / (norm + 1e-6)). max_norm <= 0: measure only.
    `slices` (reduce-scattered gradients, ZeRO-1 and 2): each dp rank holds the sum of its slice only, so
    each counts its slices (an unsliced parameter on dp rank 0) and the squares are summed over dp."""
    sq = torch.zeros((), dtype=torch.float64, device=topo.device)
    params: list[nn.Parameter] = []
    for stage in stages.values():
        for name, p in stage.named_parameters():
            params.append(p)
            if stage.stored_name(name) != name:
                continue  # the embedding's copy: counted on the first stage
            if not (is_sharded(p) or topo.tp_rank == 0):
                continue
            if slices is None:
                sq += p.grad.double().pow(2).sum()
            elif slices[id(p)].dim is not None:
                sq += summed_grad(p, slices[id(p)], topo.dp_rank).double().pow(2).sum()
            elif topo.dp_rank == 0:
                sq += p.grad.double().pow(2).sum()
    if slices is not None and topo.dims.dp > 1:
        dist.all_reduce(sq, group=topo.group("dp"))
    if topo.dims.tp > 1:
        dist.all_reduce(sq, group=topo.group("tp"))
    if topo.dims.pp > 1:
        dist.all_reduce(sq, group=topo.group("pp"))
    norm = math.sqrt(float(sq))
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in params:  # ZeRO-2: the whole gradient is freed, its kept slice scaled
                (p.grad if p.grad is not None else p.grad_slice).mul_(coef)
    return norm

"""The trainer of one process of a (dp, pp, tp) run: the bundles of trainer/build.py, the microbatch
policy and the load balancer, and the one step function that runs them.

Per step: the replica's share of the global batch is split into microbatches, the pipeline runtime
executes this rank's action list (data-parallel reductions start as each stage finishes its backward),
the tied embedding and the global gradient norm are reduced, and AdamW steps. After the step the
balancer may return a new layout; the trainer applies it (moving layers with their optimizer state),
rebuilds the data-parallel and optimizer bundles, and re-attaches whatever was attached to the old
ones (`attach`: the resilience probe, and the emulated devices of the testing modes, emulate/attach.py),
so hooks always sit on the objects the next step uses.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridpar.balance.live import LiveBalancer, cost_model, one_partition
from hybridpar.balance.migrate import default_layer_builder, move_layers
from hybridpar.balance.monitor import DeviceMonitor
from hybridpar.balance.repartition import Layout
from hybridpar.balance.restore import Restored, restored_layout
from hybridpar.batching.order import pipeline_order
from hybridpar.batching.policy import make_policy, plan_for
from hybridpar.batching.recompute import RecomputeChoice
from hybridpar.batching.split import BatchPlan, plan_batch
from hybridpar.config import Config
from hybridpar.data.mixture import open_data, val_sets
from hybridpar.dataparallel.grads import clip_grad_norm, sync_sequence_parallel, sync_tied_embeddings
from hybridpar.dataparallel.zero import ShardedAdamW, full_optimizer_state
from hybridpar.model.documents import DocumentMask, document_masks
from hybridpar.model.optim import lr_at, set_lr
from hybridpar.model.ring_attention import Ring, RingContext, shard_sequence
from hybridpar.pipeline.runtime import forward_actions
from hybridpar.pipeline.schedules import Action, build_schedule, stages_per_rank
from hybridpar.report.records import FIELDS, rank_summary, step_fields, unpack
from hybridpar.topology.mesh import Topology
from hybridpar.trainer.build import (
    build_data_parallel,
    build_model_parallel,
    build_optimizer,
    build_zero3,
    layer_partition,
)
from hybridpar.trainer.held import held_bytes

# Attaches hooks to a trainer's current pieces and returns the function that detaches them.
Attachment = Callable[["Trainer"], Callable[[], None]]


class Trainer:
    def __init__(self, cfg: Config, topo: Topology) -> None:
        self.cfg, self.topo = cfg, topo
        t = cfg.train
        self.data = open_data(cfg.data.path, cfg.data.max_tokens, t.seq_len, t.seed, cfg.data.val_fraction)
        if self.data.vocab_needed > cfg.model.vocab_size:
            raise ValueError(
                f"data.path holds token ids up to {self.data.vocab_needed - 1}: model.vocab_size="
                f"{cfg.model.vocab_size} must be at least {self.data.vocab_needed}"
            )
        self.parts = layer_partition(cfg)
        self.mp = build_model_parallel(cfg, topo, self.parts)
        self.monitor = DeviceMonitor(topo.device)
        sample = self.monitor.sample()
        policies = [
            make_policy(
                cfg, topo.dp_rank, memory_total_bytes=sample.memory_total_bytes, resident_bytes=sample.memory_used_bytes
            )
            for _ in range(1 + cfg.batching.try_recompute)
        ]
        b = cfg.batching
        self.policy = RecomputeChoice(*policies, b.switch_margin, b.warmup_steps) if b.try_recompute else policies[0]
        count = len(self.policy.propose(0))
        # Every replica's partition and share of the batch (parallel.replica_batch: the planner's uneven
        # split for unequal devices); changed only by the load balancer's decisions.
        shares = cfg.parallel.replica_batch or [sum(s) for s in plan_for(cfg, count).sizes]
        self.layout = Layout.uniform(self.parts, shares)
        self.plan: BatchPlan = self._plan(count)
        self.dp = build_data_parallel(cfg, topo, self.mp.stages, self.layout)
        self.opt = build_optimizer(cfg, topo, self.mp, self.layout)
        self.zero3 = build_zero3(cfg, topo, self.mp, self.opt)  # ZeRO-3: parameters sharded at rest
        self.balancer = LiveBalancer(cfg, topo) if cfg.balance.mode != "off" else None
        cp = cfg.parallel.cp  # context parallelism: this rank's chunks of every sequence, ring attention
        self.ring = Ring(topo.group("cp"), cp, topo.cp_rank, cfg.parallel.timeout_s) if cp > 1 else None
        self.memory: dict[str, int] = {}  # bytes held per component at the last step's peak (trainer/held.py)
        self.oom_retries = 0  # steps redone after running out of memory, over the run
        self.cost = cost_model(cfg)  # units of work per stage, so per-rank speeds compare (report/records.py)
        self.last_ranks: dict[str, list[float]] = {}  # every rank's summary of the last step (report/records.py)
        self._actions: dict[int, tuple[list[Action], list[Action]]] = {}  # microbatch count -> (train, eval)
        self._orders: dict[tuple[int, ...], list[int]] = {}  # planned sizes -> the order they run in
        self._attached: list[tuple[Attachment, Callable[[], None]]] = []
        # Fetched up front: a corpus too small for the validation set fails before any training step.
        # A mixture's sources each alone too (the record's val_loss_by_source).
        n_val, docs = t.val_batches * t.global_batch, cfg.data.document_mask
        self.val_set, self.val_sources = val_sets(self.data, n_val, docs) if t.val_every else (None, {})

    # The pieces others read, by their usual names.
    stages = property(lambda self: self.mp.stages)
    stage_ranks = property(lambda self: self.mp.stage_ranks)
    n_stages = property(lambda self: self.mp.n_stages)
    p2p = property(lambda self: self.mp.p2p)
    runtime = property(lambda self: self.mp.runtime)

    def attach(self, attachment: Attachment) -> None:
        """Attach hooks now, and again to the new pieces whenever a layout change rebuilds them."""
        self._attached.append((attachment, attachment(self)))

    def _reattach(self) -> None:
        for i, (attachment, detach) in enumerate(self._attached):
            detach()
            self._attached[i] = (attachment, attachment(self))

    def actions(self, count: int, train: bool = True) -> list[Action]:
        """This rank's action list for `count` microbatches (built once per count: adaptive plans vary it)."""
        if count not in self._actions:
            p = self.cfg.parallel
            acts = build_schedule(p.schedule, p.pp, stages_per_rank(p), count, p.recv_lookahead)[self.topo.pp_rank]
            self._actions[count] = (acts, forward_actions(acts))
        return self._actions[count][0 if train else 1]

    def _microbatches(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list, list]:
        """The replica's samples cut into the plan's microbatches, in the order the pipeline runs
        unequal ones fastest (batching/order.py; the same on every rank of the pipeline)."""
        planned = self.plan.sizes[self.topo.dp_rank]
        if planned not in self._orders:
            p = self.cfg.parallel
            self._orders[planned] = pipeline_order(planned, p.schedule, p.pp, stages_per_rank(p))
        sizes = self._orders[planned]
        if self.ring is not None:  # the loss is a sum over tokens: each cp rank sums its own
            x, y = (shard_sequence(t, self.ring.cp, self.ring.rank) for t in (x, y))
        xs = list(torch.split(x.to(self.topo.device), sizes))
        ys = list(torch.split(y.to(self.topo.device), sizes))
        return xs, ys

    def _masks(self, d: torch.Tensor | None) -> list[DocumentMask] | list[RingContext] | None:
        """Each microbatch's attention within documents (data.document_mask), split as the samples are;
        or under context parallelism its ring attention and positions."""
        sizes = self._orders[self.plan.sizes[self.topo.dp_rank]]
        if self.ring is not None:
            return [RingContext(self.ring, self.cfg.train.seq_len, n, self.topo.device) for n in sizes]
        return None if d is None else document_masks(list(torch.split(d.to(self.topo.device), sizes)))

    def _global_sum(self, local: torch.Tensor | None) -> float:
        """Sum a per-replica loss over the world (counted once per replica: last stage, tp rank 0)."""
        v = torch.zeros((), device=self.topo.device)
        if local is not None and self.topo.tp_rank == 0:
            v += local
        dist.all_reduce(v)
        return float(v)

    def _run_pipeline(self, step: int) -> tuple[float, float, int]:
        """Forward and backward of the step under the current plan, data-parallel sums included.
        Returns (loss, seconds, activation peak bytes), the last two the max over ranks; raises
        torch.OutOfMemoryError on every rank if any rank ran out of memory (gradients then garbage)."""
        t, topo, grads = self.cfg.train, self.topo, self.dp.grads
        t0 = time.perf_counter()
        sizes = self.plan.sizes[topo.dp_rank]
        at = (step, t.global_batch, self.plan.replica_offset(topo.dp_rank), sum(sizes))
        x, y = self.data.step_samples(*at)
        d = self.data.step_documents(*at) if self.cfg.data.document_mask else None
        xs, ys = self._microbatches(x, y)
        meter = self.runtime.meter
        meter.reset(q for st in self.stages.values() for q in st.parameters())
        if topo.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(topo.device)
            resident = torch.cuda.memory_allocated(topo.device)
        grads.m = len(sizes)
        masks, scale = self._masks(d), 1.0 / (t.global_batch * t.seq_len)
        out = self.runtime.run(self.actions(len(sizes)), xs, ys, scale, on_stage_done=grads.stage_done, documents=masks)
        if self.zero3 is not None:
            self.zero3.release()  # the backward is done: back to the slices until the next step
        grads.finish()
        self.last_output = out
        peak = meter.peak
        if topo.device.type == "cuda":  # the allocator also sees temporaries the meter does not
            peak = max(peak, torch.cuda.max_memory_allocated(topo.device) - resident)
        # Two reductions tell every rank the loss and whether anyone ran out of memory (sum), and the
        # step's time and activation peak (max over ranks: what the planner needs, identical
        # everywhere, so every rank proposes the same next split). The sum also carries every rank's
        # timing summary, each in its own slot, for the records: no collective of their own.
        local = 0.0 if out.loss is None or topo.tp_rank != 0 else float(out.loss)
        world = topo.dims.world_size if self.cfg.sinks.step_details else 0
        n = len(FIELDS)
        v = torch.zeros(2 + n * world, dtype=torch.float64)
        v[0], v[1] = local, float(out.out_of_memory is not None)
        if world:
            v[2 + n * topo.rank : 2 + n * (topo.rank + 1)] = torch.tensor(rank_summary(out, self._work(sum(sizes))))
        v = v.to(topo.device)
        dist.all_reduce(v)
        self.last_ranks = unpack(v[2:].tolist(), world) if world else {}
        w = torch.tensor([time.perf_counter() - t0, float(peak)], dtype=torch.float64, device=topo.device)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        if v[1] > 0:
            self.opt.zero_grad(set_to_none=True)
            raise torch.OutOfMemoryError(out.out_of_memory or f"{int(v[1])} rank(s) ran out of memory")
        return float(v[0]), float(w[0]), int(w[1])

    def _work(self, samples: int) -> float:
        """The cost model's units of work this rank does for `samples` samples under the current layout."""
        costs = self.cost.stage_costs(self.layout.parts[self.topo.dp_rank])
        return samples * sum(costs[s] for s in self.stages)

    def step(self, step: int) -> dict[str, Any]:
        """One training step over every dimension; then the balancer's decision, if any, is applied."""
        t, topo = self.cfg.train, self.topo
        t0 = time.perf_counter()
        lr = lr_at(step, t)
        set_lr(self.opt, lr)
        rec: dict = {}
        while True:
            sizes = self.policy.propose(step)
            if isinstance(self.policy, RecomputeChoice):  # the mode is the policy's, per step
                rec["recompute"] = self.policy.recompute
                for st in self.stages.values():
                    st.recompute = self.policy.recompute
            self.plan = self._plan(len(sizes))
            mine = list(self.plan.sizes[topo.dp_rank])  # differs only where the balancer moved samples
            assert mine == sizes or sum(mine) != sum(sizes), (self.plan.sizes, sizes)
            try:
                loss, run_s, peak = self._run_pipeline(step)
                break
            except torch.OutOfMemoryError as e:
                # Nothing was applied: redo the same step (same samples, same lr) with smaller microbatches.
                if self.policy.on_oom(step, sizes) is None:
                    raise RuntimeError(
                        f"out of memory at step {step} with microbatches {sizes} ({e}): use "
                        f"more microbatches or --batching.policy adaptive"
                    ) from None
                self.oom_retries += 1
                rec.setdefault("oom", []).append({"microbatches": sizes, "error": str(e)})
        tokens = t.global_batch * t.seq_len
        self.policy.observe(step, sizes, run_s, peak, tokens)
        kept = getattr(self.dp.grads, "keep_slices", False)  # ZeRO-2: gradients are dp slices from here on
        sync_sequence_parallel(topo, self.stages)
        tie_bytes = sync_tied_embeddings(topo, self.stages, self.n_stages, kept)
        grad_norm = clip_grad_norm(topo, self.stages, t.grad_clip, self.dp.grads.slices)
        self.opt.step()
        # Counted before the gradients go: what this rank held at the step's peak (plan/memory_model.py models it).
        transient = (self.dp.grads.peak_bytes, tie_bytes)
        z3 = self.zero3
        held = [q for _, q in self.mp.parameters()]  # under ZeRO-3 empty here (released), with their slices:
        held += list(self.opt.kept) if z3 is not None else []  # opt.kept, bf16 under working copies
        self.memory = held_bytes(
            held,
            self.opt,
            self.runtime.meter.peak,
            self.p2p.buffer_bytes(),
            transient,
            getattr(self.dp.grads, "whole_bytes", 0) if kept else 0,
            0 if z3 is None else z3.peak,
        )
        if z3 is not None:
            z3.peak = 0
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        rec.update(
            {
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "step_time_s": dt,
                "tokens_per_s": tokens / dt,
                "microbatches": list(self.plan.sizes[topo.dp_rank]),
                "activation_peak_bytes": peak,
                "time": time.time(),  # wall clock at the step's end: lines steps up with restarts and faults
                **(step_fields(self.last_ranks) if self.last_ranks else {}),
            }
        )
        if self.balancer is not None:  # after the update: a move carries the stepped weights and state
            mem = self.monitor.sample()
            out = self.balancer.after_step(
                self.layout, step, self.last_output, dt, (mem.memory_used_bytes, mem.memory_total_bytes)
            )
            if out.decision is not None and out.new_layout is not None:
                out.decision["move"] = self.apply_layout(out.new_layout)
            if out.events:
                rec["balance"] = out.events
        return rec

    def apply_layout(self, layout: Layout) -> dict:
        """Adopt a new layout (collective): move layers with their optimizer state between this replica's
        pipeline ranks, rebuild the data-parallel and optimizer bundles, re-attach hooks, re-split the batch."""
        topo, p = self.topo, self.cfg.parallel
        old, d = self.layout, topo.dp_rank
        info: dict = {}
        if layout.parts != old.parts:
            self.dp.grads.close()
            shards, carry = self._held_for_move(layout)
            tp_group = topo.group("tp") if p.tp > 1 else None
            any_stage = next(iter(self.stages.values()))
            stats = move_layers(
                topo,
                self.stages,
                carry,
                old.parts[d],
                layout.parts[d],
                default_layer_builder(any_stage, tp_group, topo.device),
                lambda st: topo.pp_peer(self.stage_ranks[st]),
                shards,
            )
            self.runtime.layers_changed()  # split backward's hooks were on the old layers
            info = stats.to_dict()
            self.opt = build_optimizer(self.cfg, topo, self.mp, layout, carry=carry, given=shards)
            self.zero3 = build_zero3(self.cfg, topo, self.mp, self.opt)  # frees the arrived layers' parameters
            self.dp = build_data_parallel(self.cfg, topo, self.stages, layout, self.dp.plane)
            self._reattach()
        self.layout, self.parts = layout, list(layout.parts[d])
        self.plan = self._plan(len(self.plan.sizes[d]))
        return info

    def _held_for_move(self, layout: Layout) -> tuple[dict | None, dict]:
        """What a layer move carries, by parameter: (None, whole AdamW state) — gathered under ZeRO-1 and 2;
        under ZeRO-3 (this rank's slices, their state): nothing is gathered, each dp rank's slices move
        (balance/migrate.py), which needs every replica on one partition (the balancer plans only such)."""
        if self.zero3 is None:
            return None, full_optimizer_state(self.opt)
        assert layout.shared_partition, f"ZeRO-3 moves layers of one shared partition, got {layout.parts}"
        self.zero3.unhook()
        opt = self.opt
        assert isinstance(opt, ShardedAdamW)
        shards = dict(zip(opt.full, opt.views))
        return shards, {p: opt.state[q] for p, q in shards.items()}

    def restore_layout(self, saved: dict | None) -> Restored:
        """After resuming from `saved` (a checkpoint's trainer state), adopt the layout it recorded where it
        still applies (balance/restore.py), by the move a live rebalance makes (collective: every rank
        reads the same checkpoint). Returns which layout the run starts from and why."""
        p, t = self.cfg.parallel, self.cfg.train
        restored = restored_layout(
            saved,
            self.layout,
            pp=p.pp,
            dp=p.dp,
            virtual_stages=stages_per_rank(p),
            global_batch=t.global_batch,
            microbatches=len(self.plan.sizes[self.topo.dp_rank]),
            shared_only=one_partition(self.cfg),
        )
        if restored.layout is not None:
            self.apply_layout(restored.layout)
        return restored

    def _plan(self, count: int) -> BatchPlan:
        """The step's batch plan: the microbatch policy's, with the load balancer's replica shares."""
        plan = plan_for(self.cfg, count)
        if tuple(sum(s) for s in plan.sizes) != self.layout.split:
            t = self.cfg.train
            plan = plan_batch(t.global_batch, self.cfg.parallel.dp, count, None, list(self.layout.split))
        return plan

    @torch.no_grad()
    def evaluate(self, val_set: tuple | None = None) -> float:
        """The mean loss over the validation set (`val_set`, else the run's: inputs, targets, documents)."""
        t, topo = self.cfg.train, self.topo
        n = t.val_batches * t.global_batch
        vx, vy, vd = val_set or self.val_set
        total: torch.Tensor | None = None
        for b in range(t.val_batches):
            lo = b * t.global_batch + self.plan.replica_offset(topo.dp_rank)
            hi = lo + sum(self.plan.sizes[topo.dp_rank])
            xs, ys = self._microbatches(vx[lo:hi], vy[lo:hi])
            acts, masks = (
                self.actions(len(self.plan.sizes[0]), train=False),
                self._masks(vd if vd is None else vd[lo:hi]),
            )
            out = self.runtime.run(acts, xs, ys, 1.0 / (n * t.seq_len), train=False, documents=masks)
            if out.loss is not None:
                total = out.loss if total is None else total + out.loss
        if self.zero3 is not None:
            self.zero3.release()
        return self._global_sum(total)

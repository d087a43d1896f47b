"""The trainer of one process of a (dp, pp, tp) run: its stages, pipeline runtime, optimizer,
gradient reductions, microbatch policy and load balancer, and one training step.

Per step: the replica's share of the global batch is split into microbatches, the pipeline runtime
executes this rank's action list (data-parallel reductions start as each stage finishes its backward),
the tied embedding and the global gradient norm are reduced, and AdamW steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridpar.balance.emulate import SlowdownPlan
from hybridpar.balance.layer_cost import attach_layer_cost
from hybridpar.balance.live import LiveBalancer, plane_groups
from hybridpar.balance.migrate import default_layer_builder, move_layers
from hybridpar.balance.monitor import DeviceMonitor
from hybridpar.balance.plan import Layout
from hybridpar.batching.order import pipeline_order
from hybridpar.batching.policy import make_policy, plan_for
from hybridpar.batching.split import BatchPlan, plan_batch
from hybridpar.config import Config
from hybridpar.config.schedules import schedule_spec
from hybridpar.data import TokenData, load_tokens
from hybridpar.grads import DataParallelGrads, PlaneGrads, clip_grad_norm, sync_tied_embeddings
from hybridpar.model.hf import SafetensorsDir
from hybridpar.model.registry import build_stage, empty_stage, load_stage_, param_counts
from hybridpar.model.stage import Stage
from hybridpar.optim import lr_at, make_optimizer, set_lr
from hybridpar.pipeline.memory import ActivationMeter
from hybridpar.pipeline.p2p import P2P
from hybridpar.pipeline.partition import partition_by_cost, partition_by_params, partition_uniform
from hybridpar.pipeline.runtime import PipelineRuntime, forward_actions
from hybridpar.pipeline.schedules import Action, build_schedule
from hybridpar.topology.mesh import Topology


def layer_partition(cfg: Config) -> list[range]:
    m, n_stages = cfg.model, cfg.parallel.n_stages
    if cfg.parallel.partition == "uniform":
        return partition_uniform(m.n_layers, n_stages)
    if cfg.parallel.partition == "cost":
        return partition_by_cost(cfg.parallel.layer_costs, n_stages)
    n = param_counts(m)
    return partition_by_params([n.layer] * m.n_layers, n_stages, embed_params=n.embed, head_params=n.head)


class Trainer:
    def __init__(self, cfg: Config, topo: Topology) -> None:
        self.cfg, self.topo = cfg, topo
        p, t = cfg.parallel, cfg.train
        self.data = TokenData(load_tokens(cfg.data.path, cfg.data.max_bytes), t.seq_len, t.seed, cfg.data.val_fraction)
        if self.data.vocab_needed > cfg.model.vocab_size:
            raise ValueError(
                f"data.path holds token ids up to {self.data.vocab_needed - 1}: model.vocab_size="
                f"{cfg.model.vocab_size} must be at least {self.data.vocab_needed}"
            )
        self.parts = layer_partition(cfg)
        self.n_stages = p.n_stages
        self.stages: dict[int, Stage] = {}
        # Pipeline rank of each stage: the schedule's placement (s % pp, or ZB-V's V).
        self.stage_ranks = schedule_spec(p.schedule).stage_ranks(p.pp, p.chunks)
        tp_group = topo.group("tp") if p.tp > 1 else None
        # model.init_from: each rank reads only its stages' tensors, and of those only its tp slices.
        hf = SafetensorsDir(cfg.model.init_from) if cfg.model.init_from else None
        for s in (s for s, r in enumerate(self.stage_ranks) if r == topo.pp_rank):
            first, last = s == 0, s == self.n_stages - 1
            if hf is None:
                self.stages[s] = build_stage(cfg.model, self.parts[s], first, last, t.seed, topo.device, tp_group)
            else:
                self.stages[s] = empty_stage(cfg.model, self.parts[s], first, last, topo.device, tp_group)
                load_stage_(self.stages[s], hf, True, topo.tp_rank, p.tp)
            attach_layer_cost(self.stages[s], cfg.emulate.layer_ms)  # benchmark mode; no-op at 0
        self._actions: dict[int, tuple[list[Action], list[Action]]] = {}  # microbatch count -> (train, eval)
        self._orders: dict[tuple[int, ...], list[int]] = {}  # planned sizes -> the order they run in
        self.p2p = P2P(topo.device, torch.float32, p.timeout_s, transport=p.p2p)
        self.runtime = PipelineRuntime(
            self.stages, self.n_stages, lambda s: topo.pp_peer(self.stage_ranks[s]), self.p2p, cfg.model.dim
        )
        named = [(f"{s}.{n}", q) for s, st in self.stages.items() for n, q in st.named_parameters()]
        self.opt = make_optimizer(named, t)
        self.dp_grads = DataParallelGrads(topo, self.stages, t.microbatches)
        self.monitor = DeviceMonitor(topo.device)
        self.slowdown = SlowdownPlan.from_config(cfg.emulate.slowdown, topo.dims.world_size)
        self.runtime.meter = ActivationMeter(cfg.emulate.memory_limit)
        self.runtime.meter.lent = self.p2p.lent
        sample = self.monitor.sample()
        self.policy = make_policy(
            cfg, topo.dp_rank, memory_total_bytes=sample.memory_total_bytes, resident_bytes=sample.memory_used_bytes
        )
        self.plan: BatchPlan = plan_for(cfg, len(self.policy.propose(0)))
        self.oom_retries = 0  # steps redone after running out of memory, over the run
        # Every replica's partition and share of the batch; changed only by the load balancer.
        self.layout = Layout.uniform(self.parts, [sum(s) for s in self.plan.sizes])
        self.balancer = LiveBalancer(cfg, topo) if cfg.balance.mode != "off" else None
        self.plane = None  # the (dp x pp) plane group, made on the first layout whose replicas differ
        # Fetched up front: a corpus too small for the validation set fails before any training step.
        self.val_set = self.data.val_samples(t.val_batches * t.global_batch) if t.val_every else None

    def actions(self, count: int, train: bool = True) -> list[Action]:
        """This rank's action list for `count` microbatches (built once per count: adaptive plans vary it)."""
        if count not in self._actions:
            p = self.cfg.parallel
            acts = build_schedule(p.schedule, p.pp, p.chunks, count, p.recv_lookahead)[self.topo.pp_rank]
            self._actions[count] = (acts, forward_actions(acts))
        return self._actions[count][0 if train else 1]

    def _microbatches(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list, list]:
        """The replica's samples cut into the plan's microbatches, in the order the pipeline runs
        unequal ones fastest (batching/order.py; the same on every rank of the pipeline)."""
        planned = self.plan.sizes[self.topo.dp_rank]
        if planned not in self._orders:
            p = self.cfg.parallel
            self._orders[planned] = pipeline_order(planned, p.schedule, p.pp, p.chunks)
        sizes = self._orders[planned]
        xs = list(torch.split(x.to(self.topo.device), sizes))
        ys = list(torch.split(y.to(self.topo.device), sizes))
        return xs, ys

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
        t, topo = self.cfg.train, self.topo
        t0 = time.perf_counter()
        sizes = self.plan.sizes[topo.dp_rank]
        x, y = self.data.step_samples(step, t.global_batch, self.plan.replica_offset(topo.dp_rank), sum(sizes))
        xs, ys = self._microbatches(x, y)
        meter = self.runtime.meter
        meter.reset(q for st in self.stages.values() for q in st.parameters())
        if topo.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(topo.device)
            resident = torch.cuda.memory_allocated(topo.device)
        self.dp_grads.m = len(sizes)
        out = self.runtime.run(
            self.actions(len(sizes)), xs, ys, 1.0 / (t.global_batch * t.seq_len), on_stage_done=self.dp_grads.stage_done
        )
        self.dp_grads.finish()
        self.last_output = out
        peak = meter.peak
        if topo.device.type == "cuda":  # the allocator also sees temporaries the meter does not
            peak = max(peak, torch.cuda.max_memory_allocated(topo.device) - resident)
        # Two scalar reductions tell every rank the loss and whether anyone ran out of memory (sum),
        # and the step's time and activation peak (max over ranks: what the planner needs, identical
        # everywhere, so every rank proposes the same next split).
        local = 0.0 if out.loss is None or topo.tp_rank != 0 else float(out.loss)
        v = torch.tensor([local, float(out.out_of_memory is not None)], dtype=torch.float64, device=topo.device)
        dist.all_reduce(v)
        w = torch.tensor([time.perf_counter() - t0, float(peak)], dtype=torch.float64, device=topo.device)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        if v[1] > 0:
            self.opt.zero_grad(set_to_none=True)
            raise torch.OutOfMemoryError(out.out_of_memory or f"{int(v[1])} rank(s) ran out of memory")
        return float(v[0]), float(w[0]), int(w[1])

    def step(self, step: int) -> dict[str, float]:
        t, topo = self.cfg.train, self.topo
        t0 = time.perf_counter()
        lr = lr_at(step, t)
        set_lr(self.opt, lr)
        self.runtime.stretch = self.slowdown.factor(topo.rank, step)
        rec: dict = {}
        while True:
            sizes = self.policy.propose(step)
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
        sync_tied_embeddings(topo, self.stages, self.n_stages)
        grad_norm = clip_grad_norm(topo, self.stages, t.grad_clip)
        self.opt.step()
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
            }
        )
        if self.balancer is not None:  # after the update: a move carries the stepped weights and state
            mem = self.monitor.sample()
            events = self.balancer.after_step(
                self, step, self.last_output, dt, (mem.memory_used_bytes, mem.memory_total_bytes)
            )
            if events:
                rec["balance"] = events
        return rec

    def apply_layout(self, layout: Layout) -> dict:
        """Adopt the balancer's layout (collective): move layers with their optimizer state between this
        replica's pipeline ranks, rebuild what caches parameters, and re-split the global batch."""
        topo, p, t = self.topo, self.cfg.parallel, self.cfg.train
        old, d, s = self.layout, topo.dp_rank, topo.pp_rank
        info: dict = {}
        if layout.parts != old.parts:
            self.dp_grads.close()
            tp_group = topo.group("tp") if p.tp > 1 else None
            stats = move_layers(
                topo,
                self.stages[s],
                s,
                self.opt.state,
                old.parts[d],
                layout.parts[d],
                default_layer_builder(self.stages[s], tp_group, topo.device),
                topo.pp_peer,
            )
            info = stats.to_dict()
            state = self.opt.state
            named = [(f"{k}.{n}", q) for k, st in self.stages.items() for n, q in st.named_parameters()]
            self.opt = make_optimizer(named, t)
            for _, q in named:
                self.opt.state[q] = state[q]
            if layout.shared_partition or p.dp == 1:
                self.dp_grads = DataParallelGrads(topo, self.stages, t.microbatches)
            else:  # replicas now hold different layers: reduce over the (dp x pp) plane
                self.plane = self.plane or plane_groups(topo)  # collective: every rank applies this layout
                self.dp_grads = PlaneGrads(topo, self.stages, self.cfg.model.n_layers, self.plane)
        self.layout, self.parts = layout, list(layout.parts[d])
        self.plan = self._plan(len(self.plan.sizes[d]))
        return info

    def _plan(self, count: int) -> BatchPlan:
        """The step's batch plan: the microbatch policy's, with the load balancer's replica shares."""
        plan = plan_for(self.cfg, count)
        if tuple(sum(s) for s in plan.sizes) != self.layout.split:
            t = self.cfg.train
            plan = plan_batch(t.global_batch, self.cfg.parallel.dp, count, None, list(self.layout.split))
        return plan

    @torch.no_grad()
    def evaluate(self) -> float:
        t, topo = self.cfg.train, self.topo
        n = t.val_batches * t.global_batch
        vx, vy = self.val_set
        total: torch.Tensor | None = None
        for b in range(t.val_batches):
            lo = b * t.global_batch + self.plan.replica_offset(topo.dp_rank)
            hi = lo + sum(self.plan.sizes[topo.dp_rank])
            xs, ys = self._microbatches(vx[lo:hi], vy[lo:hi])
            out = self.runtime.run(
                self.actions(len(self.plan.sizes[0]), train=False), xs, ys, 1.0 / (n * t.seq_len), train=False
            )
            if out.loss is not None:
                total = out.loss if total is None else total + out.loss
        return self._global_sum(total)

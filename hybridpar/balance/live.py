"""The balancer inside a running job: after every step each rank reports what it measured, rank 0
decides (`control.Balancer`) and every rank applies rank 0's decision, so all ranks always hold the
same layout. Measurements and decisions travel as JSON in tensors (`all_gather_json`, no pickle).

What each rank reports: its compute seconds this step (forward and backward actions with message
waits taken out, `monitor.stage_times`), its message waits and memory. A position's time per unit
of work is compute / (its replica's samples x its stage's modelled cost); tensor-parallel peers of a
stage run in lock-step, so the position reports the slowest of them.

Every decision is logged (why, old and new layout, step time before and after as simulated on the run's
schedule and as the bottleneck bound), and once `window` steps have run on an applied layout a second
record gives the step time measured before and after it, beside the predictions, and the bottleneck's:
the compute seconds per step of the busiest rank, as the policy read them (with
`emulate.layer_timing=emulated` the emulated ones, which a loaded machine does not change).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hybridpar.balance.control import Balancer, Decision
from hybridpar.balance.monitor import stage_times
from hybridpar.balance.repartition import CostModel, Layout
from hybridpar.balance.scores import RankSample
from hybridpar.config import Config
from hybridpar.model.registry import layer_flops_per_token
from hybridpar.pipeline.schedules import schedule_spec, stages_per_rank
from hybridpar.topology.collectives import all_gather_json
from hybridpar.topology.mesh import Topology


def cost_model(cfg: Config) -> CostModel:
    """Per-sample work of each layer, the embedding and the head, in units the measured speeds share.

    Emulated layer cost (`emulate.layer_ms`): every layer costs the same and nothing else is
    emulated. Otherwise `parallel.layer_costs` if given, else matmul FLOPs: a layer's as its model
    family counts them (model/registry.py), the head's 2 x d x vocab per token."""
    m, T = cfg.model, cfg.train.seq_len
    if cfg.emulate.layer_ms > 0:
        return CostModel((1.0,) * m.n_layers)
    if cfg.parallel.layer_costs is not None:
        return CostModel(tuple(float(c) for c in cfg.parallel.layer_costs))
    layer = T * layer_flops_per_token(m, T)
    return CostModel((layer,) * m.n_layers, first_extra=T * m.dim, last_extra=T * 2.0 * m.dim * m.vocab_size)


def plane_groups(topo: Topology) -> dist.ProcessGroup | None:
    """The (dp x pp) plane of ranks sharing our tp rank, for replicas with different partitions.
    Collective: every rank creates every plane, in the same order."""
    d = topo.dims
    if d.dp == 1 or d.pp == 1:
        return None
    mine = None
    for t in range(d.tp):
        ranks = [r for r in range(d.world_size) if d.coord(r, "tp") == t]
        g = dist.new_group(ranks, timeout=timedelta(seconds=topo.timeout_s))
        if t == topo.tp_rank:
            mine = g
    return mine


@dataclass
class BalanceStep:
    """What the balancer returns after a step: records to log and, when rank 0 decided a move, the
    decision's record (the trainer adds what the move did) and the layout to apply."""

    events: list[dict[str, Any]] = field(default_factory=list)
    decision: dict[str, Any] | None = None
    new_layout: Layout | None = None


def one_partition(cfg: Config) -> bool:
    """Whether every replica must hold the same partition: under ZeRO-3 a layer is cut among the replicas'
    ranks of one stage, and under bf16 working copies at dp > 1 each replica's rank steps its dp slice of
    the masters of the same layers (dataparallel/copies.py)."""
    p = cfg.parallel
    return p.shards_parameters or (cfg.train.bf16_weights == "copies" and p.dp > 1)


class LiveBalancer:
    def __init__(self, cfg: Config, topo: Topology) -> None:
        self.cfg, self.topo = cfg, topo
        t = cfg.train
        self.cost = cost_model(cfg)
        # Every replica keeps `microbatches` samples at least: it splits its share into that many.
        self.policy = Balancer(
            cfg.balance,
            self.cost,
            t.microbatches,
            cfg.parallel.schedule,
            min_per_replica=t.microbatches,
            virtual_stages=stages_per_rank(cfg.parallel),
            shared_partition=one_partition(cfg),
        )
        self.placed = schedule_spec(cfg.parallel.schedule).stage_ranks(cfg.parallel.pp, stages_per_rank(cfg.parallel))
        self.step_times: deque[float] = deque(maxlen=cfg.balance.window)
        self.bottlenecks: deque[float] = deque(maxlen=cfg.balance.window)  # the busiest position's compute
        self._follow: list[dict[str, Any]] = []  # applied decisions awaiting their measured step time
        self._start: int | None = None  # first step of this process (a resumed run warms up too)

    def _local(self, output: Any, step_time_s: float, memory: tuple[int, int]) -> dict[str, float]:
        compute = sum(sum(v) for v in stage_times(output).values())
        waits = sum(w.end - w.start for w in output.waits)
        return {
            "compute_s": compute,
            "comm_wait_s": waits,
            "step_time_s": step_time_s,
            "memory_used_bytes": memory[0],
            "memory_total_bytes": memory[1],
        }

    def samples(self, step: int, ranks: list[dict[str, float]], layout: Layout) -> list[RankSample]:
        """One sample per (replica, stage) position from every rank's report (rank order)."""
        dims = self.topo.dims
        by_pos: dict[int, list[dict[str, float]]] = {}
        for r, rep in enumerate(ranks):
            d, s = dims.coord(r, "dp"), dims.coord(r, "pp")
            by_pos.setdefault(d * dims.pp + s, []).append(rep)
        out = []
        for pos, reps in sorted(by_pos.items()):
            d, s = divmod(pos, dims.pp)
            costs = self.cost.stage_costs(layout.parts[d])
            work = layout.split[d] * sum(c for c, r in zip(costs, self.placed) if r == s)  # s's stages' work
            out.append(
                RankSample(
                    rank=pos,
                    step=step,
                    compute_s=max(max(x["compute_s"] for x in reps), 1e-9) / work,
                    memory_used_bytes=max(int(x["memory_used_bytes"]) for x in reps),
                    memory_total_bytes=min(int(x["memory_total_bytes"]) for x in reps) or None,
                    comm_wait_s=max(x["comm_wait_s"] for x in reps),
                    step_time_s=max(max(x["step_time_s"] for x in reps), 1e-9),
                )
            )
        return out

    def after_step(
        self, layout: Layout, step: int, output: Any, step_time_s: float, memory: tuple[int, int]
    ) -> BalanceStep:
        """Collective over the world, once per step, on the layout the step ran: the records to log and
        rank 0's decision, the same on every rank. The caller applies a decision's layout."""
        events: list[dict[str, Any]] = []
        self._start = step if self._start is None else self._start
        if step - self._start < self.cfg.balance.skip_steps:
            return BalanceStep(events)  # warm-up: allocations and lazy initialisation, not the device's speed
        self.step_times.append(step_time_s)
        ranks = all_gather_json(self._local(output, step_time_s, memory), self.topo.device)
        self.bottlenecks.append(max(x["compute_s"] for x in ranks))
        for f in list(self._follow):
            if step - f["step"] >= self.cfg.balance.window:
                f["measured_step_after_s"] = statistics.median(self.step_times)
                f["measured_bottleneck_after_s"] = statistics.median(self.bottlenecks)
                events.append(f)
                self._follow.remove(f)
        decision = None
        if self.topo.rank == 0:
            d = self.policy.update(step, self.samples(step, ranks, layout), layout)
            decision = d.to_record() if d is not None else None
        rec = all_gather_json(decision, self.topo.device)[0]  # rank 0's decision, on every rank
        if rec is None:
            return BalanceStep(events)
        events.append(rec)
        if not rec["applied"]:  # detect mode: logged, not applied
            return BalanceStep(events)
        self._follow.append(
            {
                "event": "rebalance_measured",
                "step": step,
                "predicted_step_before_s": rec["predicted_step_before_s"],
                "predicted_step_after_s": rec["predicted_step_after_s"],
                "simulated_step_before_s": rec["simulated_step_before_s"],
                "simulated_step_after_s": rec["simulated_step_after_s"],
                "measured_step_before_s": statistics.median(self.step_times),
                "measured_bottleneck_before_s": statistics.median(self.bottlenecks),
            }
        )
        self.step_times.clear()
        self.bottlenecks.clear()
        return BalanceStep(events, rec, Decision.from_record(rec).new)

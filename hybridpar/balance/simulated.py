"""Balancer layouts scored on the run's real schedule: the action lists the runtime executes, run through
the pipeline simulator (pipeline/simulate.py) with each stage's compute scaled by its measured speed.

Why not the bottleneck alone: the min-max partition (`repartition.plan_layout`) minimises the slowest stage,
which sets a pipeline's steady state, but fill and drain run at each stage's own speed, so with few
microbatches, or a fast stage beside a slow one, a partition one layer off the min-max one can finish the
step sooner (gpipe with one microbatch runs its stages one after another: the step is their sum). The
simulation sees that; the bubble formula cannot.

The rule (`plan_layout_simulated`): each replica starts from its min-bottleneck partition and leaves it
for the best simulated of its one-layer neighbours only if that one's simulated step is shorter by more
than `margin` (the Balancer passes max(balance.min_gain, 2 x the measured relative noise): speeds off by
a relative e move both simulated steps by up to e, so a smaller difference may be noise). The global batch
is then split in proportion to each replica's simulated samples per second. Communication is not
modelled (as in `repartition.predicted_step`); the backward costs twice the forward (the usual B = 2F).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpar.balance.repartition import CostModel, Layout, check_modelled, split_by_speed
from hybridpar.pipeline.partition import partition_by_cost
from hybridpar.pipeline.schedules import build_schedule, schedule_spec
from hybridpar.pipeline.sim_program import Program, compile_program
from hybridpar.pipeline.simulate import Costs, simulate


class ScheduleSim:
    """Simulated step times of one schedule at a fixed microbatch count; each pipeline depth's action
    lists are built and lowered once (a decision simulates a few dozen cost vectors on them)."""

    def __init__(self, schedule: str, microbatches: int, virtual_stages: int = 1) -> None:
        check_modelled(schedule)
        if microbatches < 1 or virtual_stages < 1:
            raise ValueError(f"microbatches and virtual_stages must be >= 1, got {microbatches}, {virtual_stages}")
        self.schedule, self.microbatches, self.virtual_stages = schedule, microbatches, virtual_stages
        self.splits = schedule_spec(schedule).splits_backward
        self._programs: dict[int, tuple[Program, tuple[int, ...]]] = {}

    def _program(self, n_stages: int) -> tuple[Program, tuple[int, ...]]:
        """The lowered action lists of `n_stages` stages and each stage's rank (the schedule's placement)."""
        if n_stages not in self._programs:
            v = self.virtual_stages
            if n_stages % v:
                raise ValueError(f"{n_stages} stages are not {v} per rank")
            pp = n_stages // v
            ranks = schedule_spec(self.schedule).stage_ranks(pp, v)
            acts = build_schedule(self.schedule, pp, v, self.microbatches)
            self._programs[n_stages] = (compile_program(acts, pp, n_stages, ranks), ranks)
        return self._programs[n_stages]

    def pipeline_step(self, stage_times: Sequence[float]) -> float:
        """Simulated step of a pipeline whose stage s takes `stage_times[s]` per microbatch (forward +
        backward, split 1 : 2; with a split backward B and W take half of it each)."""
        if len(stage_times) == 0 or min(stage_times) <= 0:
            raise ValueError(f"need positive stage times, got {list(stage_times)}")
        n = len(stage_times)
        program, ranks = self._program(n)
        fwd = [t / 3 for t in stage_times]
        costs = Costs(fwd, fwd, fwd) if self.splits else Costs(fwd, [2 * t for t in fwd])
        return simulate(program, n // self.virtual_stages, n, costs, ranks=ranks).step_time_s

    def per_sample(self, parts: Sequence[range], cost: CostModel, speeds: Sequence[float]) -> float:
        """A replica's simulated step per sample of its share: without communication every cost scales
        with the microbatch size, so the step is this x samples (microbatches taken as equal)."""
        times = [c / v for c, v in zip(cost.stage_costs(parts), speeds)]
        return self.pipeline_step(times) / self.microbatches

    def layout_step(self, layout: Layout, cost: CostModel, speeds: Sequence[Sequence[float]]) -> float:
        """Simulated step of `layout`: its slowest replica (the data-parallel all-reduce is the same for
        every layout and is left out, as in `repartition.predicted_step`)."""
        return max(n * self.per_sample(p, cost, speeds[d]) for d, (p, n) in enumerate(zip(layout.parts, layout.split)))


def neighbours(parts: Sequence[range]) -> list[tuple[range, ...]]:
    """Every partition one layer away: one boundary moved by one, no stage left empty."""
    bounds = [p.start for p in parts] + [parts[-1].stop]
    out = []
    for k in range(1, len(parts)):
        for step in (-1, 1):
            b = bounds.copy()
            b[k] += step
            if b[k - 1] < b[k] < b[k + 1]:
                out.append(tuple(range(b[i], b[i + 1]) for i in range(len(parts))))
    return out


def choose_partition(
    sim: ScheduleSim, cost: CostModel, speeds: Sequence[float], pp: int, margin: float
) -> tuple[range, ...]:
    """The min-bottleneck partition for `speeds`, or its best simulated one-layer neighbour when that one
    is more than `margin` (a fraction) faster in simulation."""
    base = tuple(
        partition_by_cost(
            cost.layer_costs, pp, first_extra=cost.first_extra, last_extra=cost.last_extra, speeds=list(speeds)
        )
    )
    if pp == 1:
        return base
    base_s = sim.per_sample(base, cost, speeds)
    scored = [(sim.per_sample(p, cost, speeds), p) for p in neighbours(base)]
    best_s, best = min(scored, key=lambda x: x[0], default=(base_s, base))
    return best if best_s < (1.0 - margin) * base_s else base


def plan_layout_simulated(
    current: Layout,
    cost: CostModel,
    speeds: Sequence[Sequence[float]],
    sim: ScheduleSim,
    *,
    margin: float,
    min_per_replica: int = 1,
    shared: bool = False,
) -> Layout:
    """The layout that fits `speeds[d][s]` (units per second of position (d, s)) by the rule in the
    module docstring: per replica its partition (`choose_partition`), then the global batch in
    proportion to each replica's simulated samples per second (`split_by_speed`).

    `shared`: every replica keeps one partition (ZeRO-3 cuts each layer's parameters among the replicas'
    ranks of one pipeline stage, so a layer must sit at the same stage in every replica). The candidates
    are each replica's own choice and the choice for the slowest speed at each stage; the one whose
    layout (batch re-split to fit it) simulates fastest wins."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    own = [choose_partition(sim, cost, speeds[d], current.pp, margin) for d in range(current.dp)]
    if not shared:
        return _resplit(current, tuple(own), cost, speeds, sim, min_per_replica)
    slowest = [min(v[s] for v in speeds) for s in range(current.pp)]
    candidates = dict.fromkeys([choose_partition(sim, cost, slowest, current.pp, margin), *own])
    layouts = [_resplit(current, (p,) * current.dp, cost, speeds, sim, min_per_replica) for p in candidates]
    return min(layouts, key=lambda lay: sim.layout_step(lay, cost, speeds))


def _resplit(
    current: Layout,
    parts: tuple[tuple[range, ...], ...],
    cost: CostModel,
    speeds: Sequence[Sequence[float]],
    sim: ScheduleSim,
    min_per_replica: int,
) -> Layout:
    """`parts` with the global batch split in proportion to each replica's simulated samples per second."""
    split = current.split
    if current.dp > 1:
        rates = [1.0 / sim.per_sample(parts[d], cost, speeds[d]) for d in range(current.dp)]
        split = tuple(split_by_speed(sum(current.split), rates, min_per_replica))
    return Layout(parts, split)

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

    def busiest_rank(self, parts: Sequence[range], cost: CostModel, speeds: Sequence[float]) -> float:
        """The busiest pipeline rank's time per sample: the sum of its stages' (the steady state's bound)."""
        _, ranks = self._program(len(parts))
        times = [c / v for c, v in zip(cost.stage_costs(parts), speeds)]
        return max(sum(t for t, r in zip(times, ranks) if r == k) for k in set(ranks))

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


def rank_balanced(cost: CostModel, ranks: Sequence[int], speeds: Sequence[float]) -> tuple[range, ...]:
    """With several stages per rank (interleaved, ZB-V): the partition whose busiest rank is least busy.

    What a rank costs a step is the sum of its chunks, so the min-max *stage* partition can be far off:
    24 layers in 8 chunks with rank 2 at half speed, a stage holds at most 4 layers either way, and its
    tie-break handed rank 3 two chunks of 4 (8 layers where 7 do: 0.86 of the bound). Here the layers go
    one at a time to the rank that then finishes first (greedy min-max of identical units, exact for equal
    layer costs; the mean layer cost stands for each, the embedding and head go to the ranks holding the
    first and last stage), each rank's chunks taking its layers evenly (the earlier chunks one more).
    `ranks[s]` is stage s's rank, `speeds[s]` that rank's speed."""
    n, pp = len(cost.layer_costs), max(ranks) + 1
    if n < len(ranks):
        raise ValueError(f"{n} layers cannot fill {len(ranks)} stages")
    rank_speed = {r: v for r, v in zip(ranks, speeds)}
    chunks = [ranks.count(r) for r in range(pp)]
    extra = [0.0] * pp
    extra[ranks[0]] += cost.first_extra
    extra[ranks[-1]] += cost.last_extra
    mean = sum(cost.layer_costs) / n
    count = chunks.copy()  # every chunk at least one layer
    for _ in range(n - len(ranks)):
        r = min(range(pp), key=lambda q: ((count[q] + 1) * mean + extra[q]) / rank_speed[q])
        count[r] += 1
    sizes, seen = [], [0] * pp
    for r in ranks:
        q, rem = divmod(count[r], chunks[r])
        sizes.append(q + (seen[r] < rem))
        seen[r] += 1
    return _ranges(sizes)


def _ranges(sizes: Sequence[int]) -> tuple[range, ...]:
    starts = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
    return tuple(range(a, b) for a, b in zip(starts, starts[1:]))


def descend(sim: ScheduleSim, cost: CostModel, speeds: Sequence[float], start: Sequence[range]) -> tuple[range, ...]:
    """Steepest descent on the simulated step from `start`, a step being one layer handed from any stage
    to any other (the stages between keep their sizes and shift by one layer).

    One-layer boundary moves (`neighbours`) are too short a reach with several stages per rank: on the
    interleaved schedule, 24 layers and rank 2 at half speed, no boundary move improves on the min-max
    stage partition (9.5 per sample) nor on the busiest-rank one (10.0), while transfers reach 8.92,
    the best of all partitions of 1..6 layers per chunk (enumerated). A step is taken only when strictly
    shorter, so the descent ends; each takes n_stages x (n_stages - 1) simulations at most."""
    sizes = [len(r) for r in start]
    best = sim.per_sample(start, cost, speeds)
    while True:
        moves = []
        for i, j in ((i, j) for i in range(len(sizes)) for j in range(len(sizes)) if i != j and sizes[i] > 1):
            t = sizes.copy()
            t[i], t[j] = t[i] - 1, t[j] + 1
            moves.append((sim.per_sample(_ranges(t), cost, speeds), t))
        step_s, to = min(moves, key=lambda x: x[0], default=(best, sizes))
        if step_s >= best * (1.0 - 1e-9):
            return _ranges(sizes)
        best, sizes = step_s, to


def choose_partition(
    sim: ScheduleSim, cost: CostModel, speeds: Sequence[float], pp: int, margin: float
) -> tuple[range, ...]:
    """The min-bottleneck partition for `speeds`, or a faster simulated one when that one is more than
    `margin` (a fraction) faster in simulation: its best one-layer neighbour with one stage per rank; with
    several (interleaved, ZB-V), where a rank's time is the sum of its chunks, the base is the min-max stage
    partition or `rank_balanced`, whichever leaves the busiest rank less busy, and the contender the best
    `descend` reaches from either."""
    base = tuple(
        partition_by_cost(
            cost.layer_costs, pp, first_extra=cost.first_extra, last_extra=cost.last_extra, speeds=list(speeds)
        )
    )
    if pp == 1:
        return base
    if sim.virtual_stages > 1:
        ranks = schedule_spec(sim.schedule).stage_ranks(pp // sim.virtual_stages, sim.virtual_stages)
        starts = dict.fromkeys([base, rank_balanced(cost, ranks, speeds)])
        base = min(starts, key=lambda p: (sim.busiest_rank(p, cost, speeds), sim.per_sample(p, cost, speeds)))
        scored = [(sim.per_sample(q, cost, speeds), q) for q in (descend(sim, cost, speeds, p) for p in starts)]
    else:
        scored = [(sim.per_sample(p, cost, speeds), p) for p in neighbours(base)]
    base_s = sim.per_sample(base, cost, speeds)
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

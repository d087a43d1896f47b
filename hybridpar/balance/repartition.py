"""What a rebalance should be: the data-parallel split and the stage partitions that fit measured
speeds, and the step time each layout is predicted to take (pure Python).

`Layout` is the whole work assignment of a (dp, pp) run: per replica, the layer range of each stage,
and per replica, its samples of the global batch. Replicas may hold different partitions: with one
slow rank in a dp x pp mesh only its own replica's stages need to move, and the continuous capacity
bound is reachable only that way (a shared partition leaves the slow replica's fast ranks idle).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from hybridpar.pipeline.partition import partition_by_cost, stage_times
from hybridpar.pipeline.schedules import SCHEDULES, schedule_spec


def check_modelled(schedule: str) -> None:
    """ValueError unless the balancer may re-partition `schedule` live (its registry entry says so)."""
    if not schedule_spec(schedule).live_repartition:
        known = ", ".join(s.name for s in SCHEDULES.values() if s.live_repartition)
        raise ValueError(f"schedule {schedule!r} is not one the balancer models (live re-partition): {known}")


def split_by_speed(global_batch: int, speeds: Sequence[float], min_per_replica: int = 1) -> list[int]:
    """Samples per replica in proportion to speed, summing exactly to `global_batch`.

    Largest-remainder (Hamilton) rounding in exact rational arithmetic: each replica gets the floor
    of its quota and the leftover samples go to the largest fractional parts, ties to the lower
    index (so equal speeds reproduce `split_evenly`). Replicas whose quota falls below
    `min_per_replica` are pinned there and the rest is shared among the others in proportion.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, numbers.Integral) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    if len(speeds) == 0:
        raise ValueError("speeds is empty: need at least one replica")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"speeds must be finite and > 0, got {list(speeds)}")
    n = len(speeds)
    if not isinstance(min_per_replica, numbers.Integral) or min_per_replica < 1:
        raise ValueError(f"min_per_replica must be an integer >= 1, got {min_per_replica!r}")
    if global_batch < n * min_per_replica:
        raise ValueError(
            f"cannot give {n} replicas at least {min_per_replica} samples each "
            f"from a global batch of {global_batch}"
        )
    w = [Fraction(float(s)) for s in speeds]
    pinned: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in pinned]
        # Non-empty: if every free quota were below the minimum, rest < min * len(free), which the
        # check above excludes.
        rest = global_batch - min_per_replica * len(pinned)
        total_w = sum(w[i] for i in free)
        quota = {i: rest * w[i] / total_w for i in free}
        low = {i for i in free if quota[i] < min_per_replica}
        if not low:
            break
        pinned |= low
    sizes = [min_per_replica] * n
    for i in free:
        sizes[i] = math.floor(quota[i])
    order = sorted(free, key=lambda i: (-(quota[i] - sizes[i]), i))
    for i in order[: global_batch - sum(sizes)]:
        sizes[i] += 1
    assert sum(sizes) == global_batch and min(sizes) >= min_per_replica
    return sizes


def rank_times(stage_times: Sequence[float], schedule: str, virtual_stages: int = 1) -> list[float]:
    """Per pipeline rank, the summed time of the stages the schedule places on it (its placement; with
    one stage per rank, the stage times themselves)."""
    n = len(stage_times)
    if virtual_stages < 1 or n % virtual_stages:
        raise ValueError(f"{n} stages do not make {virtual_stages} stages on each of a whole number of ranks")
    pp = n // virtual_stages
    ranks = schedule_spec(schedule).stage_ranks(pp, virtual_stages)
    return [sum(t for t, r in zip(stage_times, ranks) if r == k) for k in range(pp)]


def predicted_pipeline_step(
    stage_times: Sequence[float], microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1
) -> float:
    """m x the busiest rank's time / (1 - the schedule's bubble fraction): for GPipe and 1F1B (Narayanan
    et al. 2021) (m + p - 1) x slowest stage time. A rank's time is the sum of its stages' (several with
    virtual stages: interleaved, ZB-V).

    `stage_times` are per microbatch (forward + backward), one per stage. Exact for equal stages; with
    unequal ones it is an upper bound (fill and drain really run at each stage's own speed); either way a
    predicted gain is just the ratio of the bottlenecks. Communication is not modelled.
    """
    check_modelled(schedule)
    if microbatches < 1 or len(stage_times) == 0 or min(stage_times) <= 0:
        raise ValueError(
            f"need microbatches >= 1 and positive stage times, got " f"{microbatches}, {list(stage_times)}"
        )
    per_rank = rank_times(stage_times, schedule, virtual_stages)
    bubble = schedule_spec(schedule).bubble_fraction(len(per_rank), virtual_stages, microbatches)
    return microbatches * max(per_rank) / (1.0 - bubble)


@dataclass(frozen=True)
class Layout:
    """Who does what: `parts[d][s]` = layers of stage s in replica d, `split[d]` = samples of replica d."""

    parts: tuple[tuple[range, ...], ...]
    split: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.split) or not self.parts:
            raise ValueError(
                f"layout has {len(self.parts)} replica partitions but {len(self.split)} "
                "replica sizes: give one of each per data-parallel replica"
            )
        if len({len(p) for p in self.parts}) != 1:
            raise ValueError(f"every replica needs the same number of stages, got " f"{[len(p) for p in self.parts]}")

    @property
    def dp(self) -> int:
        return len(self.split)

    @property
    def pp(self) -> int:
        return len(self.parts[0])

    @classmethod
    def uniform(cls, parts: Sequence[range], split: Sequence[int]) -> Layout:
        """Every replica with the same partition."""
        return cls(tuple(tuple(parts) for _ in split), tuple(split))

    @property
    def shared_partition(self) -> bool:
        return all(p == self.parts[0] for p in self.parts)

    def to_record(self) -> dict[str, list]:
        return {"parts": [[[r.start, r.stop] for r in p] for p in self.parts], "split": list(self.split)}

    @classmethod
    def from_record(cls, rec: dict) -> Layout:
        return cls(tuple(tuple(range(a, b) for a, b in p) for p in rec["parts"]), tuple(rec["split"]))


@dataclass(frozen=True)
class CostModel:
    """Work of the model in abstract units: one sample through layer i costs `layer_costs[i]`, the
    embedding `first_extra`, final norm + head `last_extra`. Measured speeds are units per second."""

    layer_costs: tuple[float, ...]
    first_extra: float = 0.0
    last_extra: float = 0.0

    def stage_costs(self, parts: Sequence[range]) -> list[float]:
        """Work of each stage for one sample."""
        return stage_times(parts, self.layer_costs, self.first_extra, self.last_extra)


def predicted_step(
    layout: Layout,
    cost: CostModel,
    speeds: Sequence[Sequence[float]],
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
) -> float:
    """Step time of `layout` when stage s of replica d processes `speeds[d][s]` units per second (the
    speed of the rank holding it): the slowest replica's pipeline time (`predicted_pipeline_step` on
    per-microbatch stage times). The data-parallel all-reduce is the same for every layout and is left out."""
    worst = 0.0
    for d, parts in enumerate(layout.parts):
        per_mb = layout.split[d] / microbatches
        times = [c * per_mb / v for c, v in zip(cost.stage_costs(parts), speeds[d])]
        worst = max(worst, predicted_pipeline_step(times, microbatches, schedule, virtual_stages))
    return worst


def plan_layout(
    current: Layout,
    cost: CostModel,
    speeds: Sequence[Sequence[float]],
    *,
    repartition: bool,
    resplit: bool,
    min_per_replica: int = 1,
) -> Layout:
    """The layout that fits `speeds[d][s]` (units per second of position (d, s)): each replica's
    partition minimises its slowest stage (exact, `partition_by_cost`), then the global batch is
    split in proportion to each replica's resulting samples per second (`split_by_speed`). Both are
    optimal for their part; together they minimise the slowest replica's bottleneck for a fixed
    bubble factor, which every replica shares (same microbatch count and depth)."""
    parts = list(current.parts)
    if repartition and current.pp > 1:
        parts = [
            tuple(
                partition_by_cost(
                    cost.layer_costs,
                    current.pp,
                    first_extra=cost.first_extra,
                    last_extra=cost.last_extra,
                    speeds=list(speeds[d]),
                )
            )
            for d in range(current.dp)
        ]
    split = current.split
    if resplit and current.dp > 1:
        per_sample = [max(c / v for c, v in zip(cost.stage_costs(parts[d]), speeds[d])) for d in range(current.dp)]
        split = tuple(split_by_speed(sum(current.split), [1.0 / t for t in per_sample], min_per_replica))
    return Layout(tuple(parts), tuple(split))

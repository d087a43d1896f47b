"""`ScheduleSpec`: what a pipeline schedule declares besides its actions — its constraints (virtual
stages, pipeline ranks, microbatches), stage placement, bubble formula and capabilities — and the
arithmetic every layer above asks of it. Each schedule's file in this package builds one; registry.py
lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from hybridpar.pipeline.schedules.actions import Action

# Bubble formula: (pp, virtual_stages, microbatches, t_f, t_b, t_w) -> idle fraction of the step per
# rank, for uniform stage costs: t_f forward, t_b backward (its input-gradient half B where the schedule
# splits the backward), t_w the weight-gradient half W (0 where it does not split).
BubbleFormula = Callable[[int, int, int, float, float, float], float]
# Builder: (pp, virtual_stages, microbatches) -> per pipeline rank, the ordered compute actions (F and B;
# also W where the backward is split), for arguments the spec's constraints accept.
Builder = Callable[[int, int, int], list[list[Action]]]

PLACEMENTS: tuple[str, ...] = ("loop", "v")


def stage_ranks(placement: str, pp: int, virtual_stages: int) -> tuple[int, ...]:
    """The pipeline rank of each of the pp * virtual_stages stages.

    loop: Megatron-LM interleaving (Narayanan et al., 2021): stage s on rank s % pp, so rank r holds
    chunks r, r + pp, r + 2 pp, ...; with one chunk per rank, stage s on rank s.
    v: Qi et al. (2024, "Zero Bubble Pipeline Parallelism", Sec. 6): chunks run down the ranks and back
    up, so with two chunks rank r holds stages r and 2 pp - 1 - r, and the first and last stage share
    rank 0 (torch's `generate_stage_to_rank_mapping(..., style="v")`).
    """
    if placement == "loop":
        return tuple(s % pp for s in range(pp * virtual_stages))
    if placement == "v":
        return tuple(s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(pp * virtual_stages))
    raise ValueError(f"unknown stage placement {placement!r} (known: {', '.join(PLACEMENTS)})")


class Keys(NamedTuple):
    """How constraint errors name the four numbers: plain for the pipeline API, dotted for the config."""

    schedule: str = "schedule"
    pp: str = "pp"
    virtual_stages: str = "virtual_stages"
    microbatches: str = "microbatches"


CONFIG_KEYS = Keys("parallel.schedule", "parallel.pp", "parallel.virtual_stages", "train.microbatches")


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    summary: str  # one line for help texts and the README
    builder: Builder
    bubble: BubbleFormula
    placement: str = "loop"  # see stage_ranks
    min_pp: int = 1
    # (a, b): at least a × pp + b microbatches (and 1). 1F1B-type warm-ups run one microbatch per rank.
    min_microbatches_rule: tuple[int, int] = (1, 0)
    microbatches_multiple_of_pp: bool = False  # microbatches walked in rounds of pp
    virtual_stages: tuple[int, ...] | None = (1,)  # the values allowed; None = any positive count
    default_virtual_stages: int = 1  # when parallel.virtual_stages is left unset
    splits_backward: bool = False  # B (input gradient) and W (weight gradient) are separate actions
    live_repartition: bool = False  # the load balancer may move layers between its stages while training
    torch_peer: str | None = None  # class in torch.distributed.pipelining.schedules, for the benchmark
    fallback: str | None = None  # what an elastic re-plan runs instead when the new layout cannot run this

    def resolve_virtual_stages(self, virtual_stages: int | None) -> int:
        return self.default_virtual_stages if virtual_stages is None else virtual_stages

    def stage_ranks(self, pp: int, virtual_stages: int) -> tuple[int, ...]:
        return stage_ranks(self.placement, pp, virtual_stages)

    def min_microbatches(self, pp: int) -> int:
        a, b = self.min_microbatches_rule
        least = max(1, a * pp + b)
        return max(least, pp) if self.microbatches_multiple_of_pp else least

    def min_microbatches_text(self, pp: int, keys: Keys = Keys()) -> str:
        """The minimum as an error message states it: "pp=4", or "2 × pp - 1 = 7"."""
        least, (a, b) = self.min_microbatches(pp), self.min_microbatches_rule
        if least == pp or a == 0:
            return f"{keys.pp}={pp}" if least == pp else str(least)
        return f"{a} × {keys.pp} {'-' if b < 0 else '+'} {abs(b)} = {least}"

    def microbatch_multiple(self, pp: int) -> int:
        return pp if self.microbatches_multiple_of_pp else 1

    def layout_problem(self, pp: int, virtual_stages: int, keys: Keys = Keys()) -> str | None:
        """Why (pp, virtual_stages) cannot run this schedule, or None."""
        k, v = keys, virtual_stages
        if self.virtual_stages is not None and v not in self.virtual_stages:
            allowed = " or ".join(map(str, self.virtual_stages))
            plural = "s" if self.virtual_stages != (1,) else ""
            others = _schedules_running(v)
            return (
                f"{k.schedule}={self.name} runs {allowed} stage{plural} per pipeline rank, got "
                f"{k.virtual_stages}={v}: set {k.virtual_stages}={self.default_virtual_stages} (the default)"
                + (f" or {k.schedule}={' or '.join(others)}" if others else "")
            )
        if pp < self.min_pp:
            return f"{k.schedule}={self.name} needs {k.pp} >= {self.min_pp}, got {pp}"
        return None

    def count_problem(self, pp: int, microbatches: int, keys: Keys = Keys()) -> str | None:
        """Why this many microbatches cannot run this schedule on pp ranks, or None."""
        k, m = keys, microbatches
        if m < self.min_microbatches(pp):
            return f"{k.schedule}={self.name} needs {k.microbatches} ≥ {self.min_microbatches_text(pp, keys)}, got {m}"
        if m % self.microbatch_multiple(pp):
            # Megatron's interleaved schedule walks microbatches in groups of pp per chunk.
            return (
                f"{k.schedule}={self.name} needs {k.microbatches} divisible by {k.pp}={pp}, "
                f"got {m} ({m} % {pp} = {m % pp})"
            )
        return None

    def check(self, pp: int, virtual_stages: int, microbatches: int, keys: Keys = Keys()) -> None:
        """ValueError naming the schedule and the numbers when this layout cannot run it."""
        problem = self.layout_problem(pp, virtual_stages, keys) or self.count_problem(pp, microbatches, keys)
        if problem:
            raise ValueError(problem)

    def bubble_fraction(
        self, pp: int, virtual_stages: int, microbatches: int, *, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0
    ) -> float:
        """Idle fraction of the step per rank under uniform stage costs (see BubbleFormula)."""
        self.check(pp, virtual_stages, microbatches)
        if min(t_f, t_b, t_w) < 0 or t_f + t_b + t_w <= 0:
            raise ValueError(f"costs must be >= 0 and not all zero: {t_f}, {t_b}, {t_w}")
        return self.bubble(pp, virtual_stages, microbatches, t_f, t_b, t_w)


def _schedules_running(virtual_stages: int) -> list[str]:
    """The registered schedules that run this many stages per rank, for an error's hint."""
    # Imported here, not at the top: the registry imports every schedule's file, and each of those
    # imports this module for ScheduleSpec.
    from hybridpar.pipeline.schedules.registry import SCHEDULES

    return [s.name for s in SCHEDULES.values() if s.virtual_stages is None or virtual_stages in s.virtual_stages]

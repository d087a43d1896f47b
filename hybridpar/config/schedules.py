"""The schedule registry: one `ScheduleSpec` per pipeline schedule, and everything the rest of hybridpar
may ask about a schedule — its constraints, stage placement, bubble formula and capabilities. Nothing
outside this module compares a schedule's name.

It lives in config/, the bottom layer, because config validation reads the constraints before any
process starts, and config/ must not import pipeline/. So this module is pure data and arithmetic; the
two things above it are named, not imported: `builder` ("module:function", resolved by
`pipeline.schedules.compute_schedule`) and `torch_peer` (a class of
`torch.distributed.pipelining.schedules`, resolved by the pipeline benchmark).

A new schedule is one builder module under pipeline/ plus one `register(ScheduleSpec(...))` below.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, NamedTuple

# Bubble formula: (pp, virtual_stages, microbatches, t_f, t_b, t_w) -> idle fraction of the step per
# rank, for uniform stage costs: t_f forward, t_b backward (its input-gradient half B where the schedule
# splits the backward), t_w the weight-gradient half W (0 where it does not split).
BubbleFormula = Callable[[int, int, int, float, float, float], float]

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
    builder: str  # "module:function", (pp, virtual_stages, microbatches) -> per-rank compute actions
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
            others = [s.name for s in SCHEDULES.values() if s.virtual_stages is None or v in s.virtual_stages]
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


SCHEDULES: dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec) -> ScheduleSpec:
    if spec.name in SCHEDULES:
        raise ValueError(f"schedule {spec.name!r} is registered twice")
    if spec.placement not in PLACEMENTS:
        raise ValueError(f"schedule {spec.name!r}: unknown placement {spec.placement!r}")
    if spec.fallback is not None and spec.fallback not in SCHEDULES:  # registered first: chains end
        raise ValueError(f"schedule {spec.name!r} falls back to {spec.fallback!r}, which is not registered yet")
    SCHEDULES[spec.name] = spec
    return spec


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule `name`; ValueError with a did-you-mean otherwise."""
    if name in SCHEDULES:
        return SCHEDULES[name]
    close = difflib.get_close_matches(str(name).lower(), SCHEDULES, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown schedule {name!r}{hint} (known: {', '.join(SCHEDULES)})")


def schedule_names() -> tuple[str, ...]:
    return tuple(SCHEDULES)


# --- bubble formulas -------------------------------------------------------------------------------


def flush_bubble(pp: int, v: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """GPipe and 1F1B: bubble (p-1)(t_f+t_b) over a step of (m+p-1)(t_f+t_b), i.e. (p-1)/(m+p-1).
    Interleaved (Narayanan et al., 2021): the bubble shrinks to (p-1)/v microbatch-times, so
    (p-1)/(v m + p-1) of the step. Independent of the costs."""
    return (pp - 1) / (v * m + pp - 1)


def zb_h1_bubble(pp: int, v: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """ZB-H1: Qi et al. (2024, Sec. 2.1) give the bubble (p-1)(t_f + t_b - t_w), a third of 1F1B's
    (p-1)(t_f + t_b + t_w) when the three are equal. That needs t_w <= min(t_f, t_b): rank 0 owes no W
    while it waits (p-1) t_b for its first gradient, and the last rank none while it waits (p-1) t_f for
    its first activation, so the bubble is never below either. We use (p-1) max(t_f + t_b - t_w, t_f,
    t_b), which tests/test_simulate.py checks against the event simulation for random costs. Fraction:
    bubble / (m (t_f + t_b + t_w) + bubble); with unit costs (p-1) / (3 m + p-1)."""
    bubble = (pp - 1) * max(t_f + t_b - t_w, t_f, t_b)
    return bubble / (m * (t_f + t_b + t_w) + bubble)


# --- the schedules ---------------------------------------------------------------------------------

_BUILDERS = "hybridpar.pipeline.builders"

register(
    ScheduleSpec(
        "gpipe",
        "all forwards, then all backwards (GPipe, Huang et al., 2019)",
        f"{_BUILDERS}:build_gpipe",
        flush_bubble,
        min_microbatches_rule=(0, 1),
        live_repartition=True,
        torch_peer="ScheduleGPipe",
    )
)
register(
    ScheduleSpec(
        "1f1b",
        "one forward, one backward (PipeDream-flush, Narayanan et al., 2021)",
        f"{_BUILDERS}:build_1f1b",
        flush_bubble,
        live_repartition=True,
        torch_peer="Schedule1F1B",
        fallback="gpipe",
    )
)
register(
    ScheduleSpec(
        "interleaved-1f1b",
        "1F1B over virtual_stages chunks per rank (Megatron-LM, Narayanan et al., 2021)",
        f"{_BUILDERS}:build_interleaved",
        flush_bubble,
        min_pp=2,
        microbatches_multiple_of_pp=True,
        virtual_stages=None,
        default_virtual_stages=2,
        torch_peer="ScheduleInterleaved1F1B",
        fallback="1f1b",
    )
)
# zb-h1's peer: torch's ScheduleInterleavedZeroBubble ("ZB1P") with one stage per rank is our ZB-H1
# action for action (see pipeline/builders.build_zb_h1).
register(
    ScheduleSpec(
        "zb-h1",
        "1F1B with the backward split into B and W, Ws deferred into the bubble (Qi et al., 2024)",
        f"{_BUILDERS}:build_zb_h1",
        zb_h1_bubble,
        splits_backward=True,
        torch_peer="ScheduleInterleavedZeroBubble",
        fallback="1f1b",
    )
)


def zb_v_bubble(pp: int, v: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """ZB-V (pipeline/zbv.py), per-chunk costs t_f, t_b (B), t_w (W). Each rank idles
    max((p-1) t_b, 2 (p-1)(t_b - t_w), t_b + (p-2) t_w). The first term rules for t_b / 2 <= t_w <= t_b,
    the paper's design point t_f = t_b = t_w among them (Qi et al., 2024, Sec. 6), where the bubble is
    (p-1) / (6 m + p-1), about half of ZB-H1's; the second when W is too short to fill the wait for a
    gradient in the steady rounds (with t_f = t_b it is the paper's (p-1)(T_F + T_B - 2 T_W), T one
    chunk's cost); the third when W is longer than B: the Ws the cool-down still owes. Found from, and
    checked in tests/test_zbv.py against, the event simulation of the schedule for random costs with
    t_f <= t_b (a transformer's B is not cheaper than its F); a faster B makes the steady rounds wait in
    ways this closed form does not cover, so it refuses them. Fraction: idle / (2 m (t_f + t_b + t_w) + idle).
    """
    if t_f > t_b:
        raise ValueError(f"zb-v's bubble formula needs t_f <= t_b, got t_f={t_f} > t_b={t_b}")
    idle = max((pp - 1) * t_b, 2 * (pp - 1) * (t_b - t_w), t_b + (pp - 2) * t_w)
    return idle / (2 * m * (t_f + t_b + t_w) + idle)


register(
    ScheduleSpec(
        "zb-v",
        "two chunks per rank in a V (rank r: stages r and 2 pp - 1 - r), backward split into B and W "
        "(Qi et al., 2024)",
        "hybridpar.pipeline.zbv:build_zb_v",
        zb_v_bubble,
        placement="v",
        min_pp=2,
        min_microbatches_rule=(2, -1),
        virtual_stages=(2,),
        default_virtual_stages=2,
        splits_backward=True,
        torch_peer="ScheduleZBVZeroBubble",
        fallback="zb-h1",
    )
)

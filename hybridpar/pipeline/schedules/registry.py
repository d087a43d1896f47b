"""The schedule registry: every pipeline schedule hybridpar runs, in one list, and what the rest of
hybridpar may ask of a schedule by its name. Nothing outside this package compares a schedule's name: it
asks the spec (`schedule_spec(name).splits_backward`, `.live_repartition`, `.fallback`, ...).

A new schedule is one file in this package (its builder, its bubble formula and `SPEC =
ScheduleSpec(...)`), one line in REGISTERED below, and its tests.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Iterable

from hybridpar.pipeline.schedules import gpipe, interleaved, one_f_one_b, zb_h1, zb_v
from hybridpar.pipeline.schedules.spec import PLACEMENTS, ScheduleSpec

if TYPE_CHECKING:  # read for its three fields only
    from hybridpar.config import ParallelConfig

# A schedule's fallback comes before it, so that every fallback chain ends (index checks it). Help texts
# and error messages list the schedules in this order.
REGISTERED: tuple[ScheduleSpec, ...] = (
    gpipe.SPEC,
    one_f_one_b.SPEC,
    interleaved.SPEC,
    zb_h1.SPEC,
    zb_v.SPEC,
)


def index(specs: Iterable[ScheduleSpec]) -> dict[str, ScheduleSpec]:
    """`specs` by name, each checked as it is registered, in order: ValueError for one registered twice,
    with an unknown placement, or falling back to a schedule not registered before it."""
    out: dict[str, ScheduleSpec] = {}
    for spec in specs:
        if spec.name in out:
            raise ValueError(f"schedule {spec.name!r} is registered twice")
        if spec.placement not in PLACEMENTS:
            raise ValueError(f"schedule {spec.name!r}: unknown placement {spec.placement!r}")
        if spec.fallback is not None and spec.fallback not in out:
            raise ValueError(f"schedule {spec.name!r} falls back to {spec.fallback!r}, which is not registered yet")
        out[spec.name] = spec
    return out


SCHEDULES: dict[str, ScheduleSpec] = index(REGISTERED)


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule `name`; ValueError with a did-you-mean otherwise."""
    if name in SCHEDULES:
        return SCHEDULES[name]
    close = difflib.get_close_matches(str(name).lower(), SCHEDULES, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown schedule {name!r}{hint} (known: {', '.join(SCHEDULES)})")


def schedule_names() -> tuple[str, ...]:
    return tuple(SCHEDULES)


def stages_per_rank(p: ParallelConfig) -> int:
    """Model chunks (stages) per pipeline rank: parallel.virtual_stages, or the schedule's own where it is
    unset. The config cannot say it itself: it sits below the registry."""
    return schedule_spec(p.schedule).resolve_virtual_stages(p.virtual_stages)


def stage_count(p: ParallelConfig) -> int:
    """Pipeline stages of the whole model: pp × stages per rank."""
    return p.pp * stages_per_rank(p)


def schedules_help() -> str:
    """The registered schedules, as `hybridpar train --help` lists them after the flags."""
    width = max(len(name) for name in SCHEDULES) + 2
    lines = ["pipeline schedules (--parallel.schedule NAME):"]
    for s in SCHEDULES.values():
        allowed = "any" if s.virtual_stages is None else " or ".join(map(str, s.virtual_stages))
        stages = f"stages per rank: {allowed}, default {s.default_virtual_stages}"
        lines.append(f"  {s.name:<{width}}{s.summary} ({stages})")
    return "\n".join(lines)

"""Stability figures of a run, from its own records (pure Python; `hybridpar report` shows them with the
definitions in `DEFINITIONS`, which the page prints as they are).

Inputs are plain records: the steps the final model contains (`metrics.jsonl`, each step once), the
steps trained and then thrown away by a restart (`metrics.superseded.jsonl`), the start of each attempt
(`resilience.jsonl`), the faults that fired (`chaos.jsonl`) and the sample ledger of the final record.
Attempts are told apart by wall time (a step belongs to the last attempt started before it ended), so a
run resumed by a new launch counts like one restarted by the elastic agent.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

DEFINITIONS: dict[str, str] = {
    "wall time": "from the first attempt's start (its workers built, resilience.jsonl) to the end of the last "
    "step recorded",
    "productive time": "the sum of step_time_s over the steps the final model contains (each step once)",
    "goodput": "productive time / wall time: the share of the run spent on steps that count",
    "interruptions": "attempts that ended before the run did (each later attempt's start marks one): faults, "
    "kills, preemptions",
    "MTTR": "mean time to repair: from the failure (the fault's time from chaos.jsonl, else the end of the "
    "attempt's last step) to the start of the first step after it, averaged over interruptions",
    "MTBF": "mean time between failures: up time (wall time minus the time spent in repair, an outage that "
    "spans several interruptions counted once) / interruptions",
    "recomputed steps": "steps trained, lost with an attempt that ended before checkpointing them, and trained "
    "again (metrics.superseded.jsonl)",
    "lost / duplicated samples": "from the sample ledger carried through every checkpoint: samples of steps "
    "the final model never applied / applied more than once",
    "step-time CV": "coefficient of variation of step_time_s (population standard deviation / mean) over the "
    "steps the final model contains, leaving out the first step of each attempt (allocation, lazy init)",
    "outliers": "steps whose step_time_s exceeds Q3 + 3 x IQR of those steps (Tukey's far-out fence)",
    "straggler episodes": "a rank's compute time per unit of work above {threshold} x the median of the other "
    "ranks' for at least {patience} consecutive steps (per-step records, `ranks`)",
}
STRAGGLER_THRESHOLD = 1.25  # the load balancer's defaults (balance.threshold, balance.patience)
STRAGGLER_PATIENCE = 3


@dataclass
class Episode:
    rank: int
    first_step: int
    last_step: int
    peak_ratio: float


@dataclass
class Stability:
    wall_s: float
    productive_s: float
    goodput: float | None
    interruptions: int
    mttr_s: float | None
    mtbf_s: float | None
    recomputed_steps: int
    lost_samples: int | None
    duplicated_samples: int | None
    step_time_cv: float | None
    outlier_steps: list[int] = field(default_factory=list)
    straggler_episodes: list[Episode] = field(default_factory=list)


def _attempt_of(t: float, starts: Sequence[float]) -> int:
    return max((i for i, s in enumerate(starts) if s <= t), default=0)


def warm_steps(steps: Sequence[dict[str, Any]], starts: Sequence[float]) -> list[dict[str, Any]]:
    """`steps` without the first step each attempt ran (by wall time)."""
    seen: set[int] = set()
    out = []
    for r in sorted(steps, key=lambda r: r["time"]):
        a = _attempt_of(r["time"], starts)
        if a in seen:
            out.append(r)
        seen.add(a)
    return out


def outliers(values: Sequence[float]) -> list[int]:
    """Indices of values above Q3 + 3 x IQR (quartiles by statistics.quantiles, 'inclusive')."""
    if len(values) < 4:
        return []
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    fence = q3 + 3.0 * (q3 - q1)
    return [i for i, v in enumerate(values) if v > fence]


def straggler_episodes(
    steps: Sequence[dict[str, Any]], threshold: float = STRAGGLER_THRESHOLD, patience: int = STRAGGLER_PATIENCE
) -> list[Episode]:
    """Episodes (see DEFINITIONS) from step records carrying `ranks` (compute_s and work per rank)."""
    episodes: list[Episode] = []
    open_: dict[int, Episode] = {}
    streak: dict[int, list[tuple[int, float]]] = {}
    for r in sorted((r for r in steps if r.get("ranks")), key=lambda r: r["step"]):
        compute, work = r["ranks"]["compute_s"], r["ranks"]["work"]
        speed = [c / w if w > 0 else None for c, w in zip(compute, work)]
        for rank, s in enumerate(speed):
            others = [o for q, o in enumerate(speed) if q != rank and o is not None]
            ratio = s / statistics.median(others) if s is not None and others and statistics.median(others) > 0 else 0
            if ratio > threshold:
                streak.setdefault(rank, []).append((r["step"], ratio))
                run = streak[rank]
                if rank in open_:
                    open_[rank].last_step, open_[rank].peak_ratio = r["step"], max(open_[rank].peak_ratio, ratio)
                elif len(run) >= patience:
                    open_[rank] = Episode(rank, run[0][0], run[-1][0], max(x for _, x in run))
                    episodes.append(open_[rank])
            else:
                streak.pop(rank, None)
                open_.pop(rank, None)
    return episodes


def _covered(windows: Sequence[tuple[float, float]]) -> float:
    """Seconds inside at least one of the (start, end) windows. An attempt that fails before its first step
    fails inside the repair of the interruption before it, and both repairs end at the same first step:
    summed, that outage counted twice (MTBF came out negative)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(windows):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def stability(
    steps: Sequence[dict[str, Any]],
    superseded: Sequence[dict[str, Any]],
    starts: Sequence[float],
    faults: Sequence[float],
    ledger: dict[str, int] | None = None,
) -> Stability:
    """The run's figures. `steps`/`superseded`: records with `step`, `time` (end, wall clock) and
    `step_time_s`; `starts`: each attempt's start time; `faults`: each fired fault's time; `ledger`:
    {"lost_samples", "duplicated_samples"} when the run finished (resilience/session.py ledger_stats)."""
    starts = sorted(starts)
    everything = sorted([*steps, *superseded], key=lambda r: r["time"])
    if not everything:
        raise ValueError("the run has no step records: nothing to evaluate")
    t0 = starts[0] if starts else everything[0]["time"] - everything[0]["step_time_s"]
    wall = everything[-1]["time"] - t0
    productive = sum(r["step_time_s"] for r in steps)
    windows: list[tuple[float, float]] = []  # (failed, repaired) per interruption
    for i in range(1, len(starts)):
        before = [r["time"] for r in everything if starts[i - 1] <= r["time"] < starts[i]]
        fired = [f for f in faults if starts[i - 1] <= f < starts[i]]
        failed = max(fired) if fired else max(before, default=starts[i - 1])
        after = [r["time"] - r["step_time_s"] for r in everything if r["time"] >= starts[i]]
        if after:
            windows.append((failed, min(after)))
    repairs = [b - a for a, b in windows]
    n = len(starts) - 1 if starts else 0
    warm_recs = sorted(warm_steps(steps, starts), key=lambda r: r["step"])
    warm = [r["step_time_s"] for r in warm_recs]
    mean = statistics.fmean(warm) if warm else None
    cv = statistics.pstdev(warm) / mean if warm and mean else None
    return Stability(
        wall_s=wall,
        productive_s=productive,
        goodput=productive / wall if wall > 0 else None,
        interruptions=n,
        mttr_s=statistics.fmean(repairs) if repairs else None,
        mtbf_s=(wall - _covered(windows)) / n if n else None,
        recomputed_steps=len(superseded),
        lost_samples=None if ledger is None else ledger["lost_samples"],
        duplicated_samples=None if ledger is None else ledger["duplicated_samples"],
        step_time_cv=cv,
        outlier_steps=[warm_recs[i]["step"] for i in outliers(warm)],
        straggler_episodes=straggler_episodes(steps),
    )

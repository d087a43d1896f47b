"""Which split is fastest, from noisy blocks of throughput readings: a race by successive elimination.

On a shared machine one step can run 3x slower (a neighbour's job) and a whole block of steps can
catch a quiet or a busy spell, so no reading and no single block decides (issue 19). Each candidate's
block of readings is reduced to its median (one slow step does not move it) in log space, so ratios
become differences; a candidate's estimate is the mean of its blocks (the median of blocks wastes
evidence: in synthetic races with 30% noise it picked a wrong split twice as often). The noise is the
robust pooled spread of block values around their candidate's estimate: spells between blocks count
as noise, which is the point. A candidate is dropped only when it trails the leader by more than `z`
standard errors of the difference; the race is settled when one is left or when every one left is shown
within `margin` of the leader (then any of them will do). With one block per candidate nothing is
known of the noise: the best `keep` go on to be measured again.

Pure arithmetic, no clock: the policy (adaptive.py) decides what to measure next from the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean, median, variance
from typing import Mapping, Sequence


def block_value(readings: Sequence[float]) -> float:
    """One block of throughput readings as one number: the log of their median."""
    return math.log(median(readings))


@dataclass(frozen=True)
class Verdict:
    leader: int
    survivors: list[int]  # leader first, then up to keep - 1 not shown slower, best estimate first
    settled: bool  # one survivor, or all within the margin of the leader
    noise: float | None  # standard deviation of one block value (log units); None: not yet known
    estimates: dict[int, float]  # candidate -> mean block value


def judge(
    blocks: Mapping[int, Sequence[float]],
    *,
    margin: float,
    z: float = 2.0,
    noise_prior: float = 0.05,
    prior_weight: float = 2.0,
    keep: int = 3,
) -> Verdict:
    """The race's state from every candidate's block values (log throughput, higher is better).

    The noise estimate is shrunk towards `noise_prior` with the weight of `prior_weight` degrees of
    freedom: two blocks that agree by chance must not make the race trust 0.1% differences.
    Ties go to the larger candidate (more microbatches: less memory)."""
    est = {m: fmean(b) for m, b in blocks.items() if b}
    ranked = sorted(est, key=lambda m: (est[m], m), reverse=True)
    leader = ranked[0]
    dof = sum(len(blocks[m]) - 1 for m in est)
    if dof == 0:
        return Verdict(leader, ranked[:keep], len(ranked) == 1, None, est)
    # Robust spread: the median absolute residual (x 1.4826: a standard deviation for normal noise),
    # residuals scaled by sqrt(n / (n - 1)) for the centre they were taken from. A block where two of
    # three steps hit a neighbour's job is one large residual, not a noise level.
    res = [abs(x - est[m]) * math.sqrt(len(b) / (len(b) - 1)) for m, b in blocks.items() if len(b) > 1 for x in b]
    spread = 1.4826 * median(res)
    noise = math.sqrt((dof * spread**2 + prior_weight * noise_prior**2) / (dof + prior_weight))

    # Blocks beyond 2.5 noise levels of their candidate's median block count as that far only: one
    # block where most steps hit a neighbour's job must not drop a candidate (Huber's idea). And a
    # candidate whose own blocks disagree more than the pooled noise says is judged by its own spread:
    # of two blocks far apart nobody can tell which one was unlucky.
    var = {}
    for m, b in blocks.items():
        if len(b) > 2:
            mid, lim = median(b), 2.5 * noise
            b = [min(max(x, mid - lim), mid + lim) for x in b]
            est[m] = fmean(b)
        var[m] = max(noise**2, variance(b) if len(b) > 1 else 0.0)
    ranked = sorted(est, key=lambda m: (est[m], m), reverse=True)
    leader = ranked[0]

    def se(m: int) -> float:
        return math.sqrt(var[leader] / len(blocks[leader]) + var[m] / len(blocks[m]))

    # At most `keep` go on (the best estimates): a pass costs the same however noisy the machine.
    survivors = ([leader] + [m for m in ranked[1:] if est[leader] - est[m] <= z * se(m)])[:keep]
    within = all(est[leader] - est[m] + z * se(m) < math.log1p(margin) for m in survivors[1:])
    return Verdict(leader, survivors, len(survivors) == 1 or within, noise, est)

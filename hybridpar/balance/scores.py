"""Measured load of each rank: `RankSample` (one rank's measurements for one step), load scores,
relative speeds.

A device's load score weighs its memory, compute and network load (0.4/0.4/0.2 by default);
every input is a measurement the trainer feeds in. Pure Python.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_WEIGHTS: tuple[float, float, float] = (0.4, 0.4, 0.2)  # memory, compute, network


@dataclass(frozen=True, kw_only=True)
class RankSample:
    """One rank's measurements for one step.

    `compute_s` is pure compute seconds per unit of work, waits excluded: in a pipeline every stage
    waits for the slowest one, so wall time would make all of them look slow. Choose the unit so
    that equal devices report equal values: for a pipeline stage, its compute time divided by its
    modelled cost for the samples it processed (`repartition.CostModel`). `rank` is the index within the
    group being balanced: for the trainer's (dp, pp) grid, replica d's stage s is d * pp + s.
    """

    rank: int
    step: int
    compute_s: float
    memory_used_bytes: int = 0
    memory_total_bytes: int | None = None  # None when the device does not report it (CPU)
    comm_wait_s: float = 0.0  # time blocked on communication this step
    step_time_s: float

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise ValueError(f"rank and step must be >= 0, got rank={self.rank}, step={self.step}")
        for label in ("compute_s", "step_time_s"):
            v = getattr(self, label)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"rank {self.rank}: {label} must be finite and > 0, got {v!r}")
        if not (math.isfinite(self.comm_wait_s) and self.comm_wait_s >= 0):
            raise ValueError(f"rank {self.rank}: comm_wait_s must be >= 0, got {self.comm_wait_s!r}")
        if self.memory_used_bytes < 0 or (self.memory_total_bytes is not None and self.memory_total_bytes <= 0):
            raise ValueError(
                f"rank {self.rank}: memory_used_bytes must be >= 0 and "
                f"memory_total_bytes > 0 or None, got {self.memory_used_bytes}, "
                f"{self.memory_total_bytes}"
            )


def by_rank(samples: Sequence[RankSample]) -> dict[int, RankSample]:
    out: dict[int, RankSample] = {}
    for s in samples:
        if s.rank in out:
            raise ValueError(f"two samples for rank {s.rank} in one update")
        out[s.rank] = s
    if not out:
        raise ValueError("no samples: need at least one rank's measurements")
    return out


def load_scores(samples: Sequence[RankSample], weights: Sequence[float] = DEFAULT_WEIGHTS) -> dict[int, float]:
    """Load of each rank in [0, 1], higher = more loaded, as weighted (memory, compute, network).

    Each component is a fraction so that none dominates by scale: memory = used / total (0 when
    unknown); compute = 1 - fastest / own time per unit, the share of its compute the rank spends
    beyond what the fastest rank would need (0 for the fastest, 0.5 at 2x slower; the plain ratio
    own / fastest is unbounded and would swamp the other two); network = comm wait / step time.
    Weights are normalised by their sum, so (2, 2, 1) equals the default (0.4, 0.4, 0.2).
    """
    if len(weights) != 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"weights must be three finite numbers >= 0 (memory, compute, network) "
            f"with a positive sum, got {tuple(weights)}"
        )
    w_mem, w_comp, w_net = (w / sum(weights) for w in weights)
    by = by_rank(samples)
    fastest = min(s.compute_s for s in by.values())
    scores: dict[int, float] = {}
    for r, s in sorted(by.items()):
        memory = min(s.memory_used_bytes / s.memory_total_bytes, 1.0) if s.memory_total_bytes else 0.0
        compute = 1.0 - fastest / s.compute_s
        network = min(s.comm_wait_s / s.step_time_s, 1.0)
        scores[r] = w_mem * memory + w_comp * compute + w_net * network
    return scores


def quiet_times(rows: Sequence[Mapping[int, float]], n: int) -> dict[int, float]:
    """Time per unit of positions 0..n-1 over `rows` (one {position: time per unit} per step): each
    position's quietest reading but one (the second smallest; one reading too fast, a timer's glitch,
    decides nothing).

    The machine's load only ever adds time to a step, and a burst of it stretches whichever positions run
    during it, by amounts that differ from step to step and from position to position: a window's
    medians then differ by chance and for as long as the burst lasts (a clean dp2xpp2 run at load 28-52:
    one position's window median 1.28x the others', two windows running, and a move), while each
    position's quietest steps are the ones the load left alone. A slow device is slow at every step, its
    quietest included: 2x slower from step t shows from t + window - 1 on."""
    if len(rows) < 2 or n < 1:
        raise ValueError(f"need at least two steps of readings and one position, got {len(rows)} steps, n={n}")
    return {r: sorted(row[r] for row in rows)[1] for r in range(n)}


def concurrent_times(rows: Sequence[Mapping[int, float]], n: int) -> dict[int, float]:
    """Time per unit of positions 0..n-1 over `rows`, each step's reading judged against the same step's
    others: the median over the steps of (own reading / that step's median of all positions), scaled by
    the median of those step medians to stay in seconds per unit.

    A load that stretches most positions at a step cancels in that step's ratio, however long it lasts;
    a position's quietest steps (`quiet_times`) do not show it when the load keeps on the same positions
    for a window (a clean dp2xpp2 run at load 28-52: one position's second-quietest step 1.27x the
    others', step by step 1.03x). A slow device is slow at every step, and both see it alike."""
    if not rows or n < 1:
        raise ValueError(f"need at least one step of readings and one position, got {len(rows)} steps, n={n}")
    level = [statistics.median(row[r] for r in range(n)) for row in rows]
    scale = statistics.median(level)
    return {r: scale * statistics.median(row[r] / m for row, m in zip(rows, level)) for r in range(n)}

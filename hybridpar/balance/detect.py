"""Straggler detection with hysteresis over measured time per unit of work (pure Python)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridpar.balance.scores import RankSample, by_rank


@dataclass(frozen=True)
class StragglerState:
    """Result of one detector update."""

    stragglers: frozenset[int]
    new: frozenset[int]  # became stragglers in this update
    recovered: frozenset[int]  # regained their speed in this update: give their work back
    ratios: Mapping[int, float]  # smoothed time per unit / median of the others' (1.0 = typical)
    reason: str

    @property
    def changed(self) -> bool:
        return bool(self.new or self.recovered)


class StragglerDetector:
    """Flags ranks whose smoothed time per unit stays above `threshold` x the others' median.

    Smoothing is the median of each rank's last `window` observations (one noisy step cannot move
    it). A rank becomes a straggler after `patience` consecutive updates above `threshold`, and
    stops being one only after `patience` consecutive updates below the lower `recover_threshold`
    (default halfway to 1): the gap between the two is the hysteresis that stops flapping around a
    single threshold. After a change the rank's state is frozen for `cooldown` more observations
    (default `window`) so the next decision rests on a window of post-change samples only.
    For a clean step change, detection comes at most window // 2 + patience observations after onset
    (the median flips after window // 2 + 1 slow samples, then `patience` of them must agree).
    """

    def __init__(
        self,
        threshold: float = 1.25,
        window: int = 7,
        patience: int = 3,
        recover_threshold: float | None = None,
        cooldown: int | None = None,
    ) -> None:
        recover = 1.0 + (threshold - 1.0) / 2 if recover_threshold is None else recover_threshold
        if not (math.isfinite(threshold) and threshold > 1.0):
            raise ValueError(f"threshold must be > 1.0, got {threshold}")
        if not 1.0 <= recover < threshold:
            raise ValueError(f"recover_threshold must be in [1.0, threshold={threshold}), got {recover}")
        for label, v in (("window", window), ("patience", patience)):
            if v < 1:
                raise ValueError(f"{label} must be >= 1, got {v}")
        if cooldown is not None and cooldown < 0:
            raise ValueError(f"cooldown must be >= 0, got {cooldown}")
        self.threshold, self.recover_threshold = threshold, recover
        self.window, self.patience = window, patience
        self.cooldown = window if cooldown is None else cooldown
        self._history: dict[int, deque[float]] = {}
        self._seen: dict[int, int] = {}  # observations per rank
        self._last_change: dict[int, int] = {}  # observation index of the rank's last change
        self._streak: dict[int, int] = {}  # consecutive observations beyond the relevant threshold
        self._stragglers: set[int] = set()

    @property
    def stragglers(self) -> frozenset[int]:
        return frozenset(self._stragglers)

    def smoothed(self) -> dict[int, float]:
        """Median time per unit over each rank's window."""
        return {r: statistics.median(h) for r, h in sorted(self._history.items())}

    def noise(self) -> float:
        """The largest relative spread of any rank's window: median absolute deviation / median (robust
        to one spike, unlike the range; 0 until a rank has two observations)."""
        spreads = [0.0]
        for h in self._history.values():
            if len(h) >= 2:
                med = statistics.median(h)
                spreads.append(statistics.median(abs(x - med) for x in h) / med)
        return max(spreads)

    def update(self, samples: Sequence[RankSample]) -> StragglerState:
        by = by_rank(samples)
        for r, s in by.items():
            self._history.setdefault(r, deque(maxlen=self.window)).append(s.compute_s)
            self._seen[r] = self._seen.get(r, 0) + 1
        smooth = self.smoothed()
        ratios: dict[int, float] = {}
        new: set[int] = set()
        recovered: set[int] = set()
        notes: list[str] = []
        for r in sorted(by):  # compare within this update's ranks: the same step for all
            others = [smooth[q] for q in by if q != r]
            ratio = smooth[r] / statistics.median(others) if others else 1.0
            ratios[r] = ratio
            if r in self._last_change and self._seen[r] - self._last_change[r] <= self.cooldown:
                continue
            slow = r in self._stragglers
            beyond = ratio < self.recover_threshold if slow else ratio > self.threshold
            self._streak[r] = self._streak.get(r, 0) + 1 if beyond else 0
            if self._streak[r] >= self.patience:
                (recovered if slow else new).add(r)
                self._streak[r] = 0
                self._last_change[r] = self._seen[r]
                bound = f"< {self.recover_threshold:.3g}" if slow else f"> {self.threshold:.3g}"
                notes.append(
                    f"rank {r} {'recovered' if slow else 'straggles'}: {ratio:.2f}x the "
                    f"others' median time per unit ({bound}) for {self.patience} updates"
                )
        self._stragglers = (self._stragglers | new) - recovered
        reason = "; ".join(notes) if notes else f"no change (stragglers {sorted(self._stragglers)})"
        return StragglerState(frozenset(self._stragglers), frozenset(new), frozenset(recovered), ratios, reason)

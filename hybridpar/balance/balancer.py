"""Dynamic load balancing from measured step times: load scores, stragglers, re-partition, DP split.

The tutorial's DynamicLoadBalancer scores each device by memory, compute and network load (weights
0.4/0.4/0.2) and gives lightly loaded devices more work, but its inputs are random numbers and its
`distribute_workload` does not sum to the total. Here every input is a measurement the trainer
feeds in (`RankSample`), splits sum exactly, and the policy acts only on sustained, worthwhile
imbalance: a straggler must persist (`StragglerDetector`, hysteresis) and the predicted step-time
gain must clear `min_gain` before the pipeline is re-partitioned or the data-parallel split changed.

Pure Python; the trainer measures and applies, this module only decides.
"""
from __future__ import annotations

import math
import numbers
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from hybridpar.pipeline.partition import partition_by_cost, stage_times

DEFAULT_WEIGHTS: tuple[float, float, float] = (0.4, 0.4, 0.2)  # memory, compute, network (tutorial)
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
Mode = Literal["off", "detect", "auto"]
MODES: tuple[str, ...] = ("off", "detect", "auto")


@dataclass(frozen=True, kw_only=True)
class RankSample:
    """One rank's measurements for one step.

    `compute_s` is pure compute seconds per unit of work, waits excluded: in a pipeline every stage
    waits for the slowest one, so wall time would make all of them look slow. Choose the unit so
    that equal devices report equal values: for a pipeline stage, its compute time divided by its
    modelled cost (`partition.stage_times(parts, layer_costs, ...)` at speed 1); for a data-parallel
    replica, its compute time divided by its number of samples. `rank` is the index within the
    group being balanced (stage index or replica index).
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
        if self.memory_used_bytes < 0 or (self.memory_total_bytes is not None
                                          and self.memory_total_bytes <= 0):
            raise ValueError(f"rank {self.rank}: memory_used_bytes must be >= 0 and "
                             f"memory_total_bytes > 0 or None, got {self.memory_used_bytes}, "
                             f"{self.memory_total_bytes}")


def _by_rank(samples: Sequence[RankSample]) -> dict[int, RankSample]:
    out: dict[int, RankSample] = {}
    for s in samples:
        if s.rank in out:
            raise ValueError(f"two samples for rank {s.rank} in one update")
        out[s.rank] = s
    if not out:
        raise ValueError("no samples: need at least one rank's measurements")
    return out


def load_scores(samples: Sequence[RankSample],
                weights: Sequence[float] = DEFAULT_WEIGHTS) -> dict[int, float]:
    """Load of each rank in [0, 1], higher = more loaded, as weighted (memory, compute, network).

    Each component is a fraction so that none dominates by scale: memory = used / total (0 when
    unknown); compute = 1 - fastest / own time per unit, the share of its compute the rank spends
    beyond what the fastest rank would need (0 for the fastest, 0.5 at 2x slower; the plain ratio
    own / fastest is unbounded and would swamp the other two); network = comm wait / step time.
    Weights are normalised by their sum, so (2, 2, 1) equals the tutorial's (0.4, 0.4, 0.2).
    """
    if len(weights) != 3 or not all(math.isfinite(w) and w >= 0 for w in weights) \
            or sum(weights) <= 0:
        raise ValueError(f"weights must be three finite numbers >= 0 (memory, compute, network) "
                         f"with a positive sum, got {tuple(weights)}")
    w_mem, w_comp, w_net = (w / sum(weights) for w in weights)
    by = _by_rank(samples)
    fastest = min(s.compute_s for s in by.values())
    scores: dict[int, float] = {}
    for r, s in sorted(by.items()):
        memory = min(s.memory_used_bytes / s.memory_total_bytes, 1.0) if s.memory_total_bytes else 0.0
        compute = 1.0 - fastest / s.compute_s
        network = min(s.comm_wait_s / s.step_time_s, 1.0)
        scores[r] = w_mem * memory + w_comp * compute + w_net * network
    return scores


def relative_speeds(samples: Sequence[RankSample]) -> dict[int, float]:
    """1 / time per unit, normalised so that the fastest rank is 1.0."""
    by = _by_rank(samples)
    fastest = min(s.compute_s for s in by.values())
    return {r: fastest / s.compute_s for r, s in sorted(by.items())}


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
    For a clean step change, detection comes at most `max_latency` observations after onset.
    """

    def __init__(self, threshold: float = 1.25, window: int = 5, patience: int = 3,
                 recover_threshold: float | None = None, cooldown: int | None = None) -> None:
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
    def max_latency(self) -> int:
        """Observations from a step change's onset to its detection: the median flips after
        window // 2 + 1 slow samples, then `patience` of them must agree."""
        return self.window // 2 + self.patience

    @property
    def stragglers(self) -> frozenset[int]:
        return frozenset(self._stragglers)

    def smoothed(self) -> dict[int, float]:
        """Median time per unit over each rank's window."""
        return {r: statistics.median(h) for r, h in sorted(self._history.items())}

    def update(self, samples: Sequence[RankSample]) -> StragglerState:
        by = _by_rank(samples)
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
                bound = (f"< {self.recover_threshold:.3g}" if slow else f"> {self.threshold:.3g}")
                notes.append(f"rank {r} {'recovered' if slow else 'straggles'}: {ratio:.2f}x the "
                             f"others' median time per unit ({bound}) for {self.patience} updates")
        self._stragglers = (self._stragglers | new) - recovered
        reason = "; ".join(notes) if notes else f"no change (stragglers {sorted(self._stragglers)})"
        return StragglerState(frozenset(self._stragglers), frozenset(new), frozenset(recovered),
                              ratios, reason)


def split_by_speed(global_batch: int, speeds: Sequence[float], min_per_replica: int = 1) -> list[int]:
    """Samples per replica in proportion to speed, summing exactly to `global_batch`.

    Largest-remainder (Hamilton) rounding in exact rational arithmetic: each replica gets the floor
    of its quota and the leftover samples go to the largest fractional parts, ties to the lower
    index (so equal speeds reproduce `split_evenly`). Replicas whose quota falls below
    `min_per_replica` are pinned there and the rest is shared among the others in proportion.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, numbers.Integral) \
            or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    if len(speeds) == 0:
        raise ValueError("speeds is empty: need at least one replica")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"speeds must be finite and > 0, got {list(speeds)}")
    n = len(speeds)
    if not isinstance(min_per_replica, numbers.Integral) or min_per_replica < 1:
        raise ValueError(f"min_per_replica must be an integer >= 1, got {min_per_replica!r}")
    if global_batch < n * min_per_replica:
        raise ValueError(f"cannot give {n} replicas at least {min_per_replica} samples each "
                         f"from a global batch of {global_batch}")
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
    for i in order[:global_batch - sum(sizes)]:
        sizes[i] += 1
    assert sum(sizes) == global_batch and min(sizes) >= min_per_replica
    return sizes


def predicted_pipeline_step(stage_times: Sequence[float], microbatches: int,
                            schedule: str = "1f1b") -> float:
    """(m + p - 1) x slowest stage time, for GPipe and 1F1B (same bubble, Narayanan et al. 2021).

    `stage_times` are per microbatch (forward + backward). Exact for equal stages; with unequal
    ones it is an upper bound (fill and drain really run at each stage's own speed); either way a
    predicted gain is just the ratio of the bottlenecks. Communication is not modelled.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not modelled; known: {', '.join(SCHEDULES)}")
    if microbatches < 1 or len(stage_times) == 0 or min(stage_times) <= 0:
        raise ValueError(f"need microbatches >= 1 and positive stage times, got "
                         f"{microbatches}, {list(stage_times)}")
    return (microbatches + len(stage_times) - 1) * max(stage_times)


@dataclass(frozen=True)
class RepartitionDecision:
    """Whether moving layers between stages pays; stage times are (layer costs + extras) / speed."""

    old_parts: tuple[range, ...]
    new_parts: tuple[range, ...]
    old_stage_times: tuple[float, ...]
    new_stage_times: tuple[float, ...]
    before_s: float  # slowest stage, current partition
    after_s: float  # slowest stage, proposed partition
    gain: float  # 1 - after / before: share of the step time removed
    apply: bool
    reason: str


def plan_repartition(layer_costs: Sequence[float], stage_speeds: Sequence[float],
                     current_parts: Sequence[range], first_extra: float = 0.0,
                     last_extra: float = 0.0, min_gain: float = 0.05) -> RepartitionDecision:
    """Optimal partition for the measured speeds, applied only if it cuts the bottleneck by at
    least `min_gain` (moving layers costs a weight and optimizer-state transfer)."""
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    old = tuple(current_parts)
    old_t = stage_times(old, layer_costs, first_extra, last_extra, stage_speeds)
    new = tuple(partition_by_cost(layer_costs, len(old), first_extra=first_extra,
                                  last_extra=last_extra, speeds=stage_speeds))
    new_t = stage_times(new, layer_costs, first_extra, last_extra, stage_speeds)
    before, after = max(old_t), max(new_t)
    gain = 1.0 - after / before
    apply = new != old and gain >= min_gain
    sizes = lambda parts: [len(p) for p in parts]  # noqa: E731
    verdict = ("already optimal" if new == old else
               f"{'>=' if apply else 'below'} min_gain {min_gain:.0%}")
    reason = (f"layers per stage {sizes(old)} -> {sizes(new)}: slowest stage {before:.4g} -> "
              f"{after:.4g} (-{gain:.1%}, {verdict})")
    return RepartitionDecision(old, new, tuple(old_t), tuple(new_t), before, after, gain, apply,
                               reason)


@dataclass(frozen=True)
class BalancerConfig:
    """Policy knobs of `Balancer`."""

    mode: Mode = "off"  # off: nothing; detect: report decisions only; auto: report and apply
    min_interval_steps: int = 20  # a move costs weight/state transfers: never decide more often
    min_gain: float = 0.05  # act only if the predicted step time falls by this fraction
    threshold: float = 1.25  # straggler: smoothed time per unit > threshold x the others' median
    window: int = 5  # observations in each rank's smoothing median
    patience: int = 3  # consecutive updates before a straggler (or a recovery) counts
    microbatches: int = 1  # per step, for the predicted pipeline step time
    schedule: str = "1f1b"
    first_extra: float = 0.0  # embedding cost on the first stage, units of layer_costs
    last_extra: float = 0.0  # final norm + LM head cost on the last stage
    min_per_replica: int = 1  # samples every data-parallel replica keeps

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"balance mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.min_interval_steps < 1 or self.microbatches < 1 or self.min_per_replica < 1:
            raise ValueError(f"min_interval_steps={self.min_interval_steps}, microbatches="
                             f"{self.microbatches}, min_per_replica={self.min_per_replica} "
                             "must all be >= 1")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        StragglerDetector(self.threshold, self.window, self.patience)  # validates those three


@dataclass(frozen=True)
class Decision:
    """A rebalance the policy proposes; `applied` is False in "detect" mode."""

    kind: Literal["pipeline", "data"]
    step: int
    applied: bool
    reason: str
    old: tuple[range, ...] | tuple[int, ...]  # stage layer ranges, or samples per replica
    new: tuple[range, ...] | tuple[int, ...]
    predicted_step_before_s: float
    predicted_step_after_s: float
    speeds: tuple[float, ...]  # smoothed relative speed per stage / replica, fastest = 1
    stragglers: tuple[int, ...]

    @property
    def gain(self) -> float:
        return 1.0 - self.predicted_step_after_s / self.predicted_step_before_s

    def to_record(self) -> dict[str, object]:
        """JSON-serialisable row for metrics.jsonl (ranges become [start, stop])."""
        conv = lambda xs: [[x.start, x.stop] if isinstance(x, range) else x for x in xs]  # noqa: E731
        return {"event": "rebalance", "kind": self.kind, "step": self.step,
                "applied": self.applied, "reason": self.reason, "old": conv(self.old),
                "new": conv(self.new), "predicted_step_before_s": self.predicted_step_before_s,
                "predicted_step_after_s": self.predicted_step_after_s, "gain": self.gain,
                "speeds": list(self.speeds), "stragglers": list(self.stragglers)}


class Balancer:
    """Turns per-step measurements into at most one rebalance per `min_interval_steps`.

    It evaluates once the detector has a full window (unequal devices from the start) and after
    every straggler change (a slowdown, or a recovery that should get its work back); a change
    seen inside the interval waits for it to end. Each call balances one group: the pipeline
    stages of `current_parts` (sample ranks = stage indices) or the data-parallel replicas of
    `current_split` (ranks = replica indices); with pp x dp, run one Balancer per dimension.
    """

    def __init__(self, config: BalancerConfig | None = None) -> None:
        self.config = config or BalancerConfig()
        self.config.validate()
        c = self.config
        self.detector = StragglerDetector(c.threshold, c.window, c.patience)
        self._updates = 0
        self._last_step: int | None = None
        self._last_decision: int | None = None
        self._pending: str | None = None  # why an evaluation is due

    def update(self, step: int, samples: Sequence[RankSample], *,
               layer_costs: Sequence[float] | None = None,
               current_parts: Sequence[range] | None = None,
               current_split: Sequence[int] | None = None) -> Decision | None:
        c = self.config
        if c.mode == "off":
            return None
        if (current_parts is None) == (current_split is None):
            raise ValueError("give exactly one of current_parts (pipeline) or current_split (data)")
        if current_parts is not None and layer_costs is None:
            raise ValueError("a pipeline decision needs layer_costs")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} does not follow step {self._last_step}")
        self._last_step = step
        state = self.detector.update(samples)
        self._updates += 1
        if state.changed:
            self._pending = state.reason
        elif self._updates == c.window:
            self._pending = f"first full window of {c.window} measurements"
        if self._pending is None or (self._last_decision is not None
                                     and step - self._last_decision < c.min_interval_steps):
            return None
        n = len(current_parts) if current_parts is not None else len(current_split or ())
        smooth = self.detector.smoothed()
        if any(r not in smooth for r in range(n)):
            return None  # some stage / replica has not reported yet: stay pending
        fastest = min(smooth[r] for r in range(n))
        speeds = tuple(fastest / smooth[r] for r in range(n))
        why, self._pending = self._pending, None
        if current_parts is not None:
            # Absolute speeds (units of cost per second) so that stage times, and the predicted
            # step, come out in seconds when compute_s is seconds per unit of layer_costs.
            rep = plan_repartition(layer_costs or (), [1.0 / smooth[r] for r in range(n)],
                                   current_parts, c.first_extra, c.last_extra, c.min_gain)
            if not rep.apply:
                return None
            old, new = rep.old_parts, rep.new_parts
            before = predicted_pipeline_step(rep.old_stage_times, c.microbatches, c.schedule)
            after = predicted_pipeline_step(rep.new_stage_times, c.microbatches, c.schedule)
            kind: Literal["pipeline", "data"] = "pipeline"
            why += f"; {rep.reason}"
        else:
            old = tuple(current_split or ())
            new = tuple(split_by_speed(sum(old), speeds, c.min_per_replica))
            # Replica compute time = samples x time per sample; the all-reduce is the same for
            # both splits, so it drops out of the comparison.
            before = max(k * smooth[r] for r, k in enumerate(old))
            after = max(k * smooth[r] for r, k in enumerate(new))
            if new == old or 1.0 - after / before < c.min_gain:
                return None
            kind = "data"
            why += f"; samples per replica {list(old)} -> {list(new)}"
        self._last_decision = step
        return Decision(kind, step, c.mode == "auto", why, old, new, before, after, speeds,
                        tuple(sorted(state.stragglers)))

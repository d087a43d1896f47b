"""The balancing policy: measurements in, at most one rebalance per `interval` steps out (pure Python).

A decision is due once the detector has a full window (devices unequal from the start) and after
every straggler change (a slowdown, or a recovery that should get its work back); a change seen
inside the interval waits for it to end. Each position (replica d, stage s) of the (dp, pp) grid is
one "rank" of the detector (`RankSample.rank = d * pp + s`, s the pipeline rank; tensor-parallel peers
move together, so the caller reports their slowest). With virtual stages (interleaved, ZB-V) a rank holds
several stages, each of which runs at the rank's speed. The planner (`simulated.plan_layout_simulated`) then
re-partitions each replica's stages and re-splits the batch for the speeds of the latest window's quietest
steps (`scores.quiet_times`: the machine's load only adds time), scoring layouts by simulating the run's
schedule; it leaves the min-bottleneck partition only for a layout simulated faster by more than
max(`min_gain`, 2 x the detector's measured noise). The move is proposed only if the simulated step
time or its bottleneck bound (`repartition.predicted_step`) falls by at least `min_gain` (moving layers
costs a weight and optimizer-state transfer), and made only if it does so in `persist` windows, each read
by its quietest steps and step by step against the other positions (`_confirmed`). Besides straggler
changes, a drift of the relative speeds beyond the margin since the last evaluation makes one due.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from hybridpar.balance.detect import StragglerDetector
from hybridpar.balance.repartition import CostModel, Layout, check_modelled, predicted_step
from hybridpar.balance.scores import RankSample, by_rank, concurrent_times, load_scores, quiet_times
from hybridpar.balance.simulated import ScheduleSim, plan_layout_simulated
from hybridpar.config import BalanceConfig
from hybridpar.pipeline.schedules import schedule_spec

MODES: tuple[str, ...] = ("off", "detect", "auto")


@dataclass(frozen=True)
class Decision:
    """A rebalance the policy proposes; `applied` is False in "detect" mode."""

    kind: Literal["pipeline", "data", "pipeline+data"]
    step: int
    applied: bool
    reason: str
    old: Layout
    new: Layout
    predicted_step_before_s: float  # bubble-formula bound: m x slowest stage / (1 - bubble), per replica
    predicted_step_after_s: float
    speeds: tuple[float, ...]  # relative speed per position d * pp + s (the window's quietest steps), fastest = 1
    scores: tuple[float, ...]  # load score per position (memory, compute, network weighted)
    stragglers: tuple[int, ...]
    simulated_step_before_s: float  # the run's schedule simulated (simulated.ScheduleSim): what is gated
    simulated_step_after_s: float
    margin: float  # simulated gain needed to leave the min-bottleneck partition

    @property
    def gain(self) -> float:
        """The simulated gain, the one `balance.min_gain` gates."""
        return 1.0 - self.simulated_step_after_s / self.simulated_step_before_s

    def to_record(self) -> dict[str, object]:
        """JSON row for metrics.jsonl (layer ranges become [start, stop])."""
        return {
            "event": "rebalance",
            "kind": self.kind,
            "step": self.step,
            "applied": self.applied,
            "reason": self.reason,
            "old": self.old.to_record(),
            "new": self.new.to_record(),
            "predicted_step_before_s": self.predicted_step_before_s,
            "predicted_step_after_s": self.predicted_step_after_s,
            "simulated_step_before_s": self.simulated_step_before_s,
            "simulated_step_after_s": self.simulated_step_after_s,
            "margin": self.margin,
            "gain": self.gain,
            "speeds": list(self.speeds),
            "load_scores": list(self.scores),
            "stragglers": list(self.stragglers),
        }

    @classmethod
    def from_record(cls, rec: dict) -> Decision:
        return cls(
            rec["kind"],
            rec["step"],
            rec["applied"],
            rec["reason"],
            Layout.from_record(rec["old"]),
            Layout.from_record(rec["new"]),
            rec["predicted_step_before_s"],
            rec["predicted_step_after_s"],
            tuple(rec["speeds"]),
            tuple(rec["load_scores"]),
            tuple(rec["stragglers"]),
            rec["simulated_step_before_s"],
            rec["simulated_step_after_s"],
            rec["margin"],
        )


def _sizes(layout: Layout) -> list[list[int]]:
    return [[len(r) for r in p] for p in layout.parts]


def _slowest(times: dict[int, float], ranks: int) -> str:
    """The slowest position by the very readings the move was planned on (the detector's smoothed medians
    can name another rank: under load one rank's window median is stretched while the quietest steps show
    a different rank slow, and the move follows the quietest steps)."""
    r = max(times, key=lambda q: (times[q], -q))
    return (
        f"position {r} (replica {r // ranks}, pipeline rank {r % ranks}) slowest: "
        f"{times[r] / min(times.values()):.2f}x the fastest's time per unit (the latest window's quietest steps)"
    )


def _describe(
    why: str, layout: Layout, new: Layout, steps: tuple[float, float, float, float], margin: float
) -> tuple[Literal["pipeline", "data", "pipeline+data"], str]:
    """A move's kind and its reason: why it was due (and the slowest position, `_slowest`), what moves, the
    simulated and bound steps."""
    before, after, bound_before, bound_after = steps
    moved, resplit = new.parts != layout.parts, new.split != layout.split
    kind: Literal["pipeline", "data", "pipeline+data"] = (
        "pipeline+data" if moved and resplit else "pipeline" if moved else "data"
    )
    if moved:
        why += f"; layers per stage {_sizes(layout)} -> {_sizes(new)}"
    if resplit:
        why += f"; samples per replica {list(layout.split)} -> {list(new.split)}"
    why += (
        f"; simulated step {before:.4g} s -> {after:.4g} s ({after / before - 1:+.1%}; bound "
        f"{bound_before:.4g} s -> {bound_after:.4g} s; margin {margin:.1%})"
    )
    return kind, why


class Balancer:
    """Turns per-step measurements of every (replica, stage) position into decisions."""

    def __init__(
        self,
        config: BalanceConfig,
        cost: CostModel,
        microbatches: int = 1,
        schedule: str = "1f1b",
        min_per_replica: int = 1,
        virtual_stages: int = 1,
        shared_partition: bool = False,
    ) -> None:
        c = config
        if c.mode not in MODES:
            raise ValueError(f"balance.mode={c.mode!r} is not one of {', '.join(MODES)}")
        if c.interval < 1 or c.persist < 1 or not 0.0 <= c.min_gain < 1.0:
            raise ValueError(
                f"balance.interval={c.interval} and balance.persist={c.persist} must be >= 1 and "
                f"balance.min_gain={c.min_gain} in [0, 1)"
            )
        check_modelled(schedule)
        if microbatches < 1 or min_per_replica < 1:
            raise ValueError(f"microbatches={microbatches} and min_per_replica={min_per_replica} must be >= 1")
        self.config, self.cost = c, cost
        self.microbatches, self.schedule, self.min_per_replica = microbatches, schedule, min_per_replica
        self.sim = ScheduleSim(schedule, microbatches, virtual_stages)
        self.virtual_stages = virtual_stages
        self.shared = shared_partition  # every replica one partition (ZeRO-3: simulated.py)
        self.weights = (c.weight_memory, c.weight_compute, c.weight_network)
        self.detector = StragglerDetector(c.threshold, c.window, c.patience)
        # The last `persist` windows of steps, each step every position's reading (time per unit), for the
        # plan and `_confirmed` (scores.quiet_times); cleared by a move (readings on the old layout
        # judge no move from the new one).
        self._rows: deque[dict[int, float]] = deque(maxlen=c.persist * c.window)
        self._updates = 0
        self._last_step: int | None = None
        self._last_decision: int | None = None
        self._pending: str | None = None  # why an evaluation is due
        # Relative time per unit of each position (fastest = 1) when a layout was last evaluated: a drift
        # from it beyond the margin is due for an evaluation too, even with no straggler change.
        self._evaluated: dict[int, float] | None = None
        self._drift_streak = 0  # consecutive updates beyond it: `patience` of them, as for a straggler
        # After a move the reference is taken afresh once a whole window was measured on the new layout:
        # what a position measures per unit shifts with its layers (costs the model leaves out, such as a
        # stage's embedding or head, spread over fewer units), which is no drift of the device.
        self._rebase_at: int | None = None

    def _drifted(self, smooth: dict[int, float], n: int) -> str | None:
        """Why the speeds call for another evaluation since the last one, or None: some position's time
        per unit, relative to the fastest, moved by more than max(min_gain, 2 x the measured noise) (a
        slowdown that grows or fades gradually never crosses the detector's thresholds again), in
        `balance.patience` consecutive updates of the smoothed (median) times."""
        fastest = min(smooth[r] for r in range(n))
        if self._evaluated is None:
            if self._rebase_at is not None and self._updates >= self._rebase_at:
                self._evaluated, self._rebase_at = {r: smooth[r] / fastest for r in range(n)}, None
            return None
        tol = max(self.config.min_gain, 2.0 * self.detector.noise())
        moved = {r: smooth[r] / fastest / self._evaluated[r] - 1.0 for r in range(n)}
        self._drift_streak = self._drift_streak + 1 if max(abs(x) for x in moved.values()) > tol else 0
        if self._drift_streak < self.config.patience:
            return None
        return f"speeds drifted by more than {tol:.1%} since the last evaluation"

    def _speeds(self, times: dict[int, float], layout: Layout) -> list[list[float]]:
        """Absolute speeds (units of work per second, so that predicted steps come out in seconds) of each
        (replica, stage) from each position's time per unit: a stage runs at the speed of the rank the
        schedule places it on."""
        ranks = layout.pp // self.virtual_stages
        placed = schedule_spec(self.schedule).stage_ranks(ranks, self.virtual_stages)
        return [[1.0 / times[d * ranks + placed[s]] for s in range(layout.pp)] for d in range(layout.dp)]

    def _steps(self, layout: Layout, new: Layout, speeds: list[list[float]]) -> tuple[float, float, float, float]:
        """Simulated step before and after the move, then the bottleneck bound's before and after."""
        v = self.virtual_stages
        return (
            self.sim.layout_step(layout, self.cost, speeds),
            self.sim.layout_step(new, self.cost, speeds),
            predicted_step(layout, self.cost, speeds, self.microbatches, self.schedule, v),
            predicted_step(new, self.cost, speeds, self.microbatches, self.schedule, v),
        )

    def _windows_full(self, n: int) -> bool:
        """Whether `balance.persist` windows of steps have every position's reading (what `_confirmed` judges)."""
        need = self.config.persist * self.config.window
        return len(self._rows) >= need and all(r in row for row in self._rows for r in range(n))

    def _window(self, j: int, n: int, judge: Callable[..., dict[int, float]] = quiet_times) -> dict[int, float]:
        """Each position's time per unit over the j-th latest window of steps (0 = the latest), as `judge`
        (scores.quiet_times or scores.concurrent_times) reads it."""
        w, rows = self.config.window, list(self._rows)
        return judge(rows[len(rows) - (j + 1) * w : len(rows) - j * w], n)

    def _confirmed(self, layout: Layout, new: Layout, n: int, need: float) -> bool:
        """Whether the move pays off (gain >= `need`) in each of the last `balance.persist` disjoint windows,
        each read two ways: by its quietest steps (the latest window's proposed the move) and step by step
        against the other positions (scores.quiet_times, scores.concurrent_times): an imbalance must persist,
        and the machine's load is no straggler.

        A spike of fewer than a window's steps - 1 never reaches a window's second-quietest step; a burst
        of load on every rank leaves each rank some quiet steps, and one that keeps on some ranks cancels
        step by step; a slow device is slow either way (2x from step t: moved by about t + 1.5 windows + 1,
        `tests/test_balance_persist.py`)."""
        if not self._windows_full(n):
            return False
        for j in range(self.config.persist):
            for judge in (quiet_times, concurrent_times)[1 if j == 0 else 0 :]:
                speeds = self._speeds(self._window(j, n, judge), layout)
                before, after, bound_before, bound_after = self._steps(layout, new, speeds)
                if max(1.0 - after / before, 1.0 - bound_after / bound_before) < need:
                    return False
        return True

    def update(self, step: int, samples: Sequence[RankSample], layout: Layout) -> Decision | None:
        c = self.config
        if c.mode == "off":
            return None
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} does not follow step {self._last_step}")
        self._last_step = step
        state = self.detector.update(samples)
        self._rows.append({r: x.compute_s for r, x in by_rank(samples).items()})
        self._updates += 1
        if state.changed:  # named without ranks: the reason names the slowest by the move's own figures
            self._pending = "a straggler " + " and ".join(
                w for w, ranks in (("appeared", state.new), ("recovered", state.recovered)) if ranks
            )
        elif self._updates == c.window:
            self._pending = f"first full window of {c.window} measurements"
        if self._last_decision is not None and step - self._last_decision < c.interval:
            return None
        ranks = layout.pp // self.virtual_stages  # pipeline ranks: a position is (replica, pipeline rank)
        n = layout.dp * ranks
        smooth = self.detector.smoothed()
        if any(r not in smooth for r in range(n)):
            return None  # some position has not reported yet: stay pending
        self._pending = self._pending or self._drifted(smooth, n)
        if self._pending is None:
            return None
        if not self._windows_full(n):
            return None  # stay pending: no move before `persist` windows of readings (`_confirmed`)
        fastest = min(smooth[r] for r in range(n))
        self._evaluated, self._drift_streak = {r: smooth[r] / fastest for r in range(n)}, 0
        times = self._window(0, n)  # the latest window's quietest steps: what the plan and the gate judge
        speeds = self._speeds(times, layout)
        why, self._pending = self._pending, None
        # Speeds off by a relative e move a simulated step by up to e, so two candidates' difference is
        # only real beyond twice the measured noise; and never below the gain a move must bring anyway.
        margin = min(max(c.min_gain, 2.0 * self.detector.noise()), 0.99)
        new = plan_layout_simulated(
            layout, self.cost, speeds, self.sim, margin=margin, min_per_replica=self.min_per_replica, shared=self.shared
        )
        before, after, bound_before, bound_after = self._steps(layout, new, speeds)
        # The simulation alone leads away from the min-bottleneck partition (beyond the margin); the bound
        # leads back to it once the simulated advantage is within the margin (e.g. a straggler recovered
        # and a partition one layer off simulates no faster than the even one, but no slower either). The
        # gain is gated by min_gain, not the noise margin: at load 10-24 a margin of 2 x the readings' spread
        # stopped real moves too; what a burst of load cannot pass is `_confirmed`.
        if new == layout or max(1.0 - after / before, 1.0 - bound_after / bound_before) < c.min_gain:
            return None
        if not self._confirmed(layout, new, n, c.min_gain):
            self._pending = why  # still due: judged again at the next update
            return None
        why = f"{why}; {_slowest(times, ranks)}"
        kind, why = _describe(why, layout, new, (before, after, bound_before, bound_after), margin)
        self._last_decision = step
        if c.mode == "auto":  # the layout changes: measure the new one before judging drift
            self._evaluated, self._rebase_at = None, self._updates + c.window
            self._rows.clear()
        scores = load_scores(samples, self.weights)
        return Decision(
            kind,
            step,
            c.mode == "auto",
            why,
            layout,
            new,
            bound_before,
            bound_after,
            tuple(min(times.values()) / times[r] for r in range(n)),
            tuple(scores.get(r, 0.0) for r in range(n)),
            tuple(sorted(state.stragglers)),
            before,
            after,
            margin,
        )

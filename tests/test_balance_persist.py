"""Decisions robust to noise without blocking real moves (balance/control.py, pure): a move must pay off by
`balance.min_gain` in `balance.persist` disjoint windows, each read by its quietest steps and step by step
against the other positions (balance/scores.py). Synthetic timing streams with jitter and rare outliers, as
a loaded machine gives them: a 3-step 5x spike, a 6-step load burst and a 40-step burst of load on every
rank move nothing; a persistent 2x slowdown is moved within 20 steps, two slow positions (2x, 1.5x) both
lose work; a drift 1x -> 2.5x -> 1x never brings a move the opposite way within an interval."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from hybridpar.balance.control import Balancer, Decision
from hybridpar.balance.detect import StragglerDetector
from hybridpar.balance.repartition import CostModel, Layout
from hybridpar.balance.scores import concurrent_times, quiet_times
from hybridpar.config import BalanceConfig
from hybridpar.pipeline.partition import partition_uniform
from tests.test_balancer import group

ONSET = 30
LAYOUTS = {  # name: (schedule, stages per rank, dp, pp, microbatches)
    "pp4-1f1b": ("1f1b", 1, 1, 4, 4),
    "pp4-zb-h1": ("zb-h1", 1, 1, 4, 4),
    "dp4": ("1f1b", 1, 4, 1, 1),
}


def noisy(factor: Callable[[int], float], seed: int) -> Callable[[int, int], float]:
    """Position r's time per unit at `step`: position 2 stretched by `factor(step)`, every reading jittered
    by +-4% and one in 40 stretched by 1.3-1.6 (a neighbour's burst)."""
    rng = random.Random(seed)

    def time(r: int, step: int) -> float:
        out = rng.uniform(0.96, 1.04) * (factor(step) if r == 2 else 1.0)
        return out * rng.uniform(1.3, 1.6) if rng.random() < 1 / 40 else out

    return time


def drive(name: str, time: Callable[[int, int], float], steps: int, **kw: object) -> list[Decision]:
    """The balancer fed `time` for every position of layout `name` (24 layers, 28 samples), moves applied."""
    schedule, v, dp, pp, m = LAYOUTS[name]
    cost = CostModel((1.0,) * 24)
    bal = Balancer(BalanceConfig(mode="auto", **kw), cost, m, schedule, min_per_replica=m, virtual_stages=v)  # type: ignore[arg-type]
    layout = Layout.uniform(partition_uniform(24, pp * v), [28 // dp] * dp)
    out = []
    for step in range(steps):
        d = bal.update(step, group(step, [time(r, step) for r in range(dp * pp)]), layout)
        if d is not None:
            out.append(d)
            layout = d.new
    return out


def work(d: Decision, which: str, pos: int = 2) -> int:
    """Layers x samples position `pos` holds before or after a move (one stage per rank)."""
    lay = d.old if which == "old" else d.new
    if lay.dp > 1:
        return lay.split[pos]
    return len(lay.parts[0][pos]) * lay.split[0]


def load_burst(seed: int, slow: Callable[[int], float] = lambda s: 1.0) -> Callable[[int, int], float]:
    """Position r's time per unit at `step`, the machine loaded for 40 steps from ONSET as a clean run at
    load 28-52 measured it: 6 steps in 10 loaded, at a level of 1.3-3x common to the step, each position
    hit or not (7 in 10) and by 0.85-1.15x that level; the rest of the time +-2% jitter. Position 2 at
    `slow(step)` x its own speed besides (the load only adds time: a loaded step is max(own, loaded))."""
    rng = random.Random(seed)
    level: dict[int, float] = {}

    def time(r: int, step: int) -> float:
        own = rng.uniform(0.98, 1.02) * (slow(step) if r == 2 else 1.0)
        if step not in level:
            loaded = ONSET <= step < ONSET + 40 and rng.random() < 0.6
            level[step] = rng.uniform(1.3, 3.0) if loaded else 0.0
        if level[step] and rng.random() < 0.7:
            return max(own, level[step] * rng.uniform(0.85, 1.15))
        return own

    return time


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_spike_or_a_load_burst_moves_nothing(name: str) -> None:
    spike = noisy(lambda s: 5.0 if ONSET <= s < ONSET + 3 else 1.0, seed=1)
    assert drive(name, spike, 120) == []
    # A 6-step burst at 1.25x (a neighbour's job): the median of the window that holds it, and one window
    # decides alone (persist 1), so the batch or layers move; two disjoint windows never both hold it.
    burst = noisy(lambda s: 1.25 if ONSET <= s < ONSET + 6 else 1.0, seed=2)
    assert drive(name, burst, 120) == []
    assert len(drive(name, burst, 120, persist=1)) >= 1


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_persistent_slowdown_moves_within_20_steps(name: str) -> None:
    decisions = drive(name, noisy(lambda s: 2.0 if s >= ONSET else 1.0, seed=3), ONSET + 40)
    assert decisions and ONSET < decisions[0].step <= ONSET + 20
    assert work(decisions[0], "new") < work(decisions[0], "old")  # away from the slow position


@pytest.mark.parametrize("name", ["pp4-1f1b", "dp4"])
def test_a_drift_never_moves_back_within_an_interval(name: str) -> None:
    # 1x -> 2.5x -> 1x over 300 steps, peak at ONSET + 150.
    def factor(s: int) -> float:
        x = (s - ONSET) / 150
        return 1.0 + 1.5 * (x if 0 <= x <= 1 else 2 - x if 1 < x <= 2 else 0.0)

    cfg = BalanceConfig()
    decisions = drive(name, noisy(factor, seed=4), ONSET + 320)
    assert len(decisions) >= 2
    signs = [work(d, "new") - work(d, "old") for d in decisions]
    steps = [d.step for d in decisions]
    assert all(b - a >= cfg.interval for a, b in zip(steps, steps[1:]))  # at most one move per interval
    # Each way monotone: every move away (while it slows) before every move back (while it recovers), the
    # first move back after the peak; so no move is ever undone within an interval, nor at all on the way up.
    back = [s for s, x in zip(steps, signs) if x > 0]
    assert back and signs == sorted(signs, key=lambda x: x > 0) and signs[0] < 0 and back[0] > ONSET + 150


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_long_load_burst_on_every_rank_moves_nothing(name: str) -> None:
    for seed in range(5):
        assert drive(name, load_burst(seed), 120) == []
        # The stream fools each rank's window median: the detector calls some rank a straggler in every
        # seed (and two windows of medians moved layers or samples 1-3 times in 3 of these 5 seeds, every
        # layout, before the quiet and step-by-step readings).
        det, time = StragglerDetector(), load_burst(seed)
        called = set().union(*(det.update(group(s, [time(r, s) for r in range(4)])).new for s in range(120)))
        assert called


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_real_slowdown_still_moves(name: str) -> None:
    # Two slow positions at once, 2x (position 2) and 1.5x (position 1): both give work away, within 20 steps.
    def two(s: int) -> Callable[[int, int], float]:
        one = noisy(lambda st: 2.0 if st >= ONSET else 1.0, seed=s)
        return lambda r, st: one(r, st) * (1.5 if r == 1 and st >= ONSET else 1.0)

    decisions = drive(name, two(5), ONSET + 60)
    assert decisions and ONSET < decisions[0].step <= ONSET + 20
    assert work(decisions[-1], "new", 2) < work(decisions[0], "old", 2)
    assert work(decisions[-1], "new", 1) < work(decisions[0], "old", 1)
    # 2x from the start of a 40-step load burst: moved away within 30 steps (12-26 over these seeds).
    for seed in range(3):
        decisions = drive(name, load_burst(seed, lambda s: 2.0 if s >= ONSET else 1.0), ONSET + 30)
        assert decisions and work(decisions[0], "new") < work(decisions[0], "old")


def test_quiet_and_concurrent_times_by_hand() -> None:
    # Three steps of three positions; step 1 loaded on positions 0 and 1 (2x), step 2 on position 2 (3x).
    rows = [{0: 1.0, 1: 1.0, 2: 2.0}, {0: 2.0, 1: 2.0, 2: 2.0}, {0: 1.0, 1: 1.0, 2: 6.0}]
    assert quiet_times(rows, 3) == {0: 1.0, 1: 1.0, 2: 2.0}  # second smallest of each
    # Step medians 1, 2, 1 (scale 1); ratios: position 0 (1, 1, 1), position 2 (2, 1, 6) -> median 2.
    assert concurrent_times(rows, 3) == {0: 1.0, 1: 1.0, 2: 2.0}
    # A load on every position at once cancels step by step, whatever its size: 1.5x stays 1.5x.
    t = concurrent_times([{0: 1.0, 1: 1.5}, {0: 3.0, 1: 4.5}, {0: 9.0, 1: 13.5}], 2)
    assert t[1] / t[0] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="two steps"):
        quiet_times(rows[:1], 3)

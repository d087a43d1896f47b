"""Decisions robust to noise without blocking real moves (balance/control.py, pure): a move must pay off by
`balance.min_gain` in `balance.persist` disjoint windows of medians, each judged by its own speeds.
Synthetic timing streams with jitter and rare outliers, as a loaded machine gives them: a 3-step 5x spike
and a 6-step load burst move nothing; a persistent 2x slowdown
is moved within 20 steps; a drift 1x -> 2.5x -> 1x never brings a move the opposite way within an interval."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from hybridpar.balance.control import Balancer, Decision
from hybridpar.balance.repartition import CostModel, Layout
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


def work(d: Decision, which: str) -> int:
    """Layers x samples position 2 holds before or after a move (one stage per rank)."""
    lay = d.old if which == "old" else d.new
    if lay.dp > 1:
        return lay.split[2]
    return len(lay.parts[0][2]) * lay.split[0]


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

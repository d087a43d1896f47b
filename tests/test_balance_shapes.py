"""Slowdowns shaped in time (emulate/profiles.py) and how the balancer meets them (pure): a 3-step 5x spike
never moves a layer; a drift 1x -> 2.5x -> 1x is followed, at most once per `balance.interval`, one way
while the slowdown grows and the other while it fades, near the best layout at every step."""

from __future__ import annotations

import pytest

from hybridpar.balance.control import Balancer
from hybridpar.balance.repartition import CostModel, Layout
from hybridpar.balance.simulated import ScheduleSim, plan_layout_simulated
from hybridpar.config import BalanceConfig
from hybridpar.emulate.profiles import parse_shaped, shaped_factor
from hybridpar.emulate.slow_link import link_delays, parse_slow_link
from hybridpar.pipeline.partition import partition_uniform
from tests.test_balancer import group

COST = CostModel((1.0,) * 24)
PP, M = 4, 8


def test_shapes() -> None:
    (d,) = parse_shaped("drift", "rank=1:2.5@step=50+300")
    assert [d.at(s) for s in (0, 49, 50, 125, 200, 275, 349, 350)] == pytest.approx(
        [1.0, 1.0, 1.0, 1.75, 2.5, 1.75, 1.01, 1.0]
    )
    spikes = parse_shaped("spike", "rank=1:5@step=40+3, rank=1:2@step=41+1")
    assert [shaped_factor(spikes, 1, s) for s in (39, 40, 41, 42, 43)] == [1.0, 5.0, 10.0, 5.0, 1.0]
    assert shaped_factor(spikes, 0, 41) == 1.0 and parse_shaped("spike", "") == ()


@pytest.mark.parametrize(
    "spec, why",
    [
        ("rank=1:2.5@step=50", "malformed: expected rank=<int>:<factor>@step=<first>+<length>"),
        ("rank=1:0.5@step=5+3", "factor must be a finite number >= 1.0"),
        ("rank=1:2@step=5+0", "length must be >= 1 step, got 0"),
        ("rank=4:2@step=5+3", "rank 4 does not exist in a world of 4"),
    ],
)
def test_bad_shapes_are_named(spec: str, why: str) -> None:
    with pytest.raises(ValueError, match="emulate.drift entry") as e:
        parse_shaped("drift", spec, world_size=4)
    assert why in str(e.value)


def _drive(
    shape: str, spec: str, steps: int, cfg: BalanceConfig, score_every: int = 0
) -> tuple[list, list[float], list[float]]:
    """pp=4 1f1b, 24 equal layers, rank 1 stretched by the shape: each step the balancer sees every rank's
    time per unit. Returns its decisions, and every `score_every` steps (0: never) the simulated step of the
    layout it held and of the best layout for that step's true speeds (a sampled integral)."""
    entries = parse_shaped(shape, spec)
    bal = Balancer(cfg, COST, microbatches=M)
    sim = ScheduleSim("1f1b", M)
    layout = Layout.uniform(partition_uniform(24, PP), [M])
    decisions, held, best = [], [], []
    for step in range(steps):
        times = [shaped_factor(entries, r, step) for r in range(PP)]
        speeds = [[1.0 / t for t in times]]
        if score_every and step % score_every == 0:
            held.append(sim.layout_step(layout, COST, speeds))
            ideal = plan_layout_simulated(layout, COST, speeds, sim, margin=0.0)
            best.append(sim.layout_step(ideal, COST, speeds))
        d = bal.update(step, group(step, times), layout)
        if d is not None:
            decisions.append(d)
            layout = d.new
    return decisions, held, best


def test_a_spike_moves_nothing() -> None:
    decisions, _, _ = _drive("spike", "rank=1:5@step=30+3", 120, BalanceConfig(mode="auto"))
    assert decisions == []
    # Even where one window of 5 decides alone (persist 1), whose median the 3 slow readings are (layers
    # moved away and back when the plan read medians): the plan reads each window's second-quietest step.
    cfg = BalanceConfig(mode="auto", window=5, persist=1)
    decisions, _, _ = _drive("spike", "rank=1:5@step=30+3", 120, cfg)
    assert decisions == []
    decisions, _, _ = _drive("spike", "rank=1:5@step=30+3", 120, BalanceConfig(mode="auto", window=5))
    assert decisions == []


def test_a_drift_is_followed_without_oscillation() -> None:
    cfg = BalanceConfig(mode="auto")
    decisions, held, best = _drive("drift", "rank=1:2.5@step=20+300", 340, cfg, score_every=5)
    assert len(decisions) >= 2
    steps = [d.step for d in decisions]
    assert all(b - a >= cfg.interval for a, b in zip(steps, steps[1:]))  # at most one per interval
    # Rank 1's layers only fall while it slows (to step 170) and only rise while it recovers.
    layers = [len(d.new.parts[0][1]) for d in decisions]
    peak = max(i for i, d in enumerate(decisions) if d.step <= 170 + cfg.window)
    assert all(a >= b for a, b in zip(layers[: peak + 1], layers[1 : peak + 1]))
    assert all(a <= b for a, b in zip(layers[peak:], layers[peak + 1 :]))
    assert layers[-1] == 6 and min(layers) < 6  # given back at the end
    # Throughput over the whole drift: >= 0.90 of the best layout's, integrated step by step.
    assert sum(best) / sum(held) >= 0.90, sum(best) / sum(held)


def test_slow_link() -> None:
    assert parse_slow_link("") is None and parse_slow_link(" 1 : 10 ", pp=4) == (1, 10.0)
    peers = {0: 10, 2: 12}  # pipeline rank 1's neighbours, by their global ranks
    assert link_delays("1:10", 2.0, 4, 1, peers) == {12: pytest.approx(0.018)}  # (10 - 1) x 2 ms, from rank 2
    assert link_delays("1:10", 2.0, 4, 2, {1: 11, 3: 13}) == {11: pytest.approx(0.018)}
    assert link_delays("1:10", 2.0, 4, 0, {1: 11}) == {} and link_delays("", 2.0, 4, 1, peers) == {}
    for spec, why in (
        ("1-10", "malformed: expected <boundary>:<factor>"),
        ("1:0.5", "factor must be a finite number >= 1.0"),
        ("3:10", "boundary 3 is not between two of parallel.pp=4 pipeline ranks (0..2)"),
    ):
        with pytest.raises(ValueError, match="emulate.slow_link=") as e:
            parse_slow_link(spec, pp=4)
        assert why in str(e.value)

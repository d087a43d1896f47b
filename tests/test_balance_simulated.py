"""Balancer layouts scored by simulating the run's schedule (balance/simulated.py, pure): the simulated
choice is taken when it beats the min-bottleneck partition by more than the margin, a noise-level gap
leaves the partition alone, the margin grows with measured noise, and the batch follows simulated speed."""

from __future__ import annotations

import json

import pytest

from hybridpar.balance.control import Balancer, Decision
from hybridpar.balance.detect import StragglerDetector
from hybridpar.balance.repartition import CostModel, Layout, plan_layout, predicted_step
from hybridpar.balance.simulated import (
    ScheduleSim,
    choose_partition,
    neighbours,
    plan_layout_simulated,
    rank_balanced,
)
from hybridpar.config import BalanceConfig
from hybridpar.pipeline.partition import partition_by_cost, partition_uniform
from hybridpar.pipeline.schedules import build_schedule
from hybridpar.pipeline.simulate import Costs, simulate
from tests.test_balancer import group
from tests.test_rebalance import R

EIGHT = CostModel((1.0,) * 8)


def test_pipeline_step_is_the_simulated_schedule() -> None:
    # gpipe, one microbatch: the stages run one after another, so the step is the sum of stage times.
    assert ScheduleSim("gpipe", 1).pipeline_step([5.0, 2.0]) == pytest.approx(7.0)
    # Equal stages: the bubble formula, (m + p - 1) x stage time.
    assert ScheduleSim("1f1b", 4).pipeline_step([3.0] * 4) == pytest.approx(7 * 3.0)
    # Unequal stages: the simulator on the registry's action lists, forward : backward = 1 : 2.
    t = [2.0, 2.0, 4.0, 2.0]
    direct = simulate(build_schedule("1f1b", 4, 1, 4), 4, 4, Costs([x / 3 for x in t], [2 * x / 3 for x in t]))
    sim = ScheduleSim("1f1b", 4)
    assert sim.pipeline_step(t) == pytest.approx(direct.step_time_s) and direct.step_time_s < 7 * 4.0
    assert sim.pipeline_step(t) == sim.pipeline_step(t)  # the lowered program is reused


def test_sim_errors() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zb-h2'"):
        ScheduleSim("zb-h2", 4)
    with pytest.raises(ValueError, match="3 stages are not 2 per rank"):
        ScheduleSim("zb-v", 4, 2).pipeline_step([1.0] * 3)
    with pytest.raises(ValueError, match="microbatches and virtual_stages must be >= 1, got 0, 1"):
        ScheduleSim("1f1b", 0)
    with pytest.raises(ValueError, match="positive stage times"):
        ScheduleSim("1f1b", 4).pipeline_step([1.0, 0.0])
    with pytest.raises(ValueError, match=r"margin must be in \[0, 1\)"):
        plan_layout_simulated(Layout.uniform(R(4, 4), [4]), EIGHT, [[1.0, 1.0]], ScheduleSim("1f1b", 4), margin=1.0)


def test_neighbours_move_one_layer() -> None:
    assert neighbours(R(5, 3)) == [R(4, 4), R(6, 2)]
    assert neighbours(R(1, 2, 1)) == [R(2, 1, 1), R(1, 1, 2)]  # never an empty stage
    assert neighbours(R(1, 1)) == [] and neighbours(R(8)) == []


def test_simulated_choice_beats_min_bottleneck_by_a_clear_margin() -> None:
    # gpipe, one microbatch, stage 1 at 0.55 speed: the min-max partition is 5/3 (stages 5 and 5.45),
    # but the step is the sum of the stages, 5 + 3 / 0.55 = 10.45, and 6/2 makes it 6 + 2 / 0.55 = 9.64:
    # 7.8% shorter, beyond a 5% margin, though its slowest stage (6) is slower.
    speeds = [1.0, 0.55]
    assert tuple(partition_by_cost(EIGHT.layer_costs, 2, speeds=speeds)) == R(5, 3)
    sim = ScheduleSim("gpipe", 1)
    assert sim.per_sample(R(5, 3), EIGHT, speeds) == pytest.approx(5 + 3 / 0.55)
    assert sim.per_sample(R(6, 2), EIGHT, speeds) == pytest.approx(6 + 2 / 0.55)
    assert choose_partition(sim, EIGHT, speeds, 2, margin=0.05) == R(6, 2)
    assert choose_partition(sim, EIGHT, speeds, 2, margin=0.08) == R(5, 3)  # 7.8% is not beyond 8%
    # The bottleneck rule keeps 5/3.
    cur = Layout.uniform(R(4, 4), [1])
    assert plan_layout(cur, EIGHT, [speeds], repartition=True, resplit=True).parts == (R(5, 3),)
    assert plan_layout_simulated(cur, EIGHT, [speeds], sim, margin=0.05).parts == (R(6, 2),)


def test_simulation_agrees_with_min_bottleneck_1f1b_pp4() -> None:
    # 1f1b, pp=4, 4 microbatches, stage 2 at half speed: the min-bottleneck partition 3/2/1/2 also
    # simulates fastest of it and its one-layer neighbours, > 5% ahead (each checked against simulate()).
    speeds = [1.0, 1.0, 0.5, 1.0]
    sim = ScheduleSim("1f1b", 4)
    base = tuple(partition_by_cost(EIGHT.layer_costs, 4, speeds=speeds))

    def direct(parts: tuple[range, ...]) -> float:
        t = [c / v for c, v in zip(EIGHT.stage_costs(parts), speeds)]
        costs = Costs([x / 3 for x in t], [2 * x / 3 for x in t])
        return simulate(build_schedule("1f1b", 4, 1, 4), 4, 4, costs).step_time_s

    assert base == R(3, 2, 1, 2) and choose_partition(sim, EIGHT, speeds, 4, margin=0.0) == base
    assert direct(base) == pytest.approx(15.0) == 4 * sim.per_sample(base, EIGHT, speeds)
    assert all(direct(base) < 0.95 * direct(p) for p in neighbours(base))


def test_noise_level_gap_leaves_the_partition_alone() -> None:
    # 1f1b, pp=2, 4 microbatches (the live test's run), stage 1 10% slow: 5/3 simulates 0.5% faster
    # than 4/4, far inside the margin, so 4/4 stays; without a margin it would move.
    speeds = [1.0, 0.9]
    sim = ScheduleSim("1f1b", 4)
    gap = 1 - sim.per_sample(R(5, 3), EIGHT, speeds) / sim.per_sample(R(4, 4), EIGHT, speeds)
    assert 0 < gap < 0.01
    cur = Layout.uniform(R(4, 4), [11])
    assert plan_layout_simulated(cur, EIGHT, [speeds], sim, margin=0.05) == cur
    assert plan_layout_simulated(cur, EIGHT, [speeds], sim, margin=0.0).parts == (R(5, 3),)


def run(bal: Balancer, layout: Layout, series: list[list[float]]) -> tuple[list[Decision], Layout]:
    decisions = []
    for step, times in enumerate(series):
        d = bal.update(step, group(step, times), layout)
        if d is not None:
            decisions.append(d)
            layout = d.new
    return decisions, layout


def test_balancer_holds_still_on_jitter_at_pp2() -> None:
    # Stage 1 within 10% of stage 0, jittering: the first full window decides nothing.
    jitter = [0.97, 1.0, 1.03, 0.99, 1.01]
    series = [[1.0, 1.1 * jitter[s % 5]] for s in range(100)]
    bal = Balancer(BalanceConfig(mode="auto"), EIGHT, microbatches=4)
    assert run(bal, Layout.uniform(R(4, 4), [11]), series)[0] == []
    # From a lopsided 3/5 the same readings move to the min-bottleneck 4/4, not to 5/3, which simulates
    # 0.5% faster still: inside the margin.
    bal = Balancer(BalanceConfig(mode="auto"), EIGHT, microbatches=4)
    (d,), layout = run(bal, Layout.uniform(R(3, 5), [11]), series)
    assert layout.parts == (R(4, 4),) and d.margin == pytest.approx(0.05)
    assert d.simulated_step_after_s < d.simulated_step_before_s * 0.9


@pytest.mark.parametrize("spread, margin, sizes", [(0.0, 0.05, [6, 2]), (0.05, 0.10, [5, 3])])
def test_margin_grows_with_measured_noise(spread: float, margin: float, sizes: list[int]) -> None:
    # The gpipe case above through the Balancer: stage 1 at 0.55 speed from the start, decided on the
    # first full window (threshold 3: no straggler). Steady readings: margin = min_gain, the simulated
    # 6/2 is taken. Readings spread by a median absolute deviation of 5% (the window's median and its
    # second-quietest reading, which the plan reads, are the same): margin = 2 x 5% = 10% > 7.8%, the
    # min-bottleneck 5/3 is kept.
    series = [[1.0, (1 + spread * (-1, 0, 0, 1, 2)[s % 5]) / 0.55] for s in range(30)]
    bal = Balancer(BalanceConfig(mode="auto", threshold=3.0, window=5), EIGHT, microbatches=1, schedule="gpipe")
    (d,), _ = run(bal, Layout.uniform(R(4, 4), [1]), series)
    assert [len(r) for r in d.new.parts[0]] == sizes and d.margin == pytest.approx(margin)
    assert d.simulated_step_before_s == pytest.approx(4 + 4 / 0.55)
    assert d.simulated_step_after_s == pytest.approx(sizes[0] + sizes[1] / 0.55)
    # The bound, beside: (m + p - 1) x the slowest stage.
    assert d.predicted_step_after_s == pytest.approx(2 * max(sizes[0], sizes[1] / 0.55))
    rec = json.loads(json.dumps(d.to_record()))
    assert rec["margin"] == pytest.approx(margin) and rec["gain"] == pytest.approx(d.gain)
    assert Decision.from_record(rec) == d


def test_detector_noise_is_relative_mad() -> None:
    det = StragglerDetector(window=5)
    assert det.noise() == 0.0
    for x in (0.9, 0.95, 1.0, 1.05, 3.0):  # one spike: the range would say 2.1, the MAD says 0.05
        det.update(group(0, [2.0, x]))
    assert det.noise() == pytest.approx(0.05)


def test_split_follows_simulated_speed() -> None:
    # dp=2 x pp=2, gpipe, one microbatch: replica 0 at full speed (4/4, 8 per sample), replica 1's
    # stage 1 at 0.55 (6/2, 9.64 per sample). Samples go 1/8 : 1/9.64 -> 11/9 of 20; the bottleneck
    # rule (slowest stages 4 and 5.45, partition 5/3) would give 12/8.
    speeds = [[1.0, 1.0], [1.0, 0.55]]
    cur = Layout.uniform(R(4, 4), [10, 10])
    sim = ScheduleSim("gpipe", 1)
    new = plan_layout_simulated(cur, EIGHT, speeds, sim, margin=0.05)
    assert new.parts == (R(4, 4), R(6, 2)) and new.split == (11, 9)
    old = plan_layout(cur, EIGHT, speeds, repartition=True, resplit=True)
    assert old.parts == (R(4, 4), R(5, 3)) and old.split == (12, 8)
    assert sim.layout_step(new, EIGHT, speeds) == pytest.approx(max(11 * 8, 9 * (6 + 2 / 0.55)))
    assert sim.layout_step(new, EIGHT, speeds) < sim.layout_step(old, EIGHT, speeds)
    # The bound prefers the old layout: only the simulation sees the fill and drain.
    assert predicted_step(old, EIGHT, speeds, 1, "gpipe") < predicted_step(new, EIGHT, speeds, 1, "gpipe")
    # One partition for both replicas (ZeRO-3): replica 1's 6/2 suits replica 0 as well (8 per sample
    # either way), so the shared layout simulates as fast; the even one would take 12 x 8 = 96.
    shared = plan_layout_simulated(cur, EIGHT, speeds, sim, margin=0.05, shared=True)
    assert shared.parts == (R(6, 2), R(6, 2)) and shared.split == (11, 9)
    assert sim.layout_step(shared, EIGHT, speeds) == sim.layout_step(new, EIGHT, speeds)


def test_uniform_speeds_keep_the_even_partition() -> None:
    for pp, m in ((2, 4), (4, 4), (4, 8)):
        sim = ScheduleSim("1f1b", m)
        assert choose_partition(sim, EIGHT, [1.0] * pp, pp, margin=0.05) == tuple(partition_uniform(8, pp))


def test_bound_leads_back_to_min_bottleneck_after_recovery() -> None:
    # 1f1b, pp=4, 4 microbatches, all at full speed again on 3/2/1/2 (where a straggler left it): it
    # simulates no slower than the even 2/2/2/2 (a 14 s step for both, one sample per microbatch), so only the bound
    # (7 x 3 -> 7 x 2) leads back to the min-bottleneck partition.
    sim = ScheduleSim("1f1b", 4)
    assert sim.per_sample(R(3, 2, 1, 2), EIGHT, [1.0] * 4) == pytest.approx(
        sim.per_sample(R(2, 2, 2, 2), EIGHT, [1.0] * 4)
    )
    bal = Balancer(BalanceConfig(mode="auto"), EIGHT, microbatches=4)
    (d,), layout = run(bal, Layout.uniform(R(3, 2, 1, 2), [4]), [[1.0] * 4 for _ in range(16)])
    assert layout.parts == (R(2, 2, 2, 2),) and d.gain == pytest.approx(0.0, abs=1e-12)
    assert d.predicted_step_before_s == pytest.approx(7 * 3.0) and d.predicted_step_after_s == pytest.approx(7 * 2.0)


@pytest.mark.parametrize(
    "schedule, v, slow_stages", [("interleaved-1f1b", 2, (1, 3)), ("zb-v", 2, (1, 2)), ("zb-h1", 1, (1,))]
)
def test_slow_rank_sheds_layers_under_every_schedule(schedule: str, v: int, slow_stages: tuple[int, ...]) -> None:
    # pp=2, 8 layers, rank 1 twice as slow from the start (a position is a pipeline rank: its readings are
    # time per unit of its stages' work). Every stage the schedule places on rank 1 loses layers, and the
    # simulated step of the schedule that runs falls.
    series = [[1.0, 2.0] for _ in range(16)]
    bal = Balancer(BalanceConfig(mode="auto"), EIGHT, microbatches=4, schedule=schedule, virtual_stages=v)
    (d,), layout = run(bal, Layout.uniform(partition_uniform(8, 2 * v), [11]), series)
    sizes = [len(r) for r in layout.parts[0]]
    assert sum(sizes[s] for s in slow_stages) < 4 < sum(n for s, n in enumerate(sizes) if s not in slow_stages)
    assert d.simulated_step_after_s < 0.9 * d.simulated_step_before_s and len(d.speeds) == 2
    assert d.speeds == pytest.approx((1.0, 0.5))


def test_interleaved_search_finds_the_best_simulated_partition() -> None:
    # pp=4 interleaved (two chunks per rank), 4 microbatches, 24 layers, rank 2 at half speed. The min-max
    # stage partition (4/4/1/4/4/3/1/3) left rank 0 eight layers and no one-layer boundary move improves it
    # (9.5 per sample); the search reaches 8.9167, the best of every partition with 1..6 layers per chunk
    # (enumerated once: 245,157 of them, too slow to repeat here).
    sim, cost = ScheduleSim("interleaved-1f1b", 4, 2), CostModel((1.0,) * 24)
    speeds = [1.0, 1.0, 0.5, 1.0] * 2
    old = tuple(partition_by_cost(cost.layer_costs, 8, speeds=speeds))
    assert [len(r) for r in old] == [4, 4, 1, 4, 4, 3, 1, 3] and sim.per_sample(old, cost, speeds) == pytest.approx(9.5)
    assert all(sim.per_sample(p, cost, speeds) >= 9.5 for p in neighbours(old))
    chosen = choose_partition(sim, cost, speeds, 8, margin=0.05)
    assert sim.per_sample(chosen, cost, speeds) == pytest.approx(8.0 + 11 / 12)
    # Equal speeds keep the even partition: nothing beats it in simulation.
    assert choose_partition(sim, cost, [1.0] * 8, 8, margin=0.05) == tuple(partition_uniform(24, 8))


def test_rank_balanced_evens_each_ranks_sum() -> None:
    # The same case by busiest rank: 7/7/3/7 layers per rank (rank 2 at half speed: 6), where the min-max
    # stage partition gave rank 0 eight; each rank's chunks share its layers evenly, the earlier one more.
    cost = CostModel((1.0,) * 24)
    loop, v = (0, 1, 2, 3, 0, 1, 2, 3), (0, 1, 2, 3, 3, 2, 1, 0)
    parts = rank_balanced(cost, loop, [1.0, 1.0, 0.5, 1.0] * 2)
    assert [len(r) for r in parts] == [4, 4, 2, 4, 3, 3, 1, 3]
    assert ScheduleSim("interleaved-1f1b", 4, 2).busiest_rank(parts, cost, [1.0, 1.0, 0.5, 1.0] * 2) == 7.0
    assert [len(r) for r in rank_balanced(cost, v, [1.0] * 8)] == [3] * 8
    # The embedding and head weigh on the ranks that hold the first and last stage (rank 0 both, V).
    heavy = CostModel((1.0,) * 24, first_extra=3.0, last_extra=3.0)
    # 30 units over 4 ranks: rank 0 keeps one layer per chunk (2 + 6), the others 8/7/7.
    assert [len(r) for r in rank_balanced(heavy, v, [1.0] * 8)] == [1, 4, 4, 4, 3, 3, 4, 1]
    with pytest.raises(ValueError, match="4 layers cannot fill 8 stages"):
        rank_balanced(CostModel((1.0,) * 4), loop, [1.0] * 8)

"""Tests for hybridpar.balance.balancer: load scores, straggler hysteresis, exact DP splits,
re-partition decisions and the controller's policy (modes, interval, give-back on recovery)."""
from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import numpy as np
import pytest

from hybridpar.balance.balancer import (
    Balancer,
    BalancerConfig,
    RankSample,
    StragglerDetector,
    load_scores,
    plan_repartition,
    predicted_pipeline_step,
    relative_speeds,
    split_by_speed,
)
from hybridpar.batching.split import plan_batch, split_evenly
from hybridpar.pipeline.partition import partition_uniform
from hybridpar.pipeline.schedules import build_schedule
from hybridpar.pipeline.simulate import Costs, simulate


def sample(rank: int, compute_s: float, step: int = 0, **kw: float) -> RankSample:
    return RankSample(rank=rank, step=step, compute_s=compute_s,
                      step_time_s=kw.pop("step_time_s", 1.0), **kw)  # type: ignore[arg-type]


def group(step: int, times: list[float]) -> list[RankSample]:
    return [sample(r, t, step) for r, t in enumerate(times)]


# --- load scores -------------------------------------------------------------------------------

def test_load_scores_tutorial_weights_by_hand() -> None:
    samples = [
        sample(0, 1.0, memory_used_bytes=40, memory_total_bytes=100, comm_wait_s=0.1),
        sample(1, 2.0, comm_wait_s=0.5, step_time_s=2.0),  # memory unknown -> 0
        sample(2, 4.0, memory_used_bytes=300, memory_total_bytes=200, comm_wait_s=0.0),
    ]
    scores = load_scores(samples)
    # 0.4 * memory + 0.4 * compute + 0.2 * network
    assert scores[0] == pytest.approx(0.4 * 0.4 + 0.4 * 0.0 + 0.2 * 0.1)
    assert scores[1] == pytest.approx(0.4 * 0.0 + 0.4 * 0.5 + 0.2 * 0.25)
    assert scores[2] == pytest.approx(0.4 * 1.0 + 0.4 * 0.75 + 0.2 * 0.0)  # memory capped at 1
    assert load_scores(samples, (2, 2, 1)) == pytest.approx(scores)
    # Compute weight only: 1 - score is exactly the relative speed (work goes inversely to load).
    only_compute = load_scores(samples, (0, 1, 0))
    speeds = relative_speeds(samples)
    assert {r: 1 - s for r, s in only_compute.items()} == pytest.approx(speeds)
    assert speeds == pytest.approx({0: 1.0, 1: 0.5, 2: 0.25})


@pytest.mark.parametrize("weights", [(0, 0, 0), (0.5, -0.1, 0.6), (0.4, 0.4), (1, float("nan"), 1)])
def test_load_score_weights_validated(weights: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="weights must be three finite numbers"):
        load_scores([sample(0, 1.0)], weights)


def test_samples_validated() -> None:
    with pytest.raises(ValueError, match="two samples for rank 1"):
        relative_speeds([sample(1, 1.0), sample(1, 2.0)])
    with pytest.raises(ValueError, match="no samples"):
        load_scores([])
    with pytest.raises(ValueError, match="compute_s must be finite and > 0"):
        sample(0, 0.0)
    with pytest.raises(ValueError, match="step_time_s must be finite and > 0"):
        sample(0, 1.0, step_time_s=math.inf)
    with pytest.raises(ValueError, match="comm_wait_s must be >= 0"):
        sample(0, 1.0, comm_wait_s=-1.0)
    with pytest.raises(ValueError, match="memory_total_bytes > 0"):
        sample(0, 1.0, memory_total_bytes=0)
    with pytest.raises(ValueError, match="rank and step must be >= 0"):
        sample(-1, 1.0)


# --- straggler detection -----------------------------------------------------------------------

def run_detector(det: StragglerDetector, series: list[list[float]]) -> list[tuple[int, set, set]]:
    """Feed per-step times; return (step, new, recovered) for every update that changed."""
    out = []
    for step, times in enumerate(series):
        st = det.update(group(step, times))
        if st.changed:
            out.append((step, set(st.new), set(st.recovered)))
    return out


def test_no_alarm_on_jitter() -> None:
    rng = random.Random(0)
    series = [[rng.uniform(0.9, 1.1) for _ in range(4)] for _ in range(200)]
    assert run_detector(StragglerDetector(), series) == []


def test_no_action_on_isolated_spikes() -> None:
    # Every 4th step one random rank takes 3x as long: never `patience` in a row after smoothing.
    rng = random.Random(1)
    series = [[3.0 if (s % 4 == 0 and r == rng.randrange(4)) else 1.0 for r in range(4)]
              for s in range(200)]
    assert run_detector(StragglerDetector(), series) == []
    # ...but a raw (window=1) detector with patience 1 would have flapped on them.
    assert run_detector(StragglerDetector(window=1, patience=1, cooldown=0), series) != []


def test_smoothing_catches_intermittent_slowdown() -> None:
    # Rank 3 is slow two steps out of three: never `patience` raw steps in a row, but a sustained
    # loss that the windowed median sees.
    series = [[1.0, 1.0, 1.0, 1.0 if s % 3 == 2 else 2.0] for s in range(60)]
    assert [new for _, new, _ in run_detector(StragglerDetector(), series)] == [{3}]
    assert run_detector(StragglerDetector(window=1), series) == []


@pytest.mark.parametrize("cooldown, recovered_at", [(0, 6), (3, 9)])
def test_cooldown_freezes_state_after_change(cooldown: int, recovered_at: int) -> None:
    series = [[1.0, 2.0 if s == 5 else 1.0] for s in range(20)]
    det = StragglerDetector(window=1, patience=1, cooldown=cooldown)
    assert run_detector(det, series) == [(5, {1}, set()), (recovered_at, set(), {1})]


def test_recovery_needs_patience_right_after_detection() -> None:
    # Slow for exactly `patience` steps, then fast: the recovery streak starts from zero.
    series = [[1.0, 2.0 if 5 <= s < 8 else 1.0] for s in range(20)]
    det = StragglerDetector(window=1, patience=3, cooldown=0)
    assert run_detector(det, series) == [(7, {1}, set()), (10, set(), {1})]


def test_compares_against_the_others_only() -> None:
    # Two ranks, one 1.4x slower: against the other rank that is above 1.25 (a median that
    # included the rank itself would see only 1.4 / 1.2 = 1.17).
    series = [[1.0, 1.4] for _ in range(20)]
    assert [new for _, new, _ in run_detector(StragglerDetector(), series)] == [{1}]
    assert run_detector(StragglerDetector(), [[1.0] for _ in range(20)]) == []  # alone: never


@pytest.mark.parametrize("window, patience", [(5, 3), (1, 3), (3, 2), (4, 1), (7, 4)])
def test_detects_2x_slowdown_within_latency(window: int, patience: int) -> None:
    rng = random.Random(window * 10 + patience)
    onset = 30
    series = [[rng.uniform(0.95, 1.05) * (2.0 if (r == 2 and s >= onset) else 1.0)
               for r in range(4)] for s in range(80)]
    det = StragglerDetector(window=window, patience=patience)
    changes = run_detector(det, series)
    assert changes and changes[0][1] == {2}
    latency = changes[0][0] - onset + 1  # observations of the slow rank, inclusive
    assert latency <= det.max_latency
    assert latency >= patience  # never on fewer than `patience` observations
    if window == 1:
        assert latency == patience
    assert len(changes) == 1 and det.stragglers == {2}


def test_no_flapping_around_threshold() -> None:
    rng = random.Random(2)
    # Rank 1 hovers around the threshold (1.25) but never below the recovery bound (1.125).
    series = [[1.0, rng.uniform(1.15, 1.35), 1.0, 1.0] for _ in range(300)]
    changes = run_detector(StragglerDetector(), series)
    assert len(changes) <= 1 and all(not rec for _, _, rec in changes)
    # Same without hysteresis (recover bound just under the threshold): it flaps.
    flappy = StragglerDetector(recover_threshold=1.2499, cooldown=0, window=1, patience=1)
    assert len(run_detector(flappy, series)) > 10


def test_recovery_detected() -> None:
    series = [[1.0, 1.0, 2.0 if 10 <= s < 60 else 1.0] for s in range(100)]
    det = StragglerDetector()
    changes = run_detector(det, series)
    assert [(new, rec) for _, new, rec in changes] == [({2}, set()), (set(), {2})]
    assert changes[1][0] - 60 + 1 <= det.max_latency
    assert det.stragglers == frozenset()


def test_detector_args_validated() -> None:
    for kw, words in (({"threshold": 1.0}, "threshold must be > 1.0"),
                      ({"recover_threshold": 1.3}, "recover_threshold must be in"),
                      ({"window": 0}, "window must be >= 1"),
                      ({"patience": 0}, "patience must be >= 1"),
                      ({"cooldown": -1}, "cooldown must be >= 0")):
        with pytest.raises(ValueError, match=words):
            StragglerDetector(**kw)  # type: ignore[arg-type]


# --- data-parallel split -----------------------------------------------------------------------

def test_tutorial_formula_loses_samples_ours_does_not() -> None:
    total = 10
    # The tutorial's distribute_workload: int(total * (1 - score) / (n - sum(scores))).
    scores = [0.1, 0.2, 0.3]
    naive = [int(total * (1 - s) / (len(scores) - sum(scores))) for s in scores]
    assert sum(naive) == 8 != total
    # Even the plain proportional int(total * share) drops samples.
    speeds = [1.0, 1.0, 1.0]
    assert sum(int(total * s / sum(speeds)) for s in speeds) == 9
    assert split_by_speed(total, speeds) == [4, 3, 3]
    assert sum(split_by_speed(total, [1 - s for s in scores])) == total


def check_hamilton(total: int, speeds: list[float], sizes: list[int]) -> None:
    """Largest-remainder characterisation: floor or ceil of the quota, and every replica rounded
    up has a remainder >= every replica rounded down (ties to the lower index)."""
    w = [Fraction(s) for s in speeds]
    quota = [total * x / sum(w) for x in w]
    rem = [q - math.floor(q) for q in quota]
    up = [i for i in range(len(sizes)) if sizes[i] == math.floor(quota[i]) + 1]
    down = [i for i in range(len(sizes)) if sizes[i] == math.floor(quota[i])]
    assert len(up) + len(down) == len(sizes)
    for i in up:
        for j in down:
            assert rem[i] > rem[j] or (rem[i] == rem[j] and i < j)


def test_split_randomized() -> None:
    rng = random.Random(3)
    for _ in range(3000):
        n = rng.randint(1, 9)
        lo = rng.choice([1, 1, 2, 3])
        total = rng.randint(n * lo, n * lo + rng.choice([0, 1, 7, 64, 513]))
        speeds = [rng.choice([1.0, 0.5, rng.uniform(0.05, 1.0)]) for _ in range(n)]
        sizes = split_by_speed(total, speeds, lo)
        assert sum(sizes) == total and len(sizes) == n and min(sizes) >= lo
        w = [Fraction(s) for s in speeds]
        if all(total * x / sum(w) >= lo for x in w):  # no replica pinned: pure proportional
            check_hamilton(total, speeds, sizes)
        assert plan_batch(total, n, 1, replica_sizes=sizes).global_batch == total
        assert split_by_speed(total, speeds, lo) == sizes  # deterministic


def test_split_equal_speeds_is_even_split() -> None:
    for n in range(1, 8):
        for total in range(n, 40):
            assert split_by_speed(total, [0.7] * n) == split_evenly(total, n)


def test_split_tiny_and_pinned() -> None:
    assert split_by_speed(3, [100.0, 1.0, 1.0]) == [1, 1, 1]
    assert split_by_speed(5, [1000.0, 1.0, 1.0]) == [3, 1, 1]
    assert split_by_speed(1, [0.3]) == [1]
    assert split_by_speed(np.int64(10), np.array([2.0, 1.0, 1.0])) == [5, 3, 2]
    assert split_by_speed(7, [1.0, 1.0]) == [4, 3]
    assert split_by_speed(32, [1.0, 0.5, 1.0, 1.0]) == [9, 5, 9, 9]
    # Pinning one replica re-shares the rest proportionally among the others.
    assert split_by_speed(12, [1.0, 1.0, 0.01], min_per_replica=2) == [5, 5, 2]


def test_split_errors() -> None:
    with pytest.raises(ValueError, match="at least 2 samples each from a global batch of 5"):
        split_by_speed(5, [1.0, 1.0, 1.0], min_per_replica=2)
    with pytest.raises(ValueError, match="speeds must be finite and > 0"):
        split_by_speed(4, [1.0, 0.0])
    with pytest.raises(ValueError, match="min_per_replica must be an integer >= 1"):
        split_by_speed(5, [1.0], min_per_replica=0)
    with pytest.raises(ValueError, match="speeds is empty"):
        split_by_speed(4, [])
    with pytest.raises(ValueError, match="global_batch must be a positive integer"):
        split_by_speed(4.0, [1.0])  # type: ignore[arg-type]


# --- pipeline re-partition ---------------------------------------------------------------------

def test_repartition_moves_work_off_slow_stage_and_gives_it_back() -> None:
    costs = [1.0] * 12
    uniform = partition_uniform(12, 4)
    same = plan_repartition(costs, [1.0] * 4, uniform)
    assert not same.apply and same.gain == 0.0 and "already optimal" in same.reason

    slow = plan_repartition(costs, [1.0, 1.0, 0.5, 1.0], uniform)
    assert slow.apply and slow.before_s == pytest.approx(6.0)
    assert len(slow.new_parts[2]) < 3 and slow.after_s < slow.before_s
    assert slow.gain == pytest.approx(1 - slow.after_s / slow.before_s) and slow.gain >= 0.05

    back = plan_repartition(costs, [1.0] * 4, list(slow.new_parts))
    assert back.apply and back.new_parts == tuple(uniform)
    assert len(back.new_parts[2]) > len(slow.new_parts[2])


def test_repartition_min_gain_blocks_small_moves() -> None:
    costs = [1.0] * 16
    uniform = partition_uniform(16, 2)
    # Stage 1 at 0.85: 8/8 -> 9.41, best 9/7 -> 9.0, a gain of 4.4%: worth it only below 5%.
    small = plan_repartition(costs, [1.0, 0.85], uniform)
    assert small.new_parts == (range(0, 9), range(9, 16))
    assert small.gain == pytest.approx(1 - 9.0 / (8 / 0.85))
    assert not small.apply and "below min_gain 5%" in small.reason
    assert plan_repartition(costs, [1.0, 0.85], uniform, min_gain=0.04).apply
    with pytest.raises(ValueError, match="min_gain must be in"):
        plan_repartition(costs, [1.0, 1.0], uniform, min_gain=1.5)


def test_predicted_step_matches_simulator() -> None:
    rng = random.Random(4)
    for pp in (1, 2, 3, 4):
        for m in (1, 2, 4, 8):
            for name in ("gpipe", "1f1b"):
                sim = simulate(build_schedule(name, pp, 1, m, 1), pp, pp, Costs(1.0, 2.0))
                assert predicted_pipeline_step([3.0] * pp, m, name) == pytest.approx(sim.step_time_s)
                t = [rng.uniform(0.5, 2.0) for _ in range(pp)]
                sim = simulate(build_schedule(name, pp, 1, m, 1), pp, pp,
                               Costs([x / 3 for x in t], [2 * x / 3 for x in t]))
                assert sim.step_time_s <= predicted_pipeline_step(t, m, name) + 1e-9
    with pytest.raises(ValueError, match="not modelled"):
        predicted_pipeline_step([1.0], 2, "zb-h1")


# --- controller --------------------------------------------------------------------------------

def drive(bal: Balancer, series: list[list[float]], split: list[int]) -> list:
    """Data-parallel trainer loop: apply every applied decision to the split."""
    decisions = []
    for step, times in enumerate(series):
        d = bal.update(step, group(step, times), current_split=split)
        if d is not None:
            decisions.append(d)
            if d.applied:
                split = list(d.new)
    return decisions


def test_off_mode_does_nothing() -> None:
    bal = Balancer(BalancerConfig(mode="off"))
    series = [[1.0, 3.0] for _ in range(100)]
    assert drive(bal, series, [8, 8]) == [] and bal.detector.smoothed() == {}


def test_data_rebalance_detect_vs_auto_and_give_back() -> None:
    series = [[1.0, 2.0 if 10 <= s < 80 else 1.0, 1.0, 1.0] for s in range(160)]
    auto = drive(Balancer(BalancerConfig(mode="auto")), series, [8, 8, 8, 8])
    assert [d.kind for d in auto] == ["data", "data"] and all(d.applied for d in auto)
    first, back = auto
    assert first.old == (8, 8, 8, 8) and first.new == (9, 5, 9, 9) and first.stragglers == (1,)
    assert first.predicted_step_before_s == pytest.approx(16.0)
    assert first.predicted_step_after_s == pytest.approx(10.0)
    assert back.old == (9, 5, 9, 9) and back.new == (8, 8, 8, 8) and back.stragglers == ()
    assert "recovered" in back.reason and "straggles" in first.reason

    detect = drive(Balancer(BalancerConfig(mode="detect")), series, [8, 8, 8, 8])
    # Reported, not applied: the split never changes, so the recovery needs no decision.
    assert [(d.new, d.applied) for d in detect] == [((9, 5, 9, 9), False)]


def test_interval_respected() -> None:
    # Rank 0 slows down and recovers every 12 steps: faster than the interval allows.
    series = [[2.0 if (s // 12) % 2 else 1.0, 1.0, 1.0] for s in range(400)]
    for interval in (1, 20, 50):
        decisions = drive(Balancer(BalancerConfig(mode="auto", min_interval_steps=interval)),
                          series, [5, 5, 5])
        steps = [d.step for d in decisions]
        assert len(steps) >= 2
        assert all(b - a >= interval for a, b in zip(steps, steps[1:]))
    # The recovery that arrives inside the interval is acted on as soon as it ends.
    series = [[1.0, 2.0 if 5 <= s < 15 else 1.0] for s in range(100)]
    steps = [d.step for d in drive(Balancer(BalancerConfig(mode="auto")), series, [6, 6])]
    assert len(steps) == 2 and steps[1] == steps[0] + 20


def test_steady_after_rebalance_and_initial_heterogeneity() -> None:
    rng = random.Random(6)
    # Replica 1 is 20% slower from the start: below the straggler threshold, but the first full
    # window still rebalances it once, and jitter afterwards never triggers another move.
    series = [[rng.uniform(0.97, 1.03), 1.2 * rng.uniform(0.97, 1.03)] for _ in range(300)]
    decisions = drive(Balancer(BalancerConfig(mode="auto")), series, [10, 10])
    assert len(decisions) == 1 and decisions[0].step == 4 and decisions[0].stragglers == ()
    assert decisions[0].new == (11, 9)


def test_waits_for_every_replica_to_report() -> None:
    bal = Balancer(BalancerConfig(mode="auto"))
    for step in range(10):  # replica 2 silent: the due evaluation waits
        assert bal.update(step, group(step, [1.0, 2.0]), current_split=[4, 4, 4]) is None
    d = bal.update(10, group(10, [1.0, 2.0, 1.0]), current_split=[4, 4, 4])
    assert d is not None and d.new == (5, 2, 5)


def test_data_min_gain() -> None:
    # Replica 1 is 10% slower: 50/50 -> 52/48 cuts the step from 55 to 52.8, a 4% gain.
    series = [[1.0, 1.1] for _ in range(30)]
    assert drive(Balancer(BalancerConfig(mode="auto")), series, [50, 50]) == []
    (d,) = drive(Balancer(BalancerConfig(mode="auto", min_gain=0.03)), series, [50, 50])
    assert d.new == (52, 48) and d.gain == pytest.approx(1 - 52.8 / 55)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_pipeline_decision_and_record(scale: float) -> None:
    costs = [1.0] * 8
    parts = partition_uniform(8, 4)
    bal = Balancer(BalancerConfig(mode="auto", microbatches=4, min_interval_steps=5))
    decisions = []
    for step in range(120):
        slow = 10 <= step < 60
        # Seconds per unit of modelled cost: all devices `scale` x slower only scales the times.
        times = [scale * t for t in (1.0, 1.0, 2.0 if slow else 1.0, 1.0)]
        d = bal.update(step, group(step, times), layer_costs=costs, current_parts=parts)
        if d is not None:
            decisions.append(d)
            parts = list(d.new)  # type: ignore[arg-type]
    assert [d.kind for d in decisions] == ["pipeline", "pipeline"]
    first, back = decisions
    assert len(first.new[2]) == 1 and back.new == tuple(partition_uniform(8, 4))  # type: ignore
    assert first.predicted_step_before_s == pytest.approx((4 + 4 - 1) * 4.0 * scale)
    assert first.predicted_step_after_s == pytest.approx((4 + 4 - 1) * 3.0 * scale)
    rec = json.loads(json.dumps(first.to_record()))
    assert rec["event"] == "rebalance" and rec["kind"] == "pipeline" and rec["applied"] is True
    assert rec["old"] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert rec["gain"] == pytest.approx(first.gain) and rec["speeds"][2] == pytest.approx(0.5)


def test_controller_errors() -> None:
    with pytest.raises(ValueError, match="balance mode 'on' is not one of off, detect, auto"):
        Balancer(BalancerConfig(mode="on"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold must be > 1.0"):
        Balancer(BalancerConfig(threshold=0.9))
    bal = Balancer(BalancerConfig(mode="detect"))
    with pytest.raises(ValueError, match="exactly one of current_parts"):
        bal.update(0, group(0, [1.0]), current_split=[1], current_parts=[range(0, 1)])
    with pytest.raises(ValueError, match="needs layer_costs"):
        bal.update(0, group(0, [1.0]), current_parts=[range(0, 1)])
    bal.update(3, group(3, [1.0]), current_split=[1])
    with pytest.raises(ValueError, match="step 3 does not follow step 3"):
        bal.update(3, group(3, [1.0]), current_split=[1])

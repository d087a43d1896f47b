"""Microbatch policies against synthetic measurements (pure: no processes, no clocks)."""

from __future__ import annotations

import json
import math
import random

import pytest

from hybridpar.batching.adaptive import AdaptivePolicy
from hybridpar.batching.fixed import FixedPolicy, split_by_size
from hybridpar.batching.split import plan_batch, split_evenly

TOKENS_PER_SAMPLE = 128


def pipeline_time(sizes: list[int], pp: int = 4, a: float = 1e-3, b: float = 2.5e-4) -> float:
    """1F1B step time: (m + pp - 1) slots of the slowest microbatch, each a + b * size seconds — the
    per-microbatch overhead favours few microbatches, the bubble (pp - 1) / m favours many."""
    return (len(sizes) + pp - 1) * (a + b * max(sizes))


def drive(
    policy: AdaptivePolicy,
    steps: int,
    time_fn,
    peak_fn=lambda s: None,
    noise: float = 0.0,
    seed: int = 0,
    start: int = 0,
) -> list[list[int]]:
    rng = random.Random(seed)
    proposed = []
    for step in range(start, start + steps):
        sizes = policy.propose(step)
        proposed.append(sizes)
        t = time_fn(sizes) * (1 + rng.uniform(-noise, noise))
        policy.observe(step, sizes, t, peak_fn(sizes), sum(sizes) * TOKENS_PER_SAMPLE)
    return proposed


@pytest.mark.parametrize("n,count", [(7, 3), (13, 5), (1, 1), (64, 7), (9, 9)])
def test_fixed_count_sums_exactly(n: int, count: int) -> None:
    sizes = FixedPolicy(n, count=count).propose(0)
    assert sum(sizes) == n and len(sizes) == count and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n,size", [(10, 4), (7, 7), (7, 100), (13, 1), (63, 8), (65, 8)])
def test_fixed_size_sums_exactly(n: int, size: int) -> None:
    sizes = FixedPolicy(n, size=size).propose(0)
    assert sum(sizes) == n and max(sizes) <= size and len(sizes) == math.ceil(n / size)
    assert max(sizes) - min(sizes) <= 1  # balanced: 10 by 4 is [4, 3, 3], not [4, 4, 2]


def test_fixed_bad_inputs() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        FixedPolicy(8, count=2, size=4)
    with pytest.raises(ValueError, match="exactly one"):
        FixedPolicy(8)
    with pytest.raises(ValueError, match="cannot split 3 samples into 4"):
        FixedPolicy(3, count=4)
    p = FixedPolicy(8, count=2)
    with pytest.raises(ValueError, match="sum to 8"):
        p.observe(0, [4, 3], 1.0, None, 10)


def best_count(n: int, counts, time_fn) -> int:
    return min(counts, key=lambda m: time_fn(split_evenly(n, m)))


def test_adaptive_converges_to_true_best_noise_free() -> None:
    n, counts = 64, range(4, 17)  # 5, 6, 7, 9, ... do not divide 64: unequal sizes
    p = AdaptivePolicy(n, 1, min_microbatches=4, candidates=counts, in_flight=4)
    proposed = drive(p, 160, pipeline_time)
    st = p.statistics()
    assert st["converged"] and len(st["current_split"]) == best_count(n, counts, pipeline_time) == 8
    # 13 candidates x (1 warm-up + 3 measured steps), then the best three (8, 6, 5) race again: 6
    # stays 2.2% behind, so passes go on until the noise estimate (shrunk towards 5% while the blocks
    # agree) is small enough to drop it: at most max_passes = 8, 7 more passes x 3 candidates x 4 steps.
    assert 52 + 12 < st["steps_to_converge"] <= 52 + 84
    assert all(len(s) == 8 for s in proposed[st["steps_to_converge"] :])
    assert all(sum(s) == n for s in proposed)
    json.dumps(st)  # goes to metrics.jsonl


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_noisy_converges_and_never_oscillates(seed: int) -> None:
    n, counts = 64, range(4, 17)
    p = AdaptivePolicy(n, 1, min_microbatches=4, candidates=counts, in_flight=4)
    proposed = drive(p, 136 + 200, pipeline_time, noise=0.03, seed=seed)
    st = p.statistics()
    assert st["converged"] and st["steps_to_converge"] <= 136 and st["rounds"] == 1
    after = proposed[st["steps_to_converge"] :]
    assert len(after) >= 200 and all(s == after[0] for s in after)  # 200+ steps, one split
    best = pipeline_time(split_evenly(n, best_count(n, counts, pipeline_time)))
    assert pipeline_time(after[0]) <= best * 1.03  # within the noise of the true best


def _drive_by_step(policy: AdaptivePolicy, steps: int, time_fn) -> None:
    """drive() with a step time that depends on the step too (a shared machine's quiet or busy spell)."""
    for step in range(steps):
        sizes = policy.propose(step)
        policy.observe(step, sizes, time_fn(step, sizes), None, sum(sizes) * TOKENS_PER_SAMPLE)


@pytest.mark.parametrize("spell", [0.8, 1.3], ids=["quiet-spell-on-a-loser", "busy-spell-on-the-best"])
def test_one_noisy_block_does_not_decide(spell: float) -> None:
    """4 microbatches are 10% faster than 2. The one block of pass 1 that catches a quiet spell (on 2)
    or a busy one (on 4) makes 2 lead by 12-18%; a policy deciding from that block keeps 2 for good.
    The re-check passes measure both again and pool the blocks' readings: 4 wins."""
    victim = 2 if spell < 1 else 4
    first_block = {4: range(0, 4), 2: range(4, 8)}[victim]  # most microbatches first: 4, then 2

    def time_fn(step: int, sizes: list[int]) -> float:
        base = 1.0 if len(sizes) == 4 else 1.1
        return base * (spell if step in first_block else 1.0)

    p = AdaptivePolicy(8, 1, candidates=[2, 4], cooldown_steps=1000)
    _drive_by_step(p, 60, time_fn)
    st = p.statistics()
    assert st["converged"] and len(st["current_split"]) == 4, st["history"]
    assert [h["pass"] for h in st["history"]][:2] == [1, 1] and st["history"][-1]["pass"] > 1


def test_adaptive_default_candidates_respect_min_microbatches() -> None:
    p = AdaptivePolicy(64, 1, min_microbatches=4, in_flight=4)
    assert p.candidates == [64, 32, 16, 8, 7, 6, 5, 4]  # sizes 1, 2, 4, ... and every count below 2x the minimum
    # Noise-free, 8, 6 and 5 microbatches lie within 3% of each other: the race takes its 8 passes
    # over them before it settles (88 steps).
    drive(p, 100, pipeline_time)
    assert p.statistics()["current_split"] == [8] * 8
    with pytest.raises(ValueError, match=r"min_microbatches=9 must be in \[1, 8\]"):
        AdaptivePolicy(16, 2, min_microbatches=9)
    with pytest.raises(ValueError, match="multiple of 3"):
        AdaptivePolicy(8, 1, candidates=[4, 8], count_multiple=3)


def test_hysteresis_keeps_incumbent_against_a_close_candidate() -> None:
    # Phase 1: 4 microbatches clearly best. Phase 2 (a slowdown of 20% on every split forces a re-scan):
    # 2 microbatches become 2% better than 4 — within the 3% margin, so no switch; with margin 0 it would.
    def phase1(s):
        return 1.0 if len(s) == 4 else 1.2

    def phase2(s):
        return 1.2 / 1.02 if len(s) == 2 else 1.2

    for margin, expect in ((0.03, 4), (0.0, 2)):
        p = AdaptivePolicy(8, 1, candidates=[2, 4], switch_margin=margin, cooldown_steps=0)
        drive(p, 40, phase1)  # decided, then a first window of steady state: the drift baseline
        assert len(p.propose(40)) == 4 and p.rounds == 1
        drive(p, 80, phase2, start=40)
        assert p.rounds == 2 and p.statistics()["converged"]
        assert len(p.propose(120)) == expect


def test_drift_rescans_after_cooldown_and_adapts() -> None:
    # A stage slows down for large microbatches: the former best (4 x 16) loses by far; the policy
    # re-scans, but not before the cooldown since its decision.
    def before(s):
        return pipeline_time(s)

    def after(s):
        return pipeline_time(s) * (3.0 if max(s) >= 8 else 1.0)

    p = AdaptivePolicy(64, 1, min_microbatches=4, in_flight=4, cooldown_steps=50)
    drive(p, 120, before)  # decided (88 steps), and windows of steady state since: the drift baseline
    decided = p.statistics()["steps_to_converge"]
    assert p.propose(0) == [8] * 8 and decided <= 120 - 3 * 8
    proposed = drive(p, 200, after, start=120)
    rescan_at = 120 + next(i for i, s in enumerate(proposed) if s != [8] * 8)
    assert rescan_at >= decided + 50
    assert p.rounds == 2 and p.propose(0) == [4] * 16


@pytest.mark.parametrize("base,expect", [(0, 2), (100_000, 1)])
def test_budget_just_above_one_small_microbatch_is_never_exceeded(base: int, expect: int) -> None:
    per_sample = 1_000_000
    budget = base + 2 * per_sample + 50_000  # just above a microbatch of 2 samples

    def peak(s):
        return base + per_sample * max(s)

    def no_pipeline(s):
        return len(s) * (1e-3 + 1e-4 * max(s))  # bigger microbatches always faster

    free = AdaptivePolicy(32, 1)
    drive(free, 60, no_pipeline, peak)
    assert max(free.propose(0)) == 32  # without the budget it would go big: the budget binds
    p = AdaptivePolicy(32, 1, memory_budget_bytes=budget)
    for step in range(100):
        s = p.propose(step)
        pred = p.predict_peak(s)  # what the policy believed when it proposed s
        assert (pred is None and step == 0) or pred <= budget
        assert peak(s) <= budget
        p.observe(step, s, no_pipeline(s), peak(s), sum(s) * TOKENS_PER_SAMPLE)
    st = p.statistics()
    # With a fixed overhead (base > 0) one observation at size 1 gives 1.1 MB/sample, so size 2 is
    # predicted at 2.2 MB > budget and never tried: conservative by design.
    assert st["converged"] and max(st["current_split"]) == expect and not st["over_budget"]
    assert st["bytes_per_sample"] >= per_sample


def test_budget_counts_microbatches_in_flight() -> None:
    # 1F1B on stage 0 keeps pp = 4 microbatches alive: 16 samples in flight fit, 32 do not.
    budget = 17 * 1_000_000

    def peak(s):
        return 1_000_000 * sum(sorted(s, reverse=True)[:4])

    p = AdaptivePolicy(64, 1, min_microbatches=4, in_flight=4, memory_budget_bytes=budget)
    proposed = drive(p, 60, pipeline_time, peak)
    assert all(peak(s) <= budget for s in proposed)
    assert p.propose(0) == [4] * 16  # 8 x 8 (the unconstrained best) holds 32 samples in flight


def test_budget_from_fraction_and_bad_budgets() -> None:
    p = AdaptivePolicy(8, 1, memory_fraction=0.5, memory_total_bytes=1000, memory_baseline_bytes=100)
    assert p.budget == 400
    with pytest.raises(ValueError, match="needs memory_total_bytes"):
        AdaptivePolicy(8, 1, memory_fraction=0.5)
    with pytest.raises(ValueError, match="must be > 0"):
        AdaptivePolicy(8, 1, memory_fraction=0.1, memory_total_bytes=1000, memory_baseline_bytes=100)


def test_on_oom_shrinks_and_keeps_the_sum() -> None:
    p = AdaptivePolicy(32, 1)  # no budget: only OOMs teach it
    drive(p, 60, lambda s: len(s) * (1e-3 + 1e-4 * max(s)))
    assert p.propose(60) == [32]
    seen = []
    for step in range(60, 70):
        old = p.propose(step)
        if max(old) == 1:
            with pytest.raises(RuntimeError, match="no smaller split"):
                p.on_oom(step, old)
            break
        new = p.on_oom(step, old)
        assert sum(new) == 32 and max(new) < max(old) and new == p.propose(step)
        seen.append(max(new))
        drive(p, 12, lambda s: len(s) * (1e-3 + 1e-4 * max(s)), start=step)
        assert max(p.propose(step)) <= max(new)  # never grows back past an OOM
    assert seen == [16, 8, 4, 2, 1]
    with pytest.raises(ValueError, match="do not sum"):
        p.on_oom(99, [1, 2])


def test_on_oom_halves_when_no_candidate_is_below() -> None:
    p = AdaptivePolicy(12, 1, candidates=[1])
    assert p.on_oom(0, [12]) == [6, 6]
    assert p.on_oom(0, [6, 6]) == [3, 3, 3, 3]
    assert p.on_oom(1, [3, 3, 3, 3]) == [1] * 12
    with pytest.raises(RuntimeError):
        p.on_oom(2, [1] * 12)


def test_adaptive_is_deterministic_and_plans_every_replica() -> None:
    runs = []
    for _ in range(2):
        p = AdaptivePolicy(64, 1, min_microbatches=4, candidates=range(4, 17), in_flight=4)
        runs.append((drive(p, 80, pipeline_time, noise=0.03, seed=7), p.statistics()["history"]))
    assert runs[0] == runs[1]
    q = AdaptivePolicy(20, 3, dp_rank=2, candidates=[2])
    # The trainer plans every replica with the policy's count (batching/policy.py plan_for -> plan_batch).
    plan = plan_batch(20, 3, len(q.propose(0)))
    assert plan.sizes == ((4, 3), (4, 3), (3, 3)) and plan.global_batch == 20 and q.propose(0) == [3, 3]


def test_split_by_size_rejects_zero() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        split_by_size(8, 0)


def test_memory_model_is_the_more_conservative_of_ratio_and_fit() -> None:
    p = AdaptivePolicy(8, 1)
    assert p.predict_peak([4, 4]) is None  # nothing measured: no guess
    p.observe(0, [1] * 8, 1.0, 100, 8)
    assert p.predict_peak([4, 4]) == pytest.approx(400)  # 100 bytes/sample
    p.observe(1, [2] * 4, 1.0, 250, 8)  # grows faster than linear from 0: the fit (slope 150) wins
    assert p.predict_peak([4, 4]) == pytest.approx(550)
    p.observe(2, [2] * 4, 1.0, 200, 8)  # a lower peak at the same size never lowers the estimate
    assert p.predict_peak([4, 4]) == pytest.approx(550)


def test_faster_incumbent_rebaselines_instead_of_rescanning() -> None:
    """Throughput of the chosen split rising (a quieter machine) is no reason to probe slower splits."""
    state = {"speedup": 1.0}
    p = AdaptivePolicy(64, 1, min_microbatches=4, in_flight=4, cooldown_steps=5)
    drive(p, 100, lambda s: pipeline_time(s) / state["speedup"])
    assert p.rounds == 1 and not p.exploring
    chosen = p.propose(0)
    state["speedup"] = 1.5
    drive(p, 60, lambda s: pipeline_time(s) / state["speedup"], start=100)
    assert p.rounds == 1 and p.propose(0) == chosen


@pytest.mark.parametrize("global_batch,dp", [(11, 2), (10, 3), (7, 2), (16, 2)])
def test_unequal_replicas_propose_the_same_count_every_step(global_batch: int, dp: int) -> None:
    # Each replica's ranks build their own policy from its (unequal) batch; fed the same world-reduced
    # observations they must keep proposing one count, or the replicas' scans measure each other.
    pols = [
        AdaptivePolicy(global_batch, dp, dp_rank=r, steps_per_candidate=1, warmup_steps=0, cooldown_steps=0)
        for r in range(dp)
    ]
    assert len({tuple(p.candidates) for p in pols}) == 1
    rng = random.Random(global_batch)
    for step in range(40):
        counts = {len(p.propose(step)) for p in pols}
        assert len(counts) == 1, (step, [p.propose(step) for p in pols])
        t, peak = rng.uniform(0.5, 1.5), rng.randrange(1000, 2000)
        for p in pols:
            p.observe(step, p.propose(step), t, peak, global_batch * 8)


def _feed(pols: list[AdaptivePolicy], steps: range, seed: int) -> list[list[int]]:
    rng, proposed = random.Random(seed), []
    for step in steps:
        t, peak = rng.uniform(0.5, 1.5), rng.randrange(1000, 2000)
        proposed.append([len(p.propose(step)) for p in pols])
        for p in pols:
            p.observe(step, p.propose(step), t, peak, 64 * 8)
    return proposed


def test_policy_state_round_trips_through_json_and_goes_on_identically() -> None:
    kw = dict(
        min_microbatches=2,
        in_flight=2,
        steps_per_candidate=2,
        warmup_steps=0,
        cooldown_steps=3,
        drift_margin=0.05,
        memory_budget_bytes=60_000,
    )
    a = AdaptivePolicy(64, 2, **kw)
    _feed([a], range(0, 13), seed=1)
    b = AdaptivePolicy(64, 2, **kw)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert json.loads(json.dumps(b.state_dict())) == json.loads(json.dumps(a.state_dict()))
    seq = _feed([a, b], range(13, 60), seed=2)
    assert all(x == y for x, y in seq), seq
    assert a.statistics() == b.statistics()


def test_policy_state_of_another_run_is_refused_by_name() -> None:
    state = AdaptivePolicy(16, 1).state_dict()
    with pytest.raises(ValueError, match=r"replica batches \[16\], this run has \[12\]"):
        AdaptivePolicy(12, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="does not allow"):  # an interleaved schedule wants multiples of 4
        AdaptivePolicy(16, 1, min_microbatches=4, count_multiple=4).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        AdaptivePolicy(16, 1).load_state_dict({**state, "version": 9})


def test_median_confidence_interval_of_the_bench() -> None:
    from hybridpar.bench.microbatch import median_ci95

    assert median_ci95([1.0, 2.0, 3.0]) == (1.0, 3.0)  # too few for 95%: the full range
    xs = [float(i) for i in range(1, 11)]  # n = 10: P(Binomial(10, 1/2) <= 1) = 1.1% -> 2nd and 9th
    assert median_ci95(xs[::-1]) == (2.0, 9.0)
    assert median_ci95([float(i) for i in range(1, 21)]) == (6.0, 15.0)  # n = 20: 6th and 15th


def test_bench_verdict_is_decisive_only_with_a_narrow_interval() -> None:
    from hybridpar.bench.microbatch import judge_ratios, parse_args

    tight = [1.0 + 0.001 * i for i in range(20)]  # interval 1.005-1.014
    v = judge_ratios(tight)
    assert v["decisive"] and v["verdict"] == "adaptive >= 0.95x best fixed" and v["ratio_half_width"] < 0.025
    above = [0.97 + 0.006 * i for i in range(20)]  # interval 1.0-1.054: half-width 0.027, wholly above 0.95
    assert judge_ratios(above)["verdict"] == "adaptive >= 0.95x best fixed"
    wide = [0.7 + 0.03 * i for i in range(20)]  # interval 0.85-1.12: median 0.985 decides nothing
    v = judge_ratios(wide)
    assert not v["decisive"] and v["verdict"] == "not decisive" and v["ratio_ci95"] == pytest.approx([0.85, 1.12])
    assert v["interval_vs_floor"] == "contains"
    v = judge_ratios([1.0 + 0.0134 * i for i in range(20)])  # above 0.95, but half-width 0.06: spread > 5%
    assert v["interval_vs_floor"] == "above" and not v["decisive"]
    low = [0.90 + 0.001 * i for i in range(20)]
    assert judge_ratios(low)["verdict"] == "adaptive < 0.95x best fixed"
    straddle = [0.94 + 0.001 * i for i in range(20)]  # narrow, but 0.95 inside: no side to report
    assert judge_ratios(straddle)["verdict"] == "not decisive"
    # Five rounds: even their full range is not a 95% interval (2 / 32 > 5%); one round is no interval.
    assert not judge_ratios([1.0, 1.001, 1.002, 1.003, 1.004])["decisive"] and not judge_ratios([0.1])["decisive"]
    assert judge_ratios([1.0, 1.001, 1.002, 1.003, 1.004, 1.005])["decisive"]
    assert parse_args(["--background-load", "2"]).background_load == 2


def test_bench_drops_a_finalist_only_when_shown_more_than_5_percent_slower() -> None:
    from hybridpar.bench.microbatch import slower

    best = [100.0 + i % 3 for i in range(20)]
    assert slower([90.0] * 20, best)  # 10% slower in every round
    assert not slower([97.0] * 20, best)  # 3% slower: could still be the best fixed split under noise
    assert not slower([90.0] * 5, best[:5])  # five rounds are no 95% interval
    noisy = [90.0 * (1.3 if i % 2 else 0.8) for i in range(20)]  # median 0.9x, interval up to ~1.2x
    assert not slower(noisy, best)

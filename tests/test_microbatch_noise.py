"""The adaptive microbatch policy on a noisy machine (issue 19), with synthetic readings: pure, seeded,
no processes, no clocks.

Noise model: every step's time is the true one times a factor uniform in [0.85, 1.15] (30% spread) and,
in 5% of steps, times 3 (a neighbour's job). The true curve is the 1F1B one of test_microbatch_policy.py over the
default candidates of a 64-sample batch at pp=4: 8 microbatches are best, 6 reach 97.8% of it, 5
97.1%, 4 and 7 94.3%, 16 86.8%, 32 62.9%, 64 39.4%. "Right" means a split within 5% of the true best:
8, 6 or 5."""

from __future__ import annotations

import math
import random
from statistics import median

import pytest

from hybridpar.batching.adaptive import AdaptivePolicy
from hybridpar.batching.race import judge
from hybridpar.batching.split import split_evenly

N, COUNTS, SEEDS = 64, (64, 32, 16, 8, 7, 6, 5, 4), range(200)


def pipeline_time(sizes: list[int], pp: int = 4, a: float = 1e-3, b: float = 2.5e-4) -> float:
    return (len(sizes) + pp - 1) * (a + b * max(sizes))


def noise(rng: random.Random) -> float:
    return (1 + rng.uniform(-0.15, 0.15)) * (3.0 if rng.random() < 0.05 else 1.0)


def right(m: int, time_fn=pipeline_time, margin: float = 0.05) -> bool:
    best = min(time_fn(split_evenly(N, c)) for c in COUNTS)
    return best / time_fn(split_evenly(N, m)) >= 1 - margin


def run(seed: int, steps: int, time_fn, policy: AdaptivePolicy | None = None, start: int = 0) -> AdaptivePolicy:
    """Drive a policy from step `start` to `steps` (time_fn(step, sizes)), then on until its race ends."""
    rng = random.Random(seed)
    p = policy or AdaptivePolicy(N, 1, min_microbatches=4, in_flight=4)
    step = start
    while step < steps or p.exploring:
        s = p.propose(step)
        p.observe(step, s, time_fn(step, s) * noise(rng), None, sum(s) * 128)
        step += 1
    return p


def stationary(step: int, sizes: list[int]) -> float:
    return pipeline_time(sizes)


def naive(seed: int) -> int:
    """The policy issue 19 warns against: one reading per candidate, keep the fastest."""
    rng = random.Random(seed)
    return min(COUNTS, key=lambda m: pipeline_time(split_evenly(N, m)) * noise(rng))


def test_noisy_readings_find_the_best_where_one_reading_does_not() -> None:
    policies, racing, loss = [], [], []  # per seed, after settling: share of steps racing, time lost
    best = min(pipeline_time(split_evenly(N, c)) for c in COUNTS)
    for seed in SEEDS:
        rng, p, flags, times = random.Random(seed), AdaptivePolicy(N, 1, min_microbatches=4, in_flight=4), [], []
        for step in range(1000):
            s = p.propose(step)
            flags.append(p.exploring)
            times.append(pipeline_time(s))
            p.observe(step, s, times[-1] * noise(rng), None, sum(s) * 128)
        policies.append(p)
        settled = p.statistics()["steps_to_converge"]
        racing.append(sum(flags[settled:]) / len(flags[settled:]))
        loss.append(sum(times[settled:]) / (best * len(times[settled:])) - 1)
    hits = sum(right(len(p.propose(0))) for p in policies) / len(SEEDS)
    naive_hits = sum(right(naive(seed)) for seed in SEEDS) / len(SEEDS)
    # Measured: 0.975 and 0.785 (three of the eight splits count as right; with the five power-of-two
    # counts alone, where only 8 does: 0.96 and 0.63).
    assert hits >= 0.95 and naive_hits <= 0.85, (hits, naive_hits)
    # The cost of settling: 8 candidates x (1 warm-up + 3 measured) steps, then at most 7 passes over
    # the best three: 8 x 4 + 7 x 3 x 4 = 116, plus the few blocks measured on because most of their
    # steps were slow. 8, 6 and 5 lie within 3% of each other, so most races take every pass.
    # Measured: median 116 steps, at most 120.
    settle = sorted(p.statistics()["steps_to_converge"] for p in policies)
    assert settle[-1] <= 130 and median(settle) <= 120, settle
    # Settled, the policy races now and then: a re-check of the winner 500 steps after its decision
    # (both splits' steps count here; two passes while the winner leads, up to eight when a rival a
    # few % away leads), rarely a re-scan for drift that was noise. Measured: racing median 1.8%,
    # 90th percentile 7.1%, re-scans in 1% of seeds. What racing near-equal splits costs is small: the
    # time lost against the true best after settling is median 0.07%, 90th percentile 3.0% (a run
    # settled on 5 or 6 microbatches).
    racing.sort()
    loss.sort()
    assert racing[len(racing) // 2] <= 0.025 and racing[int(0.9 * len(racing))] <= 0.08, racing[-20:]
    assert loss[len(loss) // 2] <= 0.005 and loss[int(0.9 * len(loss))] <= 0.035, loss[-20:]
    assert sum(p.rounds > 1 for p in policies) <= 0.03 * len(SEEDS)


def test_rechecks_space_out_while_they_keep_the_winner() -> None:
    """A long stationary run: each full cycle of re-checks that keeps the winner doubles the interval
    (500, then 1000, 2000, 4000 steps), so racing stays a small share of the run."""
    rng, p, flags = random.Random(7), AdaptivePolicy(N, 1, min_microbatches=4, in_flight=4), []
    for step in range(20_000):
        s = p.propose(step)
        flags.append(p.exploring)
        p.observe(step, s, pipeline_time(s) * noise(rng), None, sum(s) * 128)
    starts = [i for i in range(1, len(flags)) if flags[i] and not flags[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    after = flags[p.statistics()["steps_to_converge"] :]
    # Seven other splits: three re-checks ~500 apart, three ~1000 apart, ... (a race lasts ~16 steps);
    # with a fixed 500-step interval there would be ~39. Measured: 12 re-checks, racing 1.7% of the
    # steps; before the back-off and the cap, 5.7% over 5000 steps.
    assert p.rechecks <= 16 and max(gaps) >= 3900, (p.rechecks, gaps)
    assert sum(after) / len(after) <= 0.02 and right(len(p.propose(0)))


def test_one_lucky_window_is_not_the_drift_baseline() -> None:
    """The first steady window after the decision catches a quiet spell (25% faster); after it the
    machine is as before. Judged against that one window, every later one would look 20% slower and
    the policy would re-scan; against the median of its steady windows it stays."""
    p = AdaptivePolicy(N, 1, min_microbatches=4, in_flight=4, cooldown_steps=0)
    step, quiet = 0, None
    while step < 400:
        s = p.propose(step)
        if quiet is None and not p.exploring:
            quiet = range(step, step + p.drift_window)
        p.observe(step, s, pipeline_time(s) / (1.25 if quiet and step in quiet else 1.0), None, sum(s) * 128)
        step += 1
    assert p.rounds == 1 and p.rechecks == 0 and p.propose(0) == [8] * 8


def test_no_split_is_chosen_from_one_block() -> None:
    """Noise-free and a 2x gap: still the leader's block is repeated before the decision."""
    p = AdaptivePolicy(8, 1, candidates=[2, 4], cooldown_steps=1000)
    run(0, 0, lambda step, s: 1.0 if len(s) == 2 else 2.0, p)
    passes = [(len(h["split"]), h["pass"]) for h in p.statistics()["history"]]
    assert passes[:2] == [(4, 1), (2, 1)] and (2, 2) in passes and len(p.propose(0)) == 2


@pytest.mark.parametrize("seed", range(20))
def test_adapts_when_the_incumbent_slows_down(seed: int) -> None:
    """After step 300 a neighbour's job slows microbatches of 8+ samples 1.6x: 16 x 4 becomes best.
    The incumbent (8 x 8) drifts down, the policy races afresh and moves."""

    def load(step: int, s: list[int]) -> float:
        return pipeline_time(s) * (1.6 if step >= 300 and max(s) >= 8 else 1.0)

    p = run(seed, 300, load)
    before = len(p.propose(0))
    p = run(seed + 1000, 600, load, p, start=300)
    assert len(p.propose(0)) == 16 and (p.rounds >= 2 or before == 16), p.statistics()["history"][-6:]


def test_a_recheck_finds_a_runner_up_that_got_faster() -> None:
    """The incumbent (8 x 8) keeps its speed, the runner-up (4 x 16) gets 1.3x faster: no drift to
    see, the periodic re-checks of the winner (against each other split in turn) find it. With seven
    other splits, 4 comes up third or fourth; a re-check it loses by bad luck (one of its two blocks
    hit slow steps) puts it last, and the interval doubles every three re-checks that keep the winner:
    then it is found a cycle later. Measured: 89 of 100 seeds within 1,600 steps, 99 within 3,000."""
    found = 0
    for seed in range(40):
        p = run(seed, 100, stationary, AdaptivePolicy(N, 1, min_microbatches=4, in_flight=4, recheck_steps=250))

        def faster(step: int, s: list[int]) -> float:
            return pipeline_time(s) / (1.3 if len(s) == 4 else 1.0)

        p = run(seed + 1000, 3000, faster, p, start=100)
        found += len(p.propose(0)) == 4 and p.rechecks >= 1
    assert found >= 38, found


def test_race_verdicts() -> None:
    log = math.log
    # One block each: noise unknown, nothing settled, the best three go on.
    v = judge({1: [log(1.0)], 2: [log(2.0)], 3: [log(1.5)], 4: [log(0.5)]}, margin=0.03)
    assert v.noise is None and not v.settled and v.survivors == [2, 3, 1]
    # Two blocks, a clear gap: the loser is dropped, settled.
    v = judge({1: [log(1.0), log(1.02)], 2: [log(2.0), log(1.96)]}, margin=0.03)
    assert v.settled and v.survivors == [2]
    # A close call with noisy blocks: both stay, not settled.
    v = judge({1: [log(1.0), log(1.2)], 2: [log(1.05), log(1.15)]}, margin=0.03)
    assert not v.settled and set(v.survivors) == {1, 2}
    # Equal within the margin and quiet: settled without a winner shown; ties go to more microbatches.
    v = judge({1: [0.0] * 12, 2: [0.0] * 12}, margin=0.03)
    assert v.settled and v.leader == 2 and v.survivors == [2, 1]
    # One block of three slow steps' worth (log 3) is one large residual, not the noise level.
    quiet = {m: [log(m)] * 4 for m in (1, 2)}
    v = judge({**quiet, 3: [log(3.0)] * 3 + [log(1.0)]}, margin=0.03)
    assert v.noise < 0.1


def test_load_that_comes_and_goes_is_judged_by_the_windows_own_spread() -> None:
    """A neighbour's load that moves whole stretches of steps together (log step time an AR(1) process,
    sd 0.11, time constant ~10 steps) on top of 8% per-step noise: the band a window may stray from the
    baseline is widened to three robust sds of the baseline windows themselves. Measured: re-scans in
    6% of 200 runs of 1,000 steps (13.5% when a re-check the rival won re-scanned too); judged by the
    race's per-step noise alone, 20.5%."""
    rescans, hits = 0, 0
    for seed in SEEDS:
        rng, x = random.Random(seed), 0.0
        p = AdaptivePolicy(N, 1, min_microbatches=4, in_flight=4)
        for step in range(1000):
            x = 0.9 * x + rng.gauss(0, 0.05)
            s = p.propose(step)
            p.observe(step, s, pipeline_time(s) * math.exp(x) * (1 + rng.gauss(0, 0.08)), None, sum(s) * 128)
        rescans += p.rounds > 1
        hits += right(len(p.propose(0)))
        # Every drift re-scan is on record (a re-check the runner-up wins re-scans too, without a drift).
        assert len(p.statistics()["drifts"]) <= p.rounds - 1 and all(
            d["window"] < d["baseline"] * (1 - d["band"]) for d in p.statistics()["drifts"]
        )
    assert rescans <= 0.16 * len(SEEDS) and hits >= 0.85 * len(SEEDS), (rescans, hits)

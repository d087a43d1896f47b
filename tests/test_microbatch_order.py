"""The order unequal microbatches run in (batching/order.py) and the simulator's per-microbatch
costs it relies on. Pure: no processes."""

from __future__ import annotations

import itertools

import pytest

from hybridpar.batching.order import pipeline_order
from hybridpar.pipeline.schedules import build_schedule
from hybridpar.pipeline.simulate import Costs, simulate


def _step(sizes, schedule="1f1b", pp=2, v=1) -> float:
    acts = build_schedule(schedule, pp, v, len(sizes))
    split = schedule == "zb-h1"
    return simulate(
        acts, pp, pp * v, Costs(1.0, 1.0 if split else 2.0, 1.0 if split else 0.0, microbatch_scale=list(sizes))
    ).step_time_s


def test_simulator_scales_each_microbatch():
    acts = build_schedule("gpipe", 2, 1, 2)
    plain = simulate(acts, 2, 2, Costs(1.0, 2.0)).step_time_s
    assert simulate(acts, 2, 2, Costs(1.0, 2.0, microbatch_scale=[1.0, 1.0])).step_time_s == plain
    assert simulate(acts, 2, 2, Costs(1.0, 2.0, microbatch_scale=[2.0, 2.0])).step_time_s == 2 * plain
    # GPipe on 2 stages, sizes (2, 1): F0.0 0-2, F0.1 2-3, F1.0 2-4, F1.1 4-5, B1.0 5-9, B1.1 9-11,
    # B0.0 9-13, B0.1 13-15 (B0.1 needs B1.1, done at 11, and rank 0 is free at 13).
    assert simulate(acts, 2, 2, Costs(1.0, 2.0, microbatch_scale=[2.0, 1.0])).step_time_s == 15.0
    with pytest.raises(ValueError, match="microbatch_scale has 3 entries for 2 microbatches"):
        simulate(acts, 2, 2, Costs(1.0, 2.0, microbatch_scale=[1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="microbatch_scale must be finite numbers > 0"):
        Costs(1.0, 2.0, microbatch_scale=[1.0, 0.0])


def test_small_microbatches_go_to_the_ends_where_that_shortens_the_step():
    # 10 samples in 4: larger-first takes 39 units, small ones at both ends 36 (= 10 in 5 equal ones).
    assert pipeline_order([3, 3, 2, 2], "1f1b", 2) == [2, 3, 3, 2]
    assert (_step([3, 3, 2, 2]), _step([2, 3, 3, 2]), _step([2] * 5)) == (39.0, 36.0, 36.0)
    assert pipeline_order([3, 3, 3, 2, 2, 2, 2, 2], "1f1b", 4) == [2, 2, 2, 3, 3, 3, 2, 2]


def test_equal_sizes_and_ties_keep_the_given_order():
    assert pipeline_order([4, 4, 4, 4], "1f1b", 4) == [4, 4, 4, 4]
    assert pipeline_order([5], "gpipe", 2) == [5]
    # GPipe on 2 stages: (4, 1, 2, 3) is already as short as any candidate.
    assert pipeline_order([4, 1, 2, 3], "gpipe", 2) == [4, 1, 2, 3]


@pytest.mark.parametrize(
    "schedule,pp,v",
    [
        ("gpipe", 2, 1),
        ("1f1b", 2, 1),
        ("1f1b", 3, 1),
        ("1f1b", 4, 1),
        ("interleaved-1f1b", 2, 2),
        ("interleaved-1f1b", 4, 2),
        ("zb-h1", 2, 1),
        ("zb-h1", 4, 1),
    ],
)
def test_the_order_is_a_permutation_never_slower_than_the_split(schedule, pp, v):
    for m in (pp, 2 * pp):
        for total in range(m + 1, 3 * m):
            q, r = divmod(total, m)
            given = [q + 1] * r + [q] * (m - r)
            got = pipeline_order(given, schedule, pp, v)
            assert sorted(got) == sorted(given)
            assert _step(got, schedule, pp, v) <= _step(given, schedule, pp, v)


def test_an_exhaustive_search_finds_little_more():
    # On small cases the best of all orders beats the chosen one by at most a unit of F.
    for sizes in ([3, 3, 2, 2], [3, 2, 2, 2], [4, 4, 3, 3, 3, 3]):
        best = min(_step(p) for p in set(itertools.permutations(sizes)))
        assert _step(pipeline_order(sizes, "1f1b", 2)) <= best + 1.0

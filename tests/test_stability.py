"""The stability figures (report/stability.py) on synthetic timelines whose answers are known by hand."""

from __future__ import annotations

import statistics

import pytest

from hybridpar.report.stability import DEFINITIONS, Episode, outliers, stability, straggler_episodes


def steps(first: int, last: int, start: float, each: float = 1.0) -> list[dict]:
    """Steps first..last back to back from `start`, `each` seconds apiece: end times start+each, ..."""
    return [
        {"step": s, "time": start + (i + 1) * each, "step_time_s": each} for i, s in enumerate(range(first, last + 1))
    ]


def test_fault_free_run() -> None:
    run = steps(0, 9, start=2.0)  # started at t=2, steps end at 3..12
    st = stability(run, [], starts=[2.0], faults=[], ledger={"lost_samples": 0, "duplicated_samples": 0})
    assert st.wall_s == 10.0 and st.productive_s == 10.0 and st.goodput == 1.0
    assert st.interruptions == 0 and st.mttr_s is None and st.mtbf_s is None
    assert st.recomputed_steps == 0 and st.lost_samples == 0 and st.duplicated_samples == 0
    assert st.step_time_cv == 0.0 and st.outlier_steps == [] and st.straggler_episodes == []


def test_one_fault_known_goodput_mttr_mtbf() -> None:
    # Attempt 0 starts at 0 and trains steps 0-4 (ends 1..5); its checkpoint holds 3 steps; a fault fires
    # at 5.5. Attempt 1 starts at 8, resumes at step 3, its first step starts at 9: steps 3-9 end 10..16.
    first = steps(0, 4, start=0.0)
    second = steps(3, 9, start=9.0)
    kept = first[:3] + second
    st = stability(
        kept, first[3:], starts=[0.0, 8.0], faults=[5.5], ledger={"lost_samples": 0, "duplicated_samples": 0}
    )
    assert st.wall_s == 16.0
    assert st.productive_s == 10.0 and st.goodput == pytest.approx(10 / 16)
    assert st.interruptions == 1 and st.mttr_s == pytest.approx(3.5)  # fault at 5.5 -> step start at 9
    assert st.mtbf_s == pytest.approx(16 - 3.5)  # up time / one failure
    assert st.recomputed_steps == 2


def test_two_interruptions_one_without_a_recorded_fault() -> None:
    # Attempt 0: steps 0-3 end 1..4, killed with no chaos record: the failure is its last step's end (4).
    # Attempt 1 starts at 6; first step starts at 7 (repair 3); steps 4-5 end 8, 9; fault at 9.5.
    # Attempt 2 starts at 12; first step starts at 13.5 (repair 4); steps 6-7 end 15.5, 17.5 (2 s each).
    a = steps(0, 3, start=0.0)
    b = steps(4, 5, start=7.0)
    c = steps(6, 7, start=13.5, each=2.0)
    st = stability(a + b + c, [], starts=[0.0, 6.0, 12.0], faults=[9.5])
    assert st.wall_s == 17.5 and st.productive_s == 10.0
    assert st.interruptions == 2  # repairs of 3 and 4 s
    assert st.mttr_s == pytest.approx(3.5) and st.mtbf_s == pytest.approx((17.5 - 7.0) / 2)
    assert st.lost_samples is None  # no final record: no ledger
    # CV without each attempt's first step (0, 4 and 6): steps 1-3, 5 take 1 s, step 7 takes 2 s.
    warm = [1.0, 1.0, 1.0, 1.0, 2.0]
    assert st.step_time_cv == pytest.approx(statistics.pstdev(warm) / statistics.fmean(warm))


def test_an_attempt_that_trains_nothing_is_one_outage_with_the_one_before() -> None:
    # Attempt 0: steps 0-3 end 1..4, then killed (failure at 4). Attempt 1 starts at 6 and fails before any
    # step (a node lost as the round starts: seen in `hybridpar report` of an elastic run). Attempt 2 starts
    # at 10; its first step starts at 11: one outage from 4 to 11, whose two repairs (4 -> 11 and 6 -> 11)
    # overlap. Summing them made up time 12 - 12 = 0 s here, and negative on the real run.
    a = steps(0, 3, start=0.0)
    c = steps(4, 4, start=11.0)
    st = stability(a + c, [], starts=[0.0, 6.0, 10.0], faults=[])
    assert st.wall_s == 12.0 and st.interruptions == 2
    assert st.mttr_s == pytest.approx((7 + 5) / 2)  # each interruption's own repair
    assert st.mtbf_s == pytest.approx((12 - 7) / 2)  # up time: wall less the outage, counted once


def test_outliers_by_the_far_out_fence() -> None:
    values = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 5.0, 1.02]
    assert outliers(values) == [7]
    assert outliers([1.0, 1.0, 9.0]) == []  # too few steps to have quartiles
    run = [{"step": i, "time": float(i + 1), "step_time_s": v} for i, v in enumerate([1.0, *values])]
    assert stability(run, [], starts=[0.0], faults=[]).outlier_steps == [8]


def _ranks(compute: list[float], work: list[float]) -> dict:
    return {"compute_s": compute, "work": work}


def test_straggler_episodes_per_unit_of_work() -> None:
    # Rank 1 does twice rank 0's work, so twice the time is its normal; rank 2 is 2x slow on steps 3-6
    # and rank 0 only on step 9, once (below patience: no episode).
    recs = []
    for s in range(12):
        c = [1.0, 2.0, 1.0]
        if 3 <= s <= 6:
            c[2] = 2.0 * (1.5 if s == 5 else 1.0)
        if s == 9:
            c[0] = 3.0
        recs.append({"step": s, "ranks": _ranks(c, [1.0, 2.0, 1.0])})
    assert straggler_episodes(recs) == [Episode(rank=2, first_step=3, last_step=6, peak_ratio=3.0)]
    assert straggler_episodes(recs, patience=1) == [Episode(2, 3, 6, 3.0), Episode(0, 9, 9, 3.0)]
    assert straggler_episodes(recs, threshold=3.5) == []


def test_every_figure_has_its_definition_and_no_steps_is_refused() -> None:
    for name in (
        "goodput",
        "MTTR",
        "MTBF",
        "recomputed steps",
        "lost / duplicated samples",
        "step-time CV",
        "straggler episodes",
    ):
        assert DEFINITIONS[name]
    with pytest.raises(ValueError, match="no step records"):
        stability([], [], starts=[0.0], faults=[])

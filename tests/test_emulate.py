"""Tests for hybridpar.balance.emulate: the slow-device emulation spec, its errors and its lookups."""

from __future__ import annotations

import pytest

from hybridpar.balance.emulate import Slowdown, SlowdownPlan


def test_empty_spec_is_off() -> None:
    for spec in ("", "   "):
        plan = SlowdownPlan.parse(spec)
        assert not plan and plan.entries == ()
        assert plan.factor(0, 0) == 1.0 and plan.factor(7, 10**6) == 1.0
        assert plan.extra_delay_s(0, 5, 0.3) == 0.0


def test_single_entry_applies_from_its_step() -> None:
    plan = SlowdownPlan.parse("rank=2:2.0@step=10")
    assert plan.entries == (Slowdown(rank=2, factor=2.0, step=10),)
    assert [plan.factor(2, s) for s in (0, 9, 10, 11, 500)] == [1.0, 1.0, 2.0, 2.0, 2.0]
    assert plan.factor(1, 50) == 1.0 and plan.factor(3, 50) == 1.0
    assert plan.extra_delay_s(2, 10, 0.25) == pytest.approx(0.25)
    assert plan.extra_delay_s(2, 9, 0.25) == 0.0


def test_list_with_recovery_latest_entry_wins() -> None:
    # Out of order on purpose: the lookup must go by step, not by position in the spec.
    plan = SlowdownPlan.parse(" rank=2:1.0@step=50 , rank=0:1.5@step=0,rank=2:2.0@step=10," "rank=2:3.0@step=30")
    assert plan.ranks == frozenset({0, 2})
    assert plan.factor(0, 0) == 1.5 and plan.factor(0, 99) == 1.5
    got = {s: plan.factor(2, s) for s in (0, 10, 29, 30, 49, 50, 1000)}
    assert got == {0: 1.0, 10: 2.0, 29: 2.0, 30: 3.0, 49: 3.0, 50: 1.0, 1000: 1.0}


def test_step_defaults_to_zero_and_round_trip() -> None:
    plan = SlowdownPlan.parse("rank=1:1.25,rank=3:4@step=7")
    assert plan.factor(1, 0) == 1.25 and plan.factor(3, 6) == 1.0 and plan.factor(3, 7) == 4.0
    assert SlowdownPlan.parse(plan.to_spec()) == plan


@pytest.mark.parametrize(
    "spec, bad",
    [
        ("rank=2:2.0@step=x", "rank=2:2.0@step=x"),
        ("rank=2", "rank=2"),
        ("rank=2:2.0,", "''"),
        ("rank=1:1.5;rank=2:2.0", "rank=1:1.5;rank=2:2.0"),
        ("rnk=2:2.0@step=1", "rnk=2:2.0@step=1"),
        ("rank=2:two@step=1", "rank=2:two@step=1"),
        ("rank=2.5:2.0", "rank=2.5:2.0"),
    ],
)
def test_malformed_token_names_token_and_form(spec: str, bad: str) -> None:
    with pytest.raises(ValueError) as err:
        SlowdownPlan.parse(spec)
    msg = str(err.value)
    assert bad in msg
    assert "rank=<int>:<factor>@step=<int>" in msg


@pytest.mark.parametrize(
    "spec, words",
    [
        ("rank=-1:2.0@step=0", "rank and step must be >= 0"),
        ("rank=1:2.0@step=-3", "rank and step must be >= 0"),
        ("rank=1:0.5", "factor must be a finite number >= 1.0"),
        ("rank=1:0", "factor must be a finite number >= 1.0"),
        ("rank=1:nan", "factor must be a finite number >= 1.0"),
        ("rank=1:inf@step=2", "factor must be a finite number >= 1.0"),
        ("rank=1:2.0@step=4,rank=1:3.0@step=4", "already has a factor at step 4"),
    ],
)
def test_bad_values(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SlowdownPlan.parse(spec)


def test_validate_world_size() -> None:
    plan = SlowdownPlan.parse("rank=0:1.5,rank=3:2.0@step=1")
    plan.validate(4)
    with pytest.raises(ValueError, match=r"rank\(s\) \[3\] but world size is 3"):
        plan.validate(3)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        plan.validate(0)
    SlowdownPlan.parse("").validate(1)


def test_negative_compute_refused() -> None:
    with pytest.raises(ValueError, match="compute_s must be >= 0"):
        SlowdownPlan.parse("rank=0:2").extra_delay_s(0, 0, -1.0)

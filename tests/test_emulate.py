"""Tests for hybridpar.emulate: the slow-device emulation spec, its errors and its lookups (slowdown.py),
and how a run enters emulation through `Trainer.attach` (attach.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from hybridpar.config import Config
from hybridpar.emulate.attach import emulated_devices
from hybridpar.emulate.slowdown import Slowdown, SlowdownPlan


def test_empty_spec_is_off() -> None:
    for spec in ("", "   "):
        plan = SlowdownPlan.parse(spec)
        assert not plan and plan.entries == ()
        assert plan.factor(0, 0) == 1.0 and plan.factor(7, 10**6) == 1.0


def test_single_entry_applies_from_its_step() -> None:
    plan = SlowdownPlan.parse("rank=2:2.0@step=10")
    assert plan.entries == (Slowdown(rank=2, factor=2.0, step=10),)
    assert [plan.factor(2, s) for s in (0, 9, 10, 11, 500)] == [1.0, 1.0, 2.0, 2.0, 2.0]
    assert plan.factor(1, 50) == 1.0 and plan.factor(3, 50) == 1.0


def test_list_with_recovery_latest_entry_wins() -> None:
    # Out of order on purpose: the lookup must go by step, not by position in the spec.
    plan = SlowdownPlan.parse(" rank=2:1.0@step=50 , rank=0:1.5@step=0,rank=2:2.0@step=10," "rank=2:3.0@step=30")
    assert plan.ranks == frozenset({0, 2})
    assert plan.factor(0, 0) == 1.5 and plan.factor(0, 99) == 1.5
    got = {s: plan.factor(2, s) for s in (0, 10, 29, 30, 49, 50, 1000)}
    assert got == {0: 1.0, 10: 2.0, 29: 2.0, 30: 3.0, 49: 3.0, 50: 1.0, 1000: 1.0}


def test_step_defaults_to_zero() -> None:
    plan = SlowdownPlan.parse("rank=1:1.25,rank=3:4@step=7")
    assert plan.factor(1, 0) == 1.25 and plan.factor(3, 6) == 1.0 and plan.factor(3, 7) == 4.0


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


class _FakeTrainer:
    """What the attachment touches of a Trainer: its runtime (stages, stretch, emulated cost), topology
    and step."""

    def __init__(self) -> None:
        stage = nn.Identity()
        stage.layer_ids = [0, 1]  # the stage's decoder layers: the cost is per layer
        self.runtime = SimpleNamespace(stretch=1.0, emulated_cost=None, stages={0: stage})
        self.topo = SimpleNamespace(rank=1, dims=SimpleNamespace(world_size=2))
        self.seen: list[float] = []

    def step(self, step: int) -> dict:
        self.seen.append(self.runtime.stretch)
        return {"step": step}


def test_emulated_devices_attach_and_detach() -> None:
    """The slowdown sets the runtime's stretch before each step, the layer cost the runtime's emulated
    cost (per layer and sample, read from the stage's current layers); detach takes both off
    (Trainer.attach re-applies them after a layout change)."""
    cfg = Config()
    cfg.emulate.slowdown, cfg.emulate.layer_ms = "rank=1:3.0@step=2", 1.5
    tr = _FakeTrainer()
    detach = emulated_devices(cfg, tr.topo)(tr)
    assert [tr.step(s)["step"] for s in range(4)] == [0, 1, 2, 3] and tr.seen == [1.0, 1.0, 3.0, 3.0]
    assert tr.runtime.emulated_cost(0, 4) == pytest.approx(2 * 4 * 1.5e-3)
    tr.runtime.stages[0].layer_ids = [0, 1, 2]  # a move: the cost follows the stage's layers
    assert tr.runtime.emulated_cost(0, 4) == pytest.approx(3 * 4 * 1.5e-3)
    detach()
    assert "step" not in vars(tr) and tr.runtime.emulated_cost is None


def _emulated_sleep(
    monkeypatch, stretch: float, cost_s: float | None, own_s: float, op, split: bool, recorded: dict | None = None
) -> float:
    """What the runtime sleeps after a compute action whose own compute took `own_s` (one message wait of
    1 s inside it, excluded), with `stretch` and a forward's emulated cost `cost_s` (None: off). `recorded`:
    the runtime reports emulated times (emulate.layer_timing=emulated) into it, by action."""
    from hybridpar.pipeline import runtime as rt
    from hybridpar.pipeline.schedules import Action

    slept: list[float] = []
    monkeypatch.setattr(rt.time, "sleep", slept.append)
    monkeypatch.setattr(rt.time, "perf_counter", lambda: 100.0 + own_s + 1.0)
    cost = None if cost_s is None else (lambda s, n: cost_s * n)
    me = SimpleNamespace(stretch=stretch, emulated_cost=cost, report_emulated=recorded is not None)
    wait = SimpleNamespace(start=100.2, end=101.2)
    st = SimpleNamespace(waits=[wait], shapes=[(2, 16, 32)], emulated={} if recorded is None else recorded)
    rt.PipelineRuntime._emulate(me, st, Action(0, op, 0), split, 100.0, 0)
    return slept[0]


def test_runtime_emulated_cost_is_a_floor_stretched(monkeypatch) -> None:
    """A compute action lasts max(own compute, stretch x emulated cost): real compute under the cost is
    absorbed (a loaded machine does not change the emulated speed), above it shows; B = 2F unsplit,
    B = W = F split; message waits are no compute."""
    from hybridpar.pipeline.schedules import Op

    f = _emulated_sleep  # cost 0.1 s per sample, 2 samples: F 0.2 s, unsplit B 0.4 s
    assert f(monkeypatch, 1.0, 0.1, 0.05, Op.FORWARD, False) == pytest.approx(0.15)
    assert f(monkeypatch, 1.0, 0.1, 0.05, Op.BACKWARD, False) == pytest.approx(0.35)
    assert f(monkeypatch, 1.0, 0.1, 0.05, Op.BACKWARD, True) == pytest.approx(0.15)
    assert f(monkeypatch, 1.0, 0.1, 0.05, Op.WEIGHT, True) == pytest.approx(0.15)
    assert f(monkeypatch, 2.0, 0.1, 0.05, Op.FORWARD, False) == pytest.approx(0.35)  # 2 x 0.2 - 0.05
    assert f(monkeypatch, 2.0, 0.1, 0.3, Op.FORWARD, False) == pytest.approx(0.1)  # real under 2 x the cost
    assert f(monkeypatch, 1.0, 0.1, 0.3, Op.FORWARD, False) == pytest.approx(0.0)  # real above the cost
    assert f(monkeypatch, 2.0, None, 0.3, Op.FORWARD, False) == pytest.approx(0.3)  # no cost: (2 - 1) x own


def test_runtime_reports_the_emulated_time_however_long_the_action_took(monkeypatch) -> None:
    """emulate.layer_timing=emulated: each compute action records stretch x its emulated cost, also when its
    real compute (or a loaded machine) made it last longer; 'measured' records nothing."""
    from hybridpar.pipeline.schedules import Action, Op

    got: dict = {}
    _emulated_sleep(monkeypatch, 3.0, 0.1, 0.9, Op.FORWARD, False, got)  # real 0.9 s above the 0.6 s cost
    _emulated_sleep(monkeypatch, 1.0, 0.1, 0.05, Op.BACKWARD, False, got)
    assert got == {Action(0, Op.FORWARD, 0): pytest.approx(0.6), Action(0, Op.BACKWARD, 0): pytest.approx(0.4)}
    _emulated_sleep(monkeypatch, 1.0, 0.1, 0.05, Op.WEIGHT, True)  # measured: the runtime keeps no record


def test_emulation_off_attaches_nothing() -> None:
    tr = _FakeTrainer()
    detach = emulated_devices(Config(), tr.topo)(tr)
    assert "step" not in vars(tr) and tr.runtime.emulated_cost is None
    detach()


def test_a_bad_slowdown_names_the_key() -> None:
    cfg = Config()
    cfg.emulate.slowdown = "rank=5:2.0"
    with pytest.raises(ValueError, match=r"emulate.slowdown='rank=5:2.0': slowdown names rank\(s\) \[5\]"):
        emulated_devices(cfg, _FakeTrainer().topo)

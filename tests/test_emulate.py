"""Tests for hybridpar.emulate: the slow-device emulation spec, its errors and its lookups (slowdown.py),
and how a run enters emulation through `Trainer.attach` (attach.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hybridpar.config import Config
from hybridpar.emulate.attach import emulated_devices
from hybridpar.emulate.slowdown import Slowdown, SlowdownPlan


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


class _FakeTrainer:
    """What the attachment touches of a Trainer: its stages, runtime, topology and step."""

    def __init__(self) -> None:
        stage = nn.Identity()
        stage.layer_ids = [0, 1]  # the stage's decoder layers: the cost is per layer
        self.stages = {0: stage}
        self.runtime = SimpleNamespace(stretch=1.0)
        self.topo = SimpleNamespace(rank=1, dims=SimpleNamespace(world_size=2))
        self.seen: list[float] = []

    def step(self, step: int) -> dict:
        self.seen.append(self.runtime.stretch)
        return {"step": step}


def test_emulated_devices_attach_and_detach() -> None:
    """The slowdown sets the runtime's stretch before each step, the layer cost hooks each stage; detach
    takes both off (Trainer.attach re-applies them after a layout change)."""
    cfg = Config()
    cfg.emulate.slowdown, cfg.emulate.layer_ms = "rank=1:3.0@step=2", 1e-3
    tr = _FakeTrainer()
    detach = emulated_devices(cfg, tr.topo)(tr)
    assert [tr.step(s)["step"] for s in range(4)] == [0, 1, 2, 3] and tr.seen == [1.0, 1.0, 3.0, 3.0]
    stage = tr.stages[0]
    assert len(stage._forward_hooks) == 1
    x = torch.ones(2, 3, requires_grad=True)
    stage(x).sum().backward()  # the sleep node passes values and gradients through unchanged
    assert torch.equal(x.grad, torch.ones(2, 3))
    detach()
    assert "step" not in vars(tr) and not stage._forward_hooks


def test_emulation_off_attaches_nothing() -> None:
    tr = _FakeTrainer()
    detach = emulated_devices(Config(), tr.topo)(tr)
    assert "step" not in vars(tr) and not tr.stages[0]._forward_hooks
    detach()


def test_a_bad_slowdown_names_the_key() -> None:
    cfg = Config()
    cfg.emulate.slowdown = "rank=5:2.0"
    with pytest.raises(ValueError, match=r"emulate.slowdown='rank=5:2.0': slowdown names rank\(s\) \[5\]"):
        emulated_devices(cfg, _FakeTrainer().topo)

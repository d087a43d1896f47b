"""A compiled run's first step compiles the layers' graphs (tens of seconds per process, minutes on a busy
CPU) while the other ranks wait: the watchdog must watch it with slow_phase_timeout_s, as validation, not
call it hung after hang_timeout_s. Pure: the probe's marks as the watchdog receives them, no process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hybridpar.resilience.probe import Probe
from hybridpar.run.train import run_step


class Marks:
    """The watchdog's side of the probe: every (phase, step, slow) it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, bool]] = []

    def mark(self, phase: str, step: int, slow: bool = False) -> None:
        self.seen.append((phase, step, slow))


def _trainer(probe: Probe, compiled: Any) -> SimpleNamespace:
    def step(s: int) -> dict[str, Any]:
        probe("forward", s)  # what the installed hooks report during a step
        probe("p2p")
        return {"step": s}

    return SimpleNamespace(mp=SimpleNamespace(compiled=compiled), step=step)


@pytest.mark.parametrize("first", [0, 7])  # a fresh run, and a resumed one (each restart compiles again)
def test_a_compiled_runs_first_step_is_a_slow_phase(first: int) -> None:
    marks = Marks()
    probe = Probe(watchdog=marks)  # type: ignore[arg-type]
    trainer = _trainer(probe, compiled=object())
    assert run_step(trainer, probe, first, first) == {"step": first}  # type: ignore[arg-type]
    assert marks.seen[1:] == [("compile", first, True), ("p2p", first, True)]  # [0]: entering the section
    marks.seen.clear()
    run_step(trainer, probe, first + 1, first)  # type: ignore[arg-type]
    assert marks.seen == [("forward", first + 1, False), ("p2p", first + 1, False)]


def test_an_eager_runs_first_step_is_watched_as_any_other() -> None:
    marks = Marks()
    probe = Probe(watchdog=marks)  # type: ignore[arg-type]
    run_step(_trainer(probe, compiled=None), probe, 0, 0)  # type: ignore[arg-type]
    assert marks.seen == [("forward", 0, False), ("p2p", 0, False)]

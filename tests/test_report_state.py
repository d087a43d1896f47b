"""The report says how a run ended: finished, stopped by SIGTERM, failed, or neither (killed or running).
Pure: run directories written by hand, read by load_run and summarised without drawing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.report.page import summary
from hybridpar.report.rundata import load_run


def _run_dir(d: Path, tail: list[dict], state: dict | None) -> Path:
    d.mkdir()
    steps = [{"step": i, "loss": 5.0 - i, "step_time_s": 1.0, "time": 10.0 + i} for i in range(3)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + tail), encoding="utf-8")
    if state is not None:
        rec = {"format": "hybridpar-run/1", "run_id": "abc", **state}
        (d / "run.json").write_text(json.dumps(rec), encoding="utf-8")
    return d


@pytest.mark.parametrize(
    "tail, state, want",
    [
        ([{"final": True, "params_digest": "0" * 64}], {"state": "finished"}, "finished"),
        ([{"preempted": True, "step": 3, "run_id": "abc"}], {"state": "preempted"}, "stopped by SIGTERM after 3 steps"),
        ([], {"state": "failed", "error": "rank 2 ran out of memory"}, "failed: rank 2 ran out of memory"),
        ([], {"state": "running"}, "not finished: still running, or killed"),
        ([], None, "not finished"),  # no run.json (or an unreadable one): the report still opens
        # stopped, resumed, then killed: the SIGTERM record no longer ends the file
        ([{"preempted": True, "step": 3}, {"step": 3, "loss": 1.0}], {"state": "running"}, "not finished"),
    ],
)
def test_the_summary_says_how_the_run_ended(tmp_path: Path, tail: list[dict], state: dict | None, want: str) -> None:
    run = load_run(_run_dir(tmp_path / "r", tail, state))
    assert run.state.startswith(want)
    assert f"<td>state</td><td>{run.state}</td>" in summary([run])


def test_a_damaged_run_record_does_not_stop_the_report(tmp_path: Path) -> None:
    d = _run_dir(tmp_path / "r", [], None)
    (d / "run.json").write_text("{torn", encoding="utf-8")
    assert load_run(d).state.startswith("not finished")

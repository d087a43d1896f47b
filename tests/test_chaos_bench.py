"""`hybridpar bench chaos` end to end, as short as it gets (2 processes: tp1 x pp2): three launches of
`hybridpar train` on one run directory — the first preempted by a SIGTERM to one worker (exit 143), the
second SIGKILLed with its launcher's whole process group (no worker may survive it), the third resuming to
the end — with a fresh run tried on the directory in between (refused, nothing changed); the result is
the fault-free run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.bench.chaos import main, plan_faults
from hybridpar.report.page import main as report_main

STEPS = 6


def _seed() -> int:
    """The first seed whose plan SIGTERMs a worker two steps before the launcher is killed, so that each
    launch ends a different way (the planner is pure: this picks, it does not run anything)."""
    for seed in range(100):
        plan = plan_faults(3, STEPS, seed, world=2)
        term = int(plan.worker[0].split("@step=")[1].split(":")[0])
        if term + 2 < plan.launcher_kills[0][0]:
            return seed
    raise AssertionError("no seed below 100 puts the SIGTERM before the launcher kill")


@pytest.mark.multiprocess
def test_bench_chaos_smoke(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    code = main(
        [
            "--faults",
            "3",
            "--steps",
            str(STEPS),
            "--seed",
            str(_seed()),
            "--tp",
            "1",
            "--ckpt-steps",
            "0",
            "--launch-timeout-s",
            "200",
            "--json",
            str(out),
            "--runs-dir",
            str(tmp_path / "work"),
        ]
    )
    r = json.loads(out.read_text())
    assert code == 0, r
    assert r["injected_by_kind"] == {
        "kill": 0,
        "raise": 0,
        "exit0": 0,
        "stop": 0,
        "hang": 0,
        "corrupt": 0,
        "term": 1,
        "launcher_kill": 1,
        "foreign_run": 1,
    }
    assert r["launch_ends"] == {"preempted": 1, "launcher_killed": 1, "finished": 1}
    assert [x["code"] for x in r["launch_log"]][0::2] == [143, 0] and r["exit_codes_honest"]
    assert r["foreign_run_refused"] == 1 and r["orphaned_workers"] == 0 and r["run_id_kept"]
    assert r["lost_samples"] == 0 and r["duplicated_samples"] == 0
    assert r["params_identical"] and r["losses_identical"]
    # The soak's run directory is kept: the report reads its three launches and the faults they met.
    assert r["runs_dir"] == str(tmp_path / "work")
    assert report_main([str(tmp_path / "work" / "soak"), "--out", str(tmp_path / "soak.html")]) == 0
    page = (tmp_path / "soak.html").read_text()
    assert "Restarts and faults" in page and "goodput" in page


def test_a_failed_part_keeps_the_parts_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The soak's figures are on disk before the checkpoint cost starts, and stay when it fails."""
    from hybridpar.bench import chaos

    seen = {}

    def ckpt_fails(work: Path, steps: int) -> dict:
        seen["on_disk"] = json.loads(out.read_text())
        raise RuntimeError("a worker died")

    out = tmp_path / "chaos.json"
    monkeypatch.setattr(chaos, "soak", lambda *a: {"params_identical": True, "faults": 3})
    monkeypatch.setattr(chaos, "checkpoint_cost", ckpt_fails)
    code = chaos.main(["--json", str(out), "--runs-dir", str(tmp_path / "work")])
    r = json.loads(out.read_text())
    assert seen["on_disk"]["faults"] == 3 and "checkpoint_cost_error" not in seen["on_disk"]
    assert code == 1 and r["faults"] == 3 and r["checkpoint_cost_error"] == "RuntimeError: a worker died"

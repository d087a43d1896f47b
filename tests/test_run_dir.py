"""One run per directory (resilience/rundir.py), pure: claims, the lock, refusals, --overwrite, the state a
worker records for its launcher and the exit code derived from it, metrics cut back on resume. No process
group: the lock is tested between file descriptors, which flock treats like separate processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hybridpar.config import Config
from hybridpar.report.metrics import MetricsDuty, MetricsWriter, redo_note
from hybridpar.resilience import rundir
from hybridpar.resilience.commits import write_manifest


def _ckpt(root: Path, step: int, run_id: str | None) -> Path:
    d = root / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    (d / "trainer_state.json").write_text(json.dumps({"step": step, "run_id": run_id}))
    write_manifest(d, step, run_id)
    return d


def test_fresh_claim_writes_a_run_record_and_holds_the_lock(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    c = rundir.claim(run, ck, "off", overwrite=False)
    rec = rundir.read_run(run)
    assert rec["run_id"] == c.run_id and rec["state"] == "running" and rec["launch"] == c.token
    assert rundir.lock_holder_ok(run, c.token) is None
    assert "another launch" in rundir.lock_holder_ok(run, "not-the-token")
    with pytest.raises(ValueError, match=r"is in use by another launch \(pid \d+"):
        rundir.claim(run, ck, "auto", overwrite=False)  # a second launcher, even one that would resume
    c.release()
    assert "launcher that started this worker is gone" in rundir.lock_holder_ok(run, c.token)


def test_another_run_is_refused_and_resume_continues_it(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    first = rundir.claim(run, ck, "off", overwrite=False)
    first.release()
    with pytest.raises(ValueError, match=r"holds run [0-9a-f]+ \(running at step 0\): pass --resume auto"):
        rundir.claim(run, ck, "off", overwrite=False)
    again = rundir.claim(run, ck, "auto", overwrite=False)
    assert again.run_id == first.run_id and again.token != first.token
    again.release()


def test_overwrite_deletes_only_the_runs_own_files(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    old = rundir.claim(run, ck, "off", overwrite=False)
    old.release()
    _ckpt(ck, 4, old.run_id)
    (ck / ".tmp-step-000006-x-ab").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "notes.txt").write_text("the user's own file")
    (ck / "README").write_text("also the user's")
    new = rundir.claim(run, ck, "off", overwrite=True)
    assert new.run_id != old.run_id and "removed 4 entries" in new.note
    assert sorted(p.name for p in ck.iterdir()) == ["README"]
    assert (run / "notes.txt").exists() and not (run / "metrics.jsonl").exists()
    new.release()


def test_foreign_checkpoints_without_a_run_record_are_refused(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "ck"
    _ckpt(ck, 120, "older")
    for resume in ("off", "auto"):
        with pytest.raises(ValueError, match=r"holds checkpoints of another run \(step-000120, run older\)"):
            rundir.plan_claim(run, ck, resume, overwrite=False)
    assert not run.exists()  # refused before anything was created
    assert rundir.plan_claim(run, ck, str(ck / "step-000120"), overwrite=False) == "new"  # named: allowed


@pytest.mark.parametrize("key,make", [("run_dir", "run"), ("checkpoint.dir", "ck")])
def test_a_file_where_a_directory_belongs(tmp_path: Path, key: str, make: str) -> None:
    paths = {"run": tmp_path / "run", "ck": tmp_path / "ck"}
    paths[make].write_text("x")
    with pytest.raises(ValueError, match=rf"{key}='.*' is a file, not a directory"):
        rundir.plan_claim(paths["run"], paths["ck"], "off", overwrite=False)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"cannot be created: '.*/f' is not a writable directory"):
        rundir.plan_claim(tmp_path / "f" / "run", tmp_path / "ck2", "off", overwrite=False)


def test_damaged_run_record(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text("{half")
    with pytest.raises(ValueError, match=r"run.json is damaged .*--overwrite"):
        rundir.read_run(tmp_path)


def test_exit_codes_from_the_recorded_state(tmp_path: Path) -> None:
    c = rundir.claim(tmp_path, tmp_path / "ck", "off", overwrite=False)
    assert rundir.exit_code(tmp_path, c.token) == (1, None)  # still "running": the workers died
    for state, extra, code in (
        ("finished", {}, 0),
        ("preempted", {}, 143),
        ("failed", {"permanent": True, "error": "bad data"}, 2),
        ("failed", {"permanent": False, "error": "peer lost"}, 1),
    ):
        assert rundir.record_state(tmp_path, c.token, state=state, **extra)
        assert rundir.exit_code(tmp_path, c.token)[0] == code
    assert rundir.exit_code(tmp_path, c.token) == (1, "peer lost")
    # A worker of an older launch never writes over this launch's record.
    assert not rundir.record_state(tmp_path, "old-token", state="finished")
    assert rundir.read_run(tmp_path)["state"] == "failed"
    c.release()


def test_metrics_are_cut_back_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    for s in range(6):
        w.write({"step": s, "loss": float(s)})
    w.close()
    with path.open("a") as fh:
        fh.write('{"step": 6, "lo')  # a line torn by a crash
    w = MetricsWriter(path, resume_step=4)  # resumed from the checkpoint after 4 steps
    for s in range(4, 8):
        w.write({"step": s, "loss": 10.0 + s})
    w.write({"final": True})
    w.close()
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r.get("step", "final") for r in recs] == [0, 1, 2, 3, 4, 5, 6, 7, "final"]
    assert recs[4]["loss"] == 14.0
    # The steps trained before the restart and trained again are kept aside, for the stability report.
    cut = [json.loads(x) for x in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in cut] == [(4, 4.0), (5, 5.0)]
    MetricsWriter(path, resume_step=2).close()  # a finished run resumed from an earlier step: no final left
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1]


def test_a_restart_that_finds_no_checkpoint_keeps_the_steps_it_redoes(tmp_path: Path) -> None:
    """A lost node before the first checkpoint: the survivors' restart resumes (checkpoint.resume auto),
    finds nothing and starts at step 0. The steps the run trained before were thrown away and are trained
    again, so they belong in metrics.superseded.jsonl; they were truncated away (the report said 0
    recomputed steps after an elastic run that redid 25)."""
    cfg = Config()
    cfg.run_dir, cfg.sinks.tensorboard = str(tmp_path), "off"
    first = MetricsDuty(cfg, "run", 0)
    for s in range(5):
        first.after_step(s, {"step": s, "loss": float(s)})
    first.writer.close()
    cfg.checkpoint.resume = "auto"  # what a restart runs (resilience/elastic.py resume_mode)
    again = MetricsDuty(cfg, "run", 0)
    again.after_step(0, {"step": 0, "loss": 9.0})
    again.writer.close()
    assert [json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [9.0]
    cut = [json.loads(x)["step"] for x in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert cut == [0, 1, 2, 3, 4] == again.writer.redone
    # ... and the start says so, with why (the default run writes no checkpoint: nothing else would tell).
    assert redo_note(again.writer.redone, 0, 0) == (
        "hybridpar: this start trains again 5 steps trained before it (0-4): no checkpoint is written "
        "(--checkpoint.every 0); their first records are kept in metrics.superseded.jsonl"
    )
    assert "no checkpoint was committed yet (--checkpoint.every 10)" in redo_note([0, 1], 0, 10)
    assert "resumed from the newest checkpoint, after step 20" in redo_note([20, 21, 22], 20, 10)
    assert redo_note([], 0, 0) is None
    cfg.checkpoint.resume = "off"  # a new run in the directory (after --overwrite): nothing redone
    MetricsDuty(cfg, "run2", 0).writer.close()
    assert not (tmp_path / "metrics.superseded.jsonl").exists()


@pytest.mark.multiprocess
def test_parent_death_signal_is_set(tmp_path: Path) -> None:
    """Linux: the request is accepted and the parent check tells a live parent from another pid."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    code = (
        "import os, sys; from hybridpar.topology.lifetime import die_with_parent; "
        "print(die_with_parent(os.getppid()), die_with_parent(os.getppid() + 1))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert out.stdout.split() == ["True", "False"], out.stderr


def test_the_default_run_directory_moves_aside_unless_in_use(tmp_path: Path) -> None:
    run = tmp_path / "latest"
    c = rundir.claim(run, run / "checkpoints", "off", overwrite=False)
    assert rundir.set_aside(run) is None and run.is_dir()  # held by a launch: nothing moves
    c.release()
    moved = rundir.set_aside(run)
    assert moved == tmp_path / f"run-{c.run_id}" and rundir.read_run(moved)["run_id"] == c.run_id
    assert not run.exists() and rundir.set_aside(run) is None

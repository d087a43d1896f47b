"""`hybridpar train` as a scheduler sees it, through the real command in a subprocess: workers die with
their launcher, a second launch on a directory in use is refused, exit codes say what happened (0
finished, 143 preempted and checkpointed, 2 a failure a restart would repeat, with no restarts), and a
run resumed afterwards ends with the fault-free model and each step once in metrics.jsonl."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hybridpar.cli import main
from tests.tiny_flags import tiny_flags

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 12
FLAGS = [
    "--parallel.tp",
    "1",
    "--parallel.pp",
    "2",
    *tiny_flags(STEPS),
    "--checkpoint.every",
    "2",
    "--resilience.max_restarts",
    "1",
]
SLOW = ["--emulate.layer_ms", "50"]  # each step ~0.5 s: time to act while it runs (sleeps only, same numbers)
EXE = str(Path(sys.executable).with_name("hybridpar"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(run: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [EXE, "train", *FLAGS, "--run-dir", str(run), *extra], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def _start(run: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [EXE, "train", *FLAGS, "--run-dir", str(run), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def _wait_for(cond, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {timeout} s")
        time.sleep(0.1)


def _steps_once(run: Path) -> dict:
    recs = _records(run / "metrics.jsonl")
    assert [r["step"] for r in recs[:-1]] == list(range(STEPS)), [r.get("step") for r in recs]
    assert recs[-1]["final"]
    return recs[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The fault-free run of FLAGS through `hybridpar.launch` (the launcher `hybridpar train` runs) in a
    fresh process that forks its workers with torch already imported (tests/launches.py: run_forked): the
    same model as the command, without two interpreters importing torch. The tests' own runs go through
    the command."""
    from hybridpar.config import parse_args
    from tests.launches import run_forked

    run = tmp_path_factory.mktemp("reference")
    run_forked(parse_args([*FLAGS, "--run-dir", str(run)]))
    return _steps_once(run)["params_digest"]


def test_workers_die_with_their_launcher_and_a_new_launch_resumes(tmp_path: Path, reference: str) -> None:
    run = tmp_path / "run"
    proc = _start(run, *SLOW)
    try:
        # The first checkpoint (after step 2 of 12): killed mid-run, ~2 slow steps sooner than at step 4.
        _wait_for(lambda: (run / "checkpoints" / "step-000002").is_dir(), "the checkpoint after step 2")
        assert proc.poll() is None, "the run ended before the launcher could be killed: slow it down"
        workers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "hybridpar.run.worker" in " ".join(p.cmdline())
        ]
        assert len(workers) == 2
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's process group: the workers have their own
        proc.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, f"workers {[p.pid for p in alive]} outlived their launcher"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = _train(run, "--resume", "auto")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout
    assert _steps_once(run)["params_digest"] == reference
    assert json.loads((run / "run.json").read_text())["state"] == "finished"


def test_sigterm_to_one_worker_exits_143_then_resume_finishes(tmp_path: Path, reference: str) -> None:
    run = tmp_path / "run"
    out = _train(run, "--emulate.fault", "rank=1:term@step=3:phase=forward")
    assert out.returncode == 143, out.stderr[-3000:]
    assert "preempted and checkpointed (exit 143)" in out.stdout
    last = _records(run / "metrics.jsonl")[-1]
    assert last["preempted"] and last["step"] == 4 and (run / "checkpoints" / "step-000004").is_dir()
    assert json.loads((run / "run.json").read_text())["state"] == "preempted"
    out = _train(run, "--resume", "auto", "--emulate.fault", "rank=1:term@step=3:phase=forward")  # fires once
    assert out.returncode == 0, out.stderr[-3000:]
    assert _steps_once(run)["params_digest"] == reference


def test_sigterm_to_the_launcher_exits_143(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    proc = _start(run, *SLOW)
    try:
        _wait_for(lambda: (run / "metrics.jsonl").is_file() and len(_records(run / "metrics.jsonl")) >= 2, "two steps")
        # A second launch while the first runs is refused at once, whatever it asks for.
        assert main(["train", *FLAGS, "--run-dir", str(run), "--resume", "auto"]) == 2
        assert "is in use by another launch (pid" in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)  # the launcher alone, as a scheduler stops a job
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    rec = json.loads((run / "run.json").read_text())
    assert rec["state"] == "preempted" and (run / "checkpoints" / f"step-{rec['step']:06d}").is_dir()
    assert _records(run / "metrics.jsonl")[-1] == {"preempted": True, "step": rec["step"], "run_id": rec["run_id"]}


def test_a_failure_that_repeats_ends_without_restarts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = _train(
        run, "--train.lr", "1e30", "--train.min_lr", "0", "--train.warmup_steps", "0", "--resilience.max_restarts", "3"
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith("hybridpar: error: loss became nan at step")
    starts = [r for r in _records(run / "resilience.jsonl") if r["event"] == "start"]
    assert len(starts) == 1  # no worker group trained again
    rec = json.loads((run / "run.json").read_text())
    assert rec["state"] == "failed" and rec["permanent"]

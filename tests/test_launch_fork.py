"""Fork-started launches (`hybridpar.launch(start_method="fork")`): refused, in one line before anything
starts, from a process that runs other threads (their locks and half-done state would be copied without
them: a second fork-started launch from one process once died in its workers with SIGSEGV); from a
single-threaded process, two launches in a row both finish and leave no thread behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hybridpar.model.reference import tiny_config
from hybridpar.run.launcher import fork_refusal, launch

ROOT = Path(__file__).resolve().parents[1]


def test_fork_is_refused_while_another_thread_runs(tmp_path: Path) -> None:
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        cfg = tiny_config()
        cfg.run_dir = str(tmp_path / "run")
        with pytest.raises(ValueError, match=r"start_method='fork' would fork this process, which runs \d+ thread"):
            launch(cfg, start_method="fork")
        assert not (tmp_path / "run").exists()  # refused before the run directory was claimed
    finally:
        stop.set()
        other.join()


def test_start_methods_are_named() -> None:
    assert fork_refusal("spawn") is None
    assert "is not one of forkserver, spawn, fork" in fork_refusal("vfork")


TWO_LAUNCHES = """
import json, sys
from hybridpar.run.launcher import launch, threads_forked
from hybridpar.model.reference import tiny_config
out = []
for i in range(2):
    cfg = tiny_config(parallel=dict(tp=1, pp=2))
    cfg.train.steps, cfg.run_dir = 1, f"{sys.argv[1]}/run{i}"
    try:
        res = launch(cfg, start_method="fork", max_restarts=0)
        out.append({"ok": res["params_digest"] is not None, "threads_after": threads_forked()})
    except ValueError as e:
        out.append({"refused": str(e)})
print(json.dumps(out))
"""


@pytest.mark.multiprocess
def test_two_fork_started_launches_in_one_process(tmp_path: Path) -> None:
    # A fresh interpreter with no thread of its own: numpy's BLAS pool kept to the calling thread.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TWO_LAUNCHES, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]  # a worker's signal fails the launch
    first, second = json.loads(proc.stdout.splitlines()[-1])
    assert first == {"ok": True, "threads_after": 0}, first
    # The launch collects its rendezvous store, whose threads would otherwise outlive it: the second
    # launch forks a single-threaded process again.
    assert second == {"ok": True, "threads_after": 0}, second

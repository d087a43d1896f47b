"""The launches of the chaos soak, each `hybridpar train` in a process of its own, and what an adversary
does to them from outside: SIGKILL a launcher's whole process group at a chosen moment (then check that
none of its workers survives it), and try to start a fresh run on a directory that holds another one (then
check that it was refused and changed nothing). Used by `hybridpar bench chaos` (bench/chaos.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from hybridpar.report.rundata import read_jsonl

POLL_S = 0.05
# A launcher's workers must be gone this long after it was killed. A training worker dies at once (the
# kernel's parent-death signal); one the agent was just starting (a restart) cannot ask for that signal
# before it has imported torch, and then exits by itself on finding its launcher gone: seconds, more under load.
GONE_WITHIN_S = 30.0
REFUSE_TIMEOUT_S = 120.0  # a refused launch does the pre-flight only (imports torch, reads the data)


def train_command(flags: list[str]) -> list[str]:
    """`hybridpar train FLAGS` with this interpreter: the command line a user runs."""
    return [sys.executable, "-m", "hybridpar.cli", "train", *flags]


def saves(run_dir: Path, since: float = 0.0) -> list[tuple[float, int]]:
    """(time, step) of each checkpoint saved after `since` (resilience.jsonl), in order."""
    return [
        (e["time"], e["step"])
        for e in read_jsonl(run_dir / "resilience.jsonl")
        if e.get("event") == "checkpoint" and e.get("time", 0) >= since
    ]


def steps_checkpointed(run_dir: Path) -> int:
    """The highest step a checkpoint of the run was saved at."""
    return max((step for _, step in saves(run_dir)), default=0)


def workers_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes started for `run_dir` (its path is one of their arguments): the workers of a launch,
    or the launcher itself."""
    want, found = str(run_dir), []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.pid != os.getpid() and p.info["status"] != psutil.STATUS_ZOMBIE and want in (p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@dataclass
class Launch:
    """How one launch ended: `end` is finished, preempted, launcher_killed, failed or timed_out."""

    end: str
    code: int | None
    state: str | None  # run.json's state after the launch
    wall_s: float
    killed_at_step: int | None = None  # launcher_killed: steps checkpointed when the kill was sent
    gone_s: float | None = None  # launcher_killed: seconds until none of its workers was alive
    orphans: int = 0  # workers still alive GONE_WITHIN_S after the kill (then killed by the bench)

    def honest(self) -> bool:
        """The exit code says what run.json says happened (launcher.py's table)."""
        if self.end == "failed":
            return (self.code, self.state) in ((1, "failed"), (1, "running"), (2, "failed"))
        return (self.end, self.code, self.state) in (
            ("finished", 0, "finished"),
            ("preempted", 143, "preempted"),
        ) or self.end == "launcher_killed"


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group, as an adversary (or the OOM killer) would
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _run_record(run_dir: Path) -> dict[str, Any]:
    try:
        rec = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _state(run_dir: Path) -> str | None:
    return _run_record(run_dir).get("state")


def run_id_of(run_dir: Path) -> str | None:
    """The run id that `run_dir`'s run.json names (None: no run claimed the directory yet)."""
    return _run_record(run_dir).get("run_id")


def run_launch(
    flags: list[str],
    run_dir: Path,
    log: Path,
    timeout_s: float,
    kill_after_step: int | None = None,
    kill_fraction: float = 0.0,
) -> Launch:
    """Run one launch to its end. With `kill_after_step`, SIGKILL the launcher's process group once this
    launch has checkpointed that many steps (at its second save, if it resumed past them), `kill_fraction`
    of a step later (a step's length measured between its last two saves: the kill lands somewhere in the
    next step or checkpoint write, on a fast machine or a slow one), then wait until none of its workers
    is alive."""
    t0 = time.time()
    with log.open("ab") as out:
        proc = subprocess.Popen(train_command(flags), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None:
            if time.time() > t0 + timeout_s:
                _stop_group(proc)
                _reap(run_dir)
                return Launch("timed_out", None, _state(run_dir), time.time() - t0)
            mine = saves(run_dir, t0)
            if kill_after_step is not None and len(mine) >= 2 and mine[-1][1] >= kill_after_step:
                time.sleep(kill_fraction * (mine[-1][0] - mine[-2][0]))
                if proc.poll() is not None:
                    break  # it ended on its own meanwhile: no kill
                at, killed = saves(run_dir, t0)[-1][1], time.time()
                _stop_group(proc)
                gone, orphans = _reap(run_dir)
                return Launch(
                    "launcher_killed",
                    proc.returncode,
                    _state(run_dir),
                    killed - t0,
                    at,
                    None if orphans else round(gone - killed, 3),
                    orphans,
                )
            time.sleep(POLL_S)
    except BaseException:  # interrupted (Ctrl-C): leave no launch behind
        _stop_group(proc)
        _reap(run_dir)
        raise
    end = {0: "finished", 143: "preempted"}.get(proc.returncode, "failed")
    return Launch(end, proc.returncode, _state(run_dir), time.time() - t0)


def _reap(run_dir: Path) -> tuple[float, int]:
    """Wait (bounded) until no process of `run_dir` is alive; kill any still alive after GONE_WITHIN_S.
    Returns (when the last one was seen gone, how many had to be killed)."""
    deadline = time.time() + GONE_WITHIN_S
    while (alive := workers_of(run_dir)) and time.time() < deadline:
        time.sleep(POLL_S)
    for p in alive:  # orphans: the defect this checks for; never leave them running
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return time.time(), len(alive)


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every file under `run_dir` (path -> size, mtime and sha256), to tell whether anything changed."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        if p.is_file():
            st = p.stat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(run_dir))] = f"{st.st_size}:{st.st_mtime_ns}:{digest}"
        else:
            out[str(p.relative_to(run_dir))] = "dir"
    return out


def foreign_run_refused(flags: list[str], run_dir: Path, log: Path) -> bool:
    """Start a fresh run (`flags` carry resume off and another seed) on `run_dir`, which holds a run: it must
    exit 2 with one error line naming that run, and leave every file of the directory as it was."""
    run_id = run_id_of(run_dir)
    before = snapshot(run_dir)
    try:
        out = subprocess.run(
            train_command(flags), capture_output=True, text=True, timeout=REFUSE_TIMEOUT_S, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        _reap(run_dir)
        return False
    with log.open("a", encoding="utf-8") as fh:
        fh.write(f"--- foreign run (exit {out.returncode})\n{out.stdout}{out.stderr}")
    errors = [x for x in out.stderr.splitlines() if x.startswith("hybridpar: error:")]
    return (
        run_id is not None
        and out.returncode == 2
        and len(errors) == 1
        and f"holds run {run_id}" in errors[0]
        and snapshot(run_dir) == before
        and not workers_of(run_dir)
    )

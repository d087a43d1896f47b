"""What a launcher (`hybridpar train`, `hybridpar.launch`) does around torch's elastic agent: claim the
run directory after the pre-flight check, hand its workers the launch token, and turn the state they
recorded into an honest exit code (resilience/rundir.py):

    0    finished
    1    failed (a worker crashed more often than the restarts allow, or the launcher was stopped before
         a checkpoint could be written)
    2    bad configuration or data: found before any worker started, or by a worker (a failure that a
         restart would repeat, so the run ends without restarts)
    143  preempted: SIGTERM to the launcher or to any worker; the step in flight finished and was
         checkpointed; `--resume auto` continues the run
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from hybridpar.config import Config
from hybridpar.preflight import checkpoint_dir
from hybridpar.resilience import rundir


def start_launch(cfg: Config, overwrite: bool = False) -> rundir.RunClaim:
    """Claim `cfg.run_dir` for this launch (ValueError if another launch holds it or it holds another run)
    and put the token into the environment that the workers inherit. End with `end_launch`."""
    claim = rundir.claim(Path(cfg.run_dir), checkpoint_dir(cfg), cfg.checkpoint.resume, overwrite)
    if claim.note:
        print(claim.note, flush=True)
    os.environ[rundir.TOKEN_ENV] = claim.token
    return claim


def end_launch(claim: rundir.RunClaim) -> None:
    if os.environ.get(rundir.TOKEN_ENV) == claim.token:
        del os.environ[rundir.TOKEN_ENV]
    claim.release()


def outcome(cfg: Config, claim: rundir.RunClaim) -> tuple[int, str | None]:
    """Exit code and a line to print, from what the workers of this launch recorded."""
    code, why = rundir.exit_code(Path(cfg.run_dir), claim.token)
    if code == rundir.EXIT_PREEMPTED:
        return code, (f"hybridpar: preempted and checkpointed (exit {code}); continue with --resume auto "
                      f"--run-dir {cfg.run_dir}")
    if code == rundir.EXIT_USAGE:
        return code, f"hybridpar: error: {why}"
    if code == rundir.EXIT_FAILED:
        return code, f"hybridpar: training failed{': ' + why if why else ''} (exit {code})"
    return code, None


def stop_on_permanent_failure(cfg: Config, claim: rundir.RunClaim, poll_s: float = 0.25) -> threading.Event:
    """`hybridpar train` only: a thread that watches run.json and, once a worker has recorded a failure that
    a restart would repeat, sends SIGTERM to this launcher, so that torch's agent stops the workers instead
    of restarting them (its restart loop cannot be told otherwise). Not for `launch()`, which runs in the
    caller's process: there, restarted workers stop at once by themselves (train.enter_worker). Set the
    returned event to end the watch."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            try:
                rec = rundir.read_run(Path(cfg.run_dir))
            except ValueError:
                continue
            if rec and rec.get("launch") == claim.token and rec.get("state") == "failed" and rec.get("permanent"):
                os.kill(os.getpid(), signal.SIGTERM)  # raised in the agent as SignalException: shut down
                return

    threading.Thread(target=watch, name="hybridpar-failure-watch", daemon=True).start()
    return done

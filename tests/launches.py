"""Launches through the real launcher (`hybridpar.launch`, torch's elastic agent) in a fresh process, for the
tests that need one: `run_forked`. One helper interpreter per test process, whichever test file asks first:
tests/test_chaos.py, which defined it, is imported by pytest as `test_chaos` and by other files as
`tests.test_chaos`, and each copy started a helper of its own (an interpreter importing torch and the trainer)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from hybridpar.config import Config

# Each launch runs in a fresh process whose elastic agent forks the workers: a restart then costs a
# fork, not four interpreters importing torch (~6 s on 2 idle cores, ~50 s at load 13), which is what kept
# the fault tests far from their timeout on a loaded machine. Never forked from this process: a forked
# child hangs in libgomp (gomp_team_barrier_wait_end) at its first parallel op once its parent has run one
# — this test process has, and so does launch()'s pre-flight (the corpus scan) unless the launcher keeps to
# one intra-op thread, which it does here (workers set their own thread count, the model is unchanged).
# The launchers are forked from one helper interpreter (started once, on the first launch) that only
# imported torch, torch._dynamo (which the first model build pulls in) and the trainer: each launch and its
# workers then start without importing them (~2 s an interpreter, and ~1 s of four workers on 2 cores),
# and a launcher is still a process that never ran a parallel op. The helper starts no thread.
_LAUNCHERS = """
import json, os, sys, traceback
import torch
import torch._dynamo
import hybridpar.run.train
from hybridpar.config import Config
from hybridpar.run.launcher import launch
from hybridpar.topology.lifetime import die_with_parent
torch.set_num_threads(1)
if not die_with_parent(int(sys.argv[1])):  # gone with the test process that started it
    sys.exit(1)
for line in sys.stdin:
    cfg, nproc, out, log, err = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            die_with_parent(None)  # a launcher dies with this helper, and its workers with it
            for fd, path in ((1, log), (2, err)):  # the launcher's and its workers' output
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            res = launch(Config.from_dict(cfg), nproc=nproc, start_method="fork")
            open(out, "w").write(json.dumps(res))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps(pid), flush=True)
    print(json.dumps(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])), flush=True)
"""
LAUNCH_TIMEOUT_S = 240  # one launch; pytest's own timeout (300 s) bounds each test
_launchers: list[subprocess.Popen] = []


def _launcher_helper() -> subprocess.Popen:
    if not _launchers or _launchers[0].poll() is not None:
        cmd = [sys.executable, "-c", _LAUNCHERS, str(os.getpid())]
        _launchers[:] = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)]
        atexit.register(_launchers[0].stdin.close)  # the helper ends at its input's end
    return _launchers[0]


def run_forked(cfg: Config, nproc: int | None = None) -> tuple[dict | None, str]:
    """`hybridpar.launch(cfg)` in a fresh process: (its result — None when preempted —, its stdout)."""
    out, log, err = (Path(f"{cfg.run_dir}.{x}") for x in ("result.json", "stdout", "stderr"))
    out.unlink(missing_ok=True)
    helper = _launcher_helper()
    helper.stdin.write(json.dumps([cfg.to_dict(), nproc, str(out), str(log), str(err)]) + "\n")
    helper.stdin.flush()
    pid = json.loads(helper.stdout.readline())
    ended: list[int] = []
    waiter = threading.Thread(target=lambda: ended.append(json.loads(helper.stdout.readline())), daemon=True)
    waiter.start()
    try:
        waiter.join(LAUNCH_TIMEOUT_S)
        assert ended, f"launch still running after {LAUNCH_TIMEOUT_S} s"
    finally:
        if not ended:  # timed out (or pytest's timeout): its workers die with it (PDEATHSIG)
            os.kill(pid, signal.SIGKILL)
            waiter.join(30)
    assert ended == [0] and out.is_file(), err.read_text()[-4000:]
    return json.loads(out.read_text()), log.read_text()

"""`hybridpar serve`'s workers never outlive it: a SIGTERM while the replicas start stops them (the
handler is in place before the first worker starts), and a SIGKILLed server takes its workers with it
(each worker watches it)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts `hybridpar serve` subprocesses and their workers

TINY = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.ffn_dim", "64"]


def start_server(stderr: Path) -> subprocess.Popen:
    # stderr to a file: the workers inherit it, and a pipe would stay open as long as any of them lives.
    with open(stderr, "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "hybridpar.cli", "serve", "--source", "init:0", "--port", "0", "--pp", "2", *TINY],
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )


def workers(server: subprocess.Popen) -> list[psutil.Process]:
    """The server's worker processes: the children of its fork server (topology/spawn.py), itself a
    child of the server."""
    out = []
    try:
        children = psutil.Process(server.pid).children()
    except psutil.NoSuchProcess:
        return []
    for c in children:
        try:
            if any("multiprocessing.forkserver" in a for a in c.cmdline()):
                out += c.children()
        except psutil.Error:
            pass
    return out


def wait_for_workers(server: subprocess.Popen, n: int, timeout_s: float = 90.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        if len(found := workers(server)) >= n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"the server did not start {n} workers (exit {server.poll()})")


def wait_for_line(server: subprocess.Popen, text: str, timeout_s: float = 120.0) -> None:
    assert server.stdout is not None
    deadline, seen = time.monotonic() + timeout_s, b""
    while text.encode() not in seen:
        assert time.monotonic() < deadline and server.poll() is None, (seen, server.poll())
        if select.select([server.stdout], [], [], 0.2)[0]:
            seen += os.read(server.stdout.fileno(), 4096)


def cleanup(server: subprocess.Popen, procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait(30)


@pytest.mark.timeout(180)
def test_sigterm_during_start_up_leaves_no_worker(tmp_path: Path) -> None:
    server = start_server(tmp_path / "stderr")
    procs: list[psutil.Process] = []
    try:
        procs = wait_for_workers(server, 2)
        server.send_signal(signal.SIGTERM)  # the workers are still importing torch or building their stages
        server.wait(60)
        gone, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"workers {[p.pid for p in alive]} outlived the server"
        err = (tmp_path / "stderr").read_text(errors="replace")
        assert server.returncode == 0 and "Traceback" not in err, err[-2000:]
    finally:
        cleanup(server, procs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("when", ["starting", "serving"])
def test_a_sigkilled_server_takes_its_workers_with_it(when: str, tmp_path: Path) -> None:
    server = start_server(tmp_path / "stderr")
    procs: list[psutil.Process] = []
    try:
        procs = wait_for_workers(server, 2)
        if when == "serving":
            wait_for_line(server, "hybridpar: serving")
        server.kill()  # no handler runs: only the kernel's parent-death signal can stop the workers
        server.wait(30)
        gone, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"workers {[p.pid for p in alive]} outlived the server"
    finally:
        cleanup(server, procs)

"""Nothing waits forever: a receive whose sender never sends fails within the configured timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hybridpar.topology.spawn import run_ranks

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _idle_until(flag: str) -> None:
    deadline = time.monotonic() + 60
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _seconds_until_failure(op, flag: str) -> float:
    """Seconds `op` took to raise (-1 if it completed); then tell the idle ranks they may exit."""
    t0 = time.monotonic()
    try:
        op()
        return -1.0
    except (RuntimeError, TimeoutError):
        return time.monotonic() - t0
    finally:
        Path(flag).write_text("done")


def _stuck_recv(timeout_s: float, flag: str, transport: str, first: bool) -> float | None:
    import torch

    from hybridpar.pipeline.p2p import P2P
    from hybridpar.topology.mesh import build_topology

    topo = build_topology(1, 2, 1, "gloo", timeout_s)
    p2p = P2P(topo.device, torch.float32, timeout_s, transport=transport)
    if topo.rank == 0:  # sends `first` at most; stays alive (so no connection error) until rank 1 gave up
        if first:
            p2p.queue_send(torch.ones(4), 1)
            p2p.flush()
        return _idle_until(flag)
    if first:
        p2p.queue_recv("first", (4,), peer=0)
        p2p.wait_recv("first")
    p2p.queue_recv("x", (4,), peer=0)
    return _seconds_until_failure(lambda: p2p.wait_recv("x"), flag)


@pytest.mark.parametrize(
    "transport,first", [("process_group", False), ("shared_memory", False), ("shared_memory", True)]
)
def test_recv_without_sender_times_out(tmp_path, transport, first):
    """`first`: the link is open (one message went through) before the receive that never comes."""
    _, waited = run_ranks(_stuck_recv, 2, 2.0, str(tmp_path / "flag"), transport, first, timeout_s=90)
    assert waited is not None and waited >= 0, "the receive completed although nothing was sent"
    assert waited < 2.0 + 5.0, f"the 2 s P2P timeout fired only after {waited:.1f} s"


def _stuck_collective(timeout_s: float, flag: str) -> float | None:
    import torch
    import torch.distributed as dist

    from hybridpar.topology.mesh import build_topology

    topo = build_topology(2, 2, 1, "gloo", timeout_s)  # dp groups {0, 2} and {1, 3}
    if topo.rank != 2:  # rank 0 never joins rank 2's all-reduce; everyone stays alive meanwhile
        return _idle_until(flag)
    return _seconds_until_failure(lambda: dist.all_reduce(torch.ones(3), group=topo.group("dp")), flag)


def test_subgroup_collective_without_peer_times_out(tmp_path):
    """The mesh's sub-groups carry the configured timeout, not c10d's 30-minute default."""
    waited = run_ranks(_stuck_collective, 4, 2.0, str(tmp_path / "flag"), timeout_s=90)[2]
    assert waited is not None and waited >= 0, "the all-reduce completed without its peer"
    assert waited < 2.0 + 5.0, f"the 2 s collective timeout fired only after {waited:.1f} s"


def _sleep_and_report_pid(path: str) -> None:
    import os

    Path(path, f"{os.getpid()}.pid").write_text("")
    time.sleep(120)


@pytest.mark.multiprocess
def test_ranks_die_with_a_caller_killed_outright(tmp_path):
    """A caller of run_ranks stopped with SIGKILL (no cleanup of its own runs) takes its ranks with it."""
    import os
    import signal
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux only")
    code = (
        "import sys; from hybridpar.topology.spawn import run_ranks; "
        "from tests.test_timeouts import _sleep_and_report_pid; "
        f"run_ranks(_sleep_and_report_pid, 2, {str(tmp_path)!r}, timeout_s=120)"
    )
    root = str(Path(__file__).parents[1])
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root})
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 2, "the ranks did not start"
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait(30)

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # A zombie (exited, not yet reaped by init) counts as gone.
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), f"ranks {pids} outlived their caller"

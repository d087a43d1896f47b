"""Several nodes, emulated by several torchrun agents on this machine (one agent = one node, loopback
rendezvous): the node map and the tp-inside-a-node rule, the run-directory lock shared by the nodes of one
run, and a two-agent run equal, bit for bit, to the one-agent run of the same layout, through `hybridpar
train` and through plain torchrun. Node loss and grow-back: tests/test_node_loss.py."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridpar.cli import _launch_key, _set_flag
from hybridpar.resilience import rundir
from hybridpar.topology.mesh import ParallelDims
from hybridpar.topology.nodes import NodeMap, tp_node_problem
from hybridpar.topology.rendezvous import is_loopback_endpoint
from tests.tiny_flags import tiny_flags

TINY = tiny_flags(4)
TP2PP2 = ["--parallel.tp", "2", "--parallel.pp", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "hybridpar.cli", "train"]  # this checkout's hybridpar (PYTHONPATH carries over)


# ---- pure parts ---------------------------------------------------------------------------------------


def test_node_map_keeps_tp_inside_nodes() -> None:
    dims = ParallelDims(dp=1, pp=2, tp=2, world_size=4)
    two = NodeMap.from_names(["agent-0", "agent-0", "agent-1", "agent-1"])
    assert two.node_of == (0, 0, 1, 1) and two.n_nodes == 2
    assert two.tp_problem(dims) is None and not two.spans(dims, "tp") and two.spans(dims, "pp")
    assert two.describe(dims) == "2 nodes: tp inside nodes; pp across nodes"
    dp2 = ParallelDims(dp=2, pp=1, tp=2, world_size=4)
    assert two.describe(dp2) == "2 nodes: tp inside nodes; dp across nodes"
    four = NodeMap.from_names(["a", "b", "c", "d"])  # one rank per node: tp=2 would span two
    assert "parallel.tp=2 puts tensor-parallel peers on different nodes" in four.tp_problem(dims)
    assert NodeMap.from_names(["h"] * 4).describe(dims) == "1 nodes: tp inside nodes"


def test_tp_must_divide_the_processes_per_node() -> None:
    assert tp_node_problem(2, 4) is None and tp_node_problem(1, 3) is None
    why = tp_node_problem(4, 2)
    assert why.startswith("parallel.tp=4 does not divide the 2 processes per node") and "[1, 2]" in why


def test_launch_key_and_flags() -> None:
    c10d = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:5000", "--rdzv-id=job7"]
    assert _launch_key(c10d) == "c10d|job7|127.0.0.1:5000"
    assert _launch_key(["--master-addr", "n0", "--master-port", "29500"]) == "static|none|n0:29500"
    assert _set_flag(c10d, ("--rdzv-backend", "--rdzv_backend"), "x")[-2:] == ["--rdzv-backend", "x"]
    assert "c10d" not in _set_flag(c10d, ("--rdzv-backend", "--rdzv_backend"), "x")
    assert _set_flag(["--rdzv_backend=c10d"], ("--rdzv-backend", "--rdzv_backend"), "y") == ["--rdzv-backend", "y"]
    assert [is_loopback_endpoint(e) for e in ("127.0.0.1:1", "localhost", "[::1]:2", "node0:1", "10.1.1.1:3")] == [
        True,
        True,
        True,
        False,
        False,
    ]


def test_lock_admits_the_nodes_of_one_run_and_refuses_others(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    first = rundir.claim_node(run, ck, "off", False, "c10d|job|127.0.0.1:1")
    second = rundir.claim_node(run, ck, "off", False, "c10d|job|127.0.0.1:1")  # the other node of the run
    assert (second.run_id, second.token) == (first.run_id, first.token)
    assert rundir.lock_holder_ok(run, first.token) is None  # workers see their launchers alive
    assert "another launch" in rundir.lock_holder_ok(run, "other-token")
    with pytest.raises(ValueError, match="in use by another launch \\(a launch of several nodes\\)"):
        rundir.claim_node(run, ck, "off", False, "c10d|job2|127.0.0.1:1", wait_s=1)  # another run
    with pytest.raises(ValueError, match="in use by another launch"):
        rundir.claim(run, ck, "auto", False)  # a single-node launch, even one resuming
    first.release()  # one node gone: the other still holds the run, a node coming back joins it
    again = rundir.claim_node(run, ck, "off", False, "c10d|job|127.0.0.1:1")
    assert again.run_id == first.run_id
    with pytest.raises(ValueError, match="in use"):
        rundir.claim(run, ck, "auto", False)
    second.release()
    again.release()
    assert "gone" in rundir.lock_holder_ok(run, first.token)
    # All nodes gone: a fresh run into the directory is refused as for one node, a resume continues it.
    with pytest.raises(ValueError, match="holds run"):
        rundir.claim_node(run, ck, "off", False, "c10d|job3|127.0.0.1:1", wait_s=1)
    resumed = rundir.claim_node(run, ck, "auto", False, "c10d|job3|127.0.0.1:1")
    assert resumed.run_id == first.run_id and resumed.token != first.token
    with pytest.raises(ValueError, match="in use"):
        rundir.claim(run, ck, "auto", False)
    resumed.release()


def test_single_node_launch_refuses_a_node(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    one = rundir.claim(run, ck, "off", False)
    with pytest.raises(ValueError, match="in use by another launch \\(pid"):
        rundir.claim_node(run, ck, "auto", False, "c10d|job|127.0.0.1:1", wait_s=1)
    one.release()


def test_a_node_arriving_while_the_first_is_mid_claim_joins_it(tmp_path: Path) -> None:
    """The first node holds the lock but has not written who it is yet: the second waits, then joins."""
    run, ck, key = tmp_path / "run", tmp_path / "run" / "checkpoints", "c10d|job|127.0.0.1:1"
    run.mkdir()
    fd = os.open(run / rundir.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as `_lock` between its flock and its pwrite
    first: list[rundir.RunClaim] = []

    def finish() -> None:
        time.sleep(0.3)
        os.close(fd)
        first.append(rundir.claim_node(run, ck, "off", False, key, wait_s=10))

    t = threading.Thread(target=finish)
    t.start()
    second = rundir.claim_node(run, ck, "off", False, key, wait_s=10)
    t.join(15)
    assert first and first[0].run_id == second.run_id
    first[0].release()
    second.release()


# ---- two agents on this machine -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def digest(run: Path) -> str:
    final = records(run / "metrics.jsonl")[-1]
    assert final["final"] and final["samples_applied"] == [[0, 4]]
    return final["params_digest"]


def listening(pids: set[int]) -> set[str]:
    """IP addresses these processes listen on (TCP)."""
    import psutil

    out = set()
    for pid in pids:
        try:
            out |= {c.laddr.ip for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN"}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def tree(pid: int) -> set[int]:
    import psutil

    try:
        return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def node_cmd(run: Path, port: int, rdzv_id: str, nnodes: str = "2", nproc: str = "2", *extra: str) -> list[str]:
    return [
        *CLI,
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        nproc,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        rdzv_id,
        *TP2PP2,
        *TINY,
        *extra,
        "--run-dir",
        str(run),
    ]


def spawn(cmd: list[str], logs: Path) -> subprocess.Popen:
    """`cmd` in a session of its own, its stdout and stderr in the files `logs`.out and `logs`.err: an agent
    logs while it runs, and a pipe that nobody reads until it ends would block it once full (a hang where a
    failure showing its output was due)."""
    paths = (logs.with_name(logs.name + ".out"), logs.with_name(logs.name + ".err"))
    with open(paths[0], "w") as out, open(paths[1], "w") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=ENV, start_new_session=True)
    p.logs = paths  # type: ignore[attr-defined]
    return p


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each of `procs` (started by `spawn`), killed past `timeout` seconds
    with a failure that shows the end of what each wrote (a hang must say where it stood)."""
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
        return [(c, p.logs[0].read_text(), p.logs[1].read_text()) for c, p in zip(codes, procs)]
    except subprocess.TimeoutExpired:
        ends = [f"--- {log.name} ---\n{log.read_text()[-1500:]}" for p in procs for log in p.logs]
        raise AssertionError(f"agents still running after {timeout:g} s:\n" + "\n".join(ends)) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # its workers die with it (parent-death signal)


@pytest.fixture(scope="module")
def one_agent(tmp_path_factory) -> str:
    run = tmp_path_factory.mktemp("one") / "run"
    out = subprocess.run(
        [*CLI, *TP2PP2, *TINY, "--run-dir", str(run)], capture_output=True, text=True, env=ENV, timeout=150
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return digest(run)


@pytest.mark.multiprocess
def test_two_agents_through_hybridpar_train_equal_one_agent(tmp_path: Path, one_agent: str) -> None:
    """Two `hybridpar train --nnodes 2` agents with 2 workers each on one run directory: tp inside each
    node, pp across them; every socket on loopback; a launch of another run on the directory is refused
    before any worker starts; the model is the one-agent model bit for bit."""
    run, port = tmp_path / "run", free_port()
    # The first node alone: it claims the directory, then waits at the rendezvous for the second, which
    # starts only after the intruder was answered. So the intruder meets a run that holds the directory
    # and has started no worker, however slowly it starts (a run of both nodes could end before it).
    procs = [spawn(node_cmd(run, port, "job1", "2", "2", "--node-rank", "0"), tmp_path / "agent0")]
    try:
        deadline = time.monotonic() + 60
        while not (run / rundir.RUN_FILE).is_file():
            assert procs[0].poll() is None and time.monotonic() < deadline, "the first node claimed no run"
            time.sleep(0.1)
        intruder = subprocess.run(
            node_cmd(run, free_port(), "job2"), capture_output=True, text=True, env=ENV, timeout=60
        )
        assert tree(procs[0].pid) == {procs[0].pid}, "the first node started workers alone"
    except BaseException:
        procs[0].kill()  # it would wait for the second node
        raise
    procs.append(spawn(node_cmd(run, port, "job1", "2", "2", "--node-rank", "1"), tmp_path / "agent1"))
    try:
        seen: set[str] = set()
        until = time.monotonic() + 120
        while any(p.poll() is None for p in procs) and time.monotonic() < until:
            seen |= listening(set().union(*(tree(p.pid) for p in procs)))
            time.sleep(0.3)
    finally:
        ends = wait_all(procs, 120)
    assert [code for code, _, _ in ends] == [0, 0], [err[-2000:] for _, _, err in ends]
    assert intruder.returncode == 2 and "in use by another launch (a launch of several nodes)" in intruder.stderr
    assert "hybridpar: 2 nodes: tp inside nodes; pp across nodes" in ends[0][1] + ends[1][1]
    assert seen and seen <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, seen
    assert digest(run) == one_agent


@pytest.mark.multiprocess
def test_two_agents_through_plain_torchrun_equal_one_agent(tmp_path: Path, one_agent: str) -> None:
    """The same with plain torchrun (`python -m torch.distributed.run ... -m hybridpar.run.train`): rank 0
    claims the run directory itself; the loopback rendezvous through its torchrun entry point."""
    run, port = tmp_path / "run", free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    rdzv = ["--rdzv-backend", "hybridpar-loopback", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "j"]
    procs = [
        spawn(
            [*torchrun, "--node-rank", str(n), *rdzv, "--local-addr", "127.0.0.1", "-m", "hybridpar.run.train"]
            + [*TP2PP2, *TINY, "--run-dir", str(run)],
            tmp_path / f"agent{n}",
        )
        for n in (0, 1)
    ]
    ends = wait_all(procs, 150)
    assert [code for code, _, _ in ends] == [0, 0], [err[-2000:] for _, _, err in ends]
    assert digest(run) == one_agent

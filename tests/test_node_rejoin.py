"""A node that comes back to an elastic job started as docs/multi-node.md gives it (no --checkpoint.resume
auto) resumes with the survivor at once: two `hybridpar train` agents on this machine, the rendezvous store
a process of its own, one agent killed with its worker and started again. Its agent is at restart 0 and
the survivor's is not; judged by that count, the newcomer's worker started the run afresh while the
survivor's resumed, and both waited on different collectives until parallel.timeout_s, then restarted
(tests/test_rejoin_resume.py has the pure parts). tests/test_node_loss.py passes --checkpoint.resume auto
to every agent, which hid it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from hybridpar.resilience.session import ledger_stats
from tests.tiny_flags import tiny_flags

sys.path.insert(0, str(Path(__file__).parent))
import test_node_loss  # noqa: E402
from test_multinode import CLI, free_port, records, spawn, wait_all  # noqa: E402
from test_node_loss import events, lose_and_regain, rendezvous_store, wait_for  # noqa: E402

pytestmark = pytest.mark.multiprocess

STEPS = 16
TIMEOUT_S = 30  # parallel.timeout_s: the wait a mismatched start sat in before it failed and restarted


def agent(run: Path, port: int) -> object:
    """One node's `hybridpar train`, the docs' elastic command (store outside, checkpoints, no resume flag)."""
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "rejoin"]
    conf = "is_host=false,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
    cmd = [*CLI, "--nnodes", "1:2", "--nproc-per-node", "1", *rdzv, "--rdzv-conf", conf, "--max-restarts", "3"]
    flags = ["--parallel.tp", "1", "--parallel.pp", "2", "--parallel.timeout_s", str(TIMEOUT_S), *tiny_flags(STEPS)]
    flags += ["--checkpoint.every", "1", "--checkpoint.keep", str(STEPS + 1), "--emulate.layer_ms", "60"]
    return spawn([*cmd, *flags, "--run-dir", str(run)], run.with_name(f"agent-{time.time_ns()}"))


def _stop(procs: list) -> None:
    """Kill what still runs: a failure midway must leave no agent or store behind."""
    for p in procs:
        if p.poll() is None:
            p.kill()


def test_a_node_that_comes_back_resumes_with_the_survivor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_node_loss, "agent", agent)  # its kill and return, with the docs' command
    run, port = tmp_path / "run", free_port()
    store = rendezvous_store(port, run)
    a, b = agent(run, port), agent(run, port)
    procs = [store, a, b]
    try:
        wait_for(lambda: (run / "checkpoints" / "step-000002").is_dir(), "checkpoint step-000002", procs)
        _, b2, _ = lose_and_regain(b, a, run, port)
        procs.append(b2)
        ends = wait_all([a, b2], 150)
    finally:
        _stop(procs)
    # One start after the node came back, and it resumed: no start afresh beside a resuming survivor.
    evts = events(run)
    starts = [i for i, e in enumerate(evts) if e["event"] == "start"]
    assert [evts[i]["world"] for i in starts] == [2, 1, 2], evts
    assert evts[starts[-1] + 1]["event"] == "resumed", evts
    assert [code for code, _, _ in ends] == [0, 0], [err[-3000:] for _, _, err in ends]
    final = records(run / "metrics.jsonl")[-1]
    assert ledger_stats(final["samples_applied"], STEPS, 4) == {"lost_samples": 0, "duplicated_samples": 0}

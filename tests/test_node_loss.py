"""Node loss and grow-back with `--nnodes 1:2`, two `hybridpar train` agents on this machine standing in
for two nodes (one worker each, tp1 x pp2 across them). One agent and its workers are killed mid-run: the
survivor re-rendezvouses alone, re-plans for one process (pp2 -> pp1), resumes from the last verified
checkpoint and goes on; the killed agent is started again and admitted at the survivor's next restart,
and the layout returns to pp2. The run ends with every step's samples applied once (ledger), and with the
model of a fault-free run that went through the same layout changes at the same steps (within 1e-5)."""

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

from hybridpar.config import parse_args
from hybridpar.resilience.session import ledger_stats
from tests.tiny_flags import tiny_flags  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_chaos import _run  # noqa: E402  (hybridpar.launch in a fresh process)
from test_equivalence import final_state  # noqa: E402
from test_multinode import CLI, free_port, records, spawn, wait_all  # noqa: E402

pytestmark = pytest.mark.multiprocess

STEPS = 12
TOL = 1e-5
FLAGS = [
    "--parallel.tp",
    "1",
    "--parallel.pp",
    "2",
    *tiny_flags(STEPS),
    "--checkpoint.every",
    "1",
    "--checkpoint.keep",
    str(STEPS + 1),
    "--checkpoint.resume",
    "auto",  # any world the first rendezvous forms (1 or 2 nodes) starts the run
]
SLOW = ["--emulate.layer_ms", "60"]  # sleeps only (same numbers): time to kill and rejoin mid-run


def agent(run: Path, port: int) -> subprocess.Popen:
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "loss"]
    # Dead nodes are noticed after keep_alive_interval x keep_alive_max_attempt seconds; a rendezvous
    # with fewer than the most nodes waits last_call_timeout for more.
    conf = ["--rdzv-conf", "last_call_timeout=4,keep_alive_interval=1,keep_alive_max_attempt=3"]
    cmd = [*CLI, "--nnodes", "1:2", "--nproc-per-node", "1", *rdzv, *conf, "--max-restarts", "3"]
    return spawn([*cmd, *FLAGS, *SLOW, "--run-dir", str(run)], run.with_name(f"agent-{time.time_ns()}"))


def events(run: Path) -> list[dict]:
    path = run / "resilience.jsonl"
    return records(path) if path.is_file() else []


def wait_for(cond, what: str, procs: list[subprocess.Popen], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen ({'agents ended ' + str(dead) if dead else 'timed out'})")
        time.sleep(0.1)


def segments(evts: list[dict]) -> list[tuple[int, int]]:
    """(world size, first step) of each stretch of training, from the start/resumed/first_step events of
    every attempt; attempts that trained nothing that survived are dropped, equal neighbours merged."""
    attempts: list[dict] = []
    for e in evts:
        if e["event"] == "start":
            attempts.append({"world": e["world"], "from": 0})
        elif e["event"] == "resumed":
            attempts[-1]["from"] = e["step"]
        elif e["event"] == "first_step":
            attempts[-1]["stepped"] = True
    segs = [(a["world"], a["from"]) for a in attempts if a.get("stepped")]
    kept = [s for s, nxt in zip(segs, segs[1:] + [(None, STEPS)]) if nxt[1] > s[1]]
    return [s for i, s in enumerate(kept) if i == 0 or s[0] != kept[i - 1][0]]


def test_node_lost_then_back(tmp_path: Path) -> None:
    run, port = tmp_path / "run", free_port()
    procs = [agent(run, port), agent(run, port)]
    try:
        ck = run / "checkpoints"
        wait_for(lambda: (ck / "step-000003").is_dir(), "checkpoint step-000003", procs)
        assert (
            events(run)[-1]["event"] != "start" and [e for e in events(run) if e["event"] == "start"][-1]["world"] == 2
        ), events(run)
        # The node to lose: not the one whose agent hosts the rendezvous store (torch's c10d keeps it in
        # that agent; losing it ends the job, see docs/multi-node.md).
        host = [
            p
            for p in procs
            if any(c.laddr.port == port for c in psutil.Process(p.pid).net_connections("tcp") if c.status == "LISTEN")
        ]
        assert len(host) == 1
        victim = procs[1] if host[0] is procs[0] else procs[0]
        workers = psutil.Process(victim.pid).children(recursive=True)
        killed_at = time.time()
        os.killpg(victim.pid, signal.SIGKILL)
        for w in workers:
            w.kill()
        victim.wait(10)
        survivor = host[0]
        wait_for(
            lambda: any(e["event"] == "first_step" and e["time"] > killed_at for e in events(run)),
            "the survivor training alone",
            [survivor],
        )
        resumed_at = next(e["time"] for e in events(run) if e["event"] == "first_step" and e["time"] > killed_at)
        back = agent(run, port)  # the lost node returns, admitted at the survivor's next restart
        ends = wait_all([survivor, back], 150)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [code for code, _, _ in ends] == [0, 0], [err[-3000:] for _, _, err in ends]
    segs = segments(events(run))
    worlds = [w for w, _ in segs]
    assert worlds[-3:] == [2, 1, 2], segs  # lost a node, then grew back
    out = ends[0][1]
    assert "tp=1 pp=2 dp=1 -> tp=1 pp=1 dp=1" in out  # the survivor re-planned for one process
    last = json.loads((run / "checkpoints" / f"step-{STEPS:06d}" / "trainer_state.json").read_text())
    assert last["layout"] == {"tp": 1, "pp": 2, "dp": 1, "virtual_stages": 1, "world_size": 2}  # original layout
    final = records(run / "metrics.jsonl")[-1]
    assert ledger_stats(final["samples_applied"], STEPS, 4) == {"lost_samples": 0, "duplicated_samples": 0}
    steps = [r["step"] for r in records(run / "metrics.jsonl") if "loss" in r]
    assert sorted(steps) == list(range(STEPS))
    print(f"\nnode loss: segments (world, from step) {segs}; time to resume {resumed_at - killed_at:.1f} s")

    # The fault-free run through the same layout changes: each segment a launch on its world size that is
    # preempted (SIGTERM, checkpointed) after the step where the next one began.
    ref = tmp_path / "ref"
    for i, (world, start) in enumerate(segs):
        cfg = parse_args(FLAGS + ["--run-dir", str(ref)])
        if i + 1 < len(segs):
            cfg.emulate.fault = f"rank=0:term@step={segs[i + 1][1] - 1}:phase=forward"
        res, _ = _run(cfg, nproc=world)
        assert (res is None) == (i + 1 < len(segs))
    ref_loss = {r["step"]: r["loss"] for r in records(ref / "metrics.jsonl") if "loss" in r}
    loss = {r["step"]: r["loss"] for r in records(run / "metrics.jsonl") if "loss" in r}
    assert max(abs(loss[s] - ref_loss[s]) for s in range(STEPS)) <= TOL
    a, b = final_state(run, cfg.model), final_state(ref, cfg.model)
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= TOL

"""No training node is a single point of failure: two `hybridpar train` agents on this machine standing in
for two nodes (`--nnodes 1:2`, one worker each, tp1 x pp2 across them) and the rendezvous store as a
process of its own (`hybridpar rendezvous`, every agent its client). In one run: the store is killed and
started again mid-run, and training goes on without a restart; then each agent in turn, the first
started and then the second, is killed with its workers: the survivor re-rendezvouses alone, re-plans
for one process (pp2 -> pp1), resumes from the last verified checkpoint and goes on, and the killed
agent, started again, is admitted at the survivor's next restart and the layout returns to pp2. The run
ends with every step's samples applied once (ledger), and with the model of a fault-free run of the
original layout (within 1e-5). A store that stays away stops the run
with a line naming it, and a restart with --checkpoint.resume auto finishes it. The agents run the docs'
command (no --checkpoint.resume): the round, not a flag, makes a returning node resume."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from hybridpar.config import parse_args
from hybridpar.resilience.session import ledger_stats
from tests.launches import run_forked
from tests.tiny_flags import tiny_flags  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_equivalence import final_state  # noqa: E402
from test_multinode import CLI, free_port, listening, records, spawn, wait_all  # noqa: E402

pytestmark = pytest.mark.multiprocess

STEPS = 24
SHORT = 12  # the run of one node that loses its store
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
]
# The agents run the docs' elastic command, without it: a node that returns must resume because the
# rendezvous round says the job started before, not because a flag told it to. The restart by hand after the
# store stayed away resumes with it.
RESUME = ["--checkpoint.resume", "auto"]
SLOW = ["--emulate.layer_ms", "60"]  # sleeps only (same numbers): time to kill and rejoin mid-run


def rendezvous_store(port: int, logs: Path) -> subprocess.Popen:
    """`hybridpar rendezvous` on 127.0.0.1:port, once it listens."""
    store = spawn([*CLI[:-1], "rendezvous", "--port", str(port)], logs.with_name(f"store-{time.time_ns()}"))
    wait_for(lambda: "listening" in store.logs[0].read_text(), "the rendezvous store listening", [store], 30)
    return store


def agent(run: Path, port: int, conf: str = "", alone: bool = False) -> subprocess.Popen:
    """One node's `hybridpar train` (`alone`: a job of one node, one process, SHORT steps; `conf`: more
    --rdzv-conf keys, which win over those below: torch keeps a key's last value)."""
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "loss"]
    # Every agent a client of the standalone store. Dead nodes are noticed after keep_alive_interval x
    # keep_alive_max_attempt seconds; a rendezvous with fewer than the most nodes waits last_call_timeout.
    conf = "is_host=false,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3" + conf
    nodes = "1" if alone else "1:2"
    cmd = [*CLI, "--nnodes", nodes, "--nproc-per-node", "1", *rdzv, "--rdzv-conf", conf, "--max-restarts", "3"]
    layout = ["--parallel.pp", "1", "--train.steps", str(SHORT)] if alone else []
    return spawn([*cmd, *FLAGS, *layout, *SLOW, "--run-dir", str(run)], run.with_name(f"agent-{time.time_ns()}"))


def wait_joined(port: int, procs: list[subprocess.Popen]) -> None:
    """Wait until a node has joined the rendezvous in the standalone store at `port`: torch's c10d backend
    puts a null state under its key when an agent starts, and the state itself at the first join."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    key = "torch.rendezvous.loss"  # the backend's key for --rdzv-id loss
    joined = lambda: store.check([key]) and store.get(key) != C10dRendezvousBackend._NULL_SENTINEL.encode()  # noqa: E731
    wait_for(joined, "the first agent joining the rendezvous", procs)


def events(run: Path) -> list[dict]:
    path = run / "resilience.jsonl"
    return records(path) if path.is_file() else []


def wait_for(cond, what: str, procs: list[subprocess.Popen], timeout: float = 90) -> None:
    """Poll `cond` until true; fail naming `what` if it times out or any of `procs` ends first."""
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


def trained_since(run: Path, since: float, world: int, event: str = "first_step") -> bool:
    """Whether an attempt on `world` processes that started after `since` has trained a step (`event`
    "checkpoint": and committed it, so that a later attempt resumes after it)."""
    current = None
    for e in events(run):
        if e["event"] == "start":
            current = e["world"] if e["time"] > since else None
        elif e["event"] == event and current == world:
            return True
    return False


def lose_and_regain(victim: subprocess.Popen, survivor: subprocess.Popen, run: Path, port: int):
    """Kill `victim` (agent and workers) mid-run, wait for `survivor` to train alone, start the lost node
    again and wait for both to train together. (seconds from the kill to the survivor's first step, the
    node started again, whether the victim hosted the workers' store: the agent of the round's rank 0)"""
    hosted = bool(listening({victim.pid}))  # an agent listens only for its workers' store
    workers = psutil.Process(victim.pid).children(recursive=True)
    killed_at = time.time()
    os.killpg(victim.pid, signal.SIGKILL)
    for w in workers:
        w.kill()
    victim.wait(10)
    wait_for(lambda: trained_since(run, killed_at, 1, "checkpoint"), "the survivor training alone", [survivor])
    resumed_at = next(e["time"] for e in events(run) if e["event"] == "first_step" and e["time"] > killed_at)
    back_at = time.time()
    # The survivor's workers wait, frozen, until their agent stops them to admit the returning node: the
    # rejoin happens however long that node takes to start (on a loaded machine the survivor, training on,
    # finished the run before it was admitted). Frozen, they are stopped as they would be running: the
    # agent's SIGTERM, pending while they are stopped, is handled (checkpoint, exit) when they go on.
    frozen = psutil.Process(survivor.pid).children(recursive=True)
    for p in frozen:
        p.suspend()
    back = agent(run, port)  # the lost node returns, admitted at the survivor's next restart
    try:
        stopped = lambda: all(sigterm_pending(p.pid) for p in frozen)  # noqa: E731
        wait_for(stopped, "the survivor's agent stopping its workers to admit the node", [survivor, back], 120)
    finally:
        for p in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.resume()
    wait_for(lambda: trained_since(run, back_at, 2, "checkpoint"), "both nodes training again", [survivor, back], 120)
    return resumed_at - killed_at, back, hosted


def sigterm_pending(pid: int) -> bool:
    """Whether process `pid` has a SIGTERM pending (sent while it is stopped), from /proc (Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in pending)


def test_no_node_is_a_single_point_of_failure(tmp_path: Path) -> None:
    run, port = tmp_path / "run", free_port()
    store = rendezvous_store(port, run)
    # Both nodes in the first round, by construction: torch closes a round that has its fewest nodes once
    # the last call that the join making them so set is over (2 s here), so two agents started together
    # met only if the second joined within 2 s of the first (on a loaded machine it could come later and
    # be admitted at a restart). Here the first joins alone and waits as long as it takes (its last call
    # is long: it is the first one lost and never rendezvouses alone), then the second's join fills the
    # round (its most nodes), which closes at once.
    a, started = agent(run, port, ",last_call_timeout=600"), time.monotonic()
    procs = [store, a]
    try:
        wait_joined(port, procs)
        alone = time.monotonic() - started  # what waiting for the first join costs
        procs.append(b := agent(run, port))
        ck = run / "checkpoints"
        wait_for(lambda: (ck / "step-000002").is_dir(), "checkpoint step-000002", procs)
        assert [e["world"] for e in events(run) if e["event"] == "start"] == [2], events(run)
        # No agent hosts the rendezvous store.
        ports = {c.laddr.port for p in (a, b) for c in psutil.Process(p.pid).net_connections("tcp")}
        assert port not in ports
        # The store, killed and started again: the workers never use it, the agents reconnect.
        store.kill()
        store.wait(10)
        procs[0] = store = rendezvous_store(port, run)
        wait_for(lambda: all("restarted: reconnected" in p.logs[1].read_text() for p in (a, b)), "reconnects", procs)
        done = len(list(ck.glob("step-*")))
        wait_for(lambda: len(list(ck.glob("step-*"))) > done, "training on after the store's restart", procs)
        assert [e["world"] for e in events(run) if e["event"] == "start"] == [2]  # and no restart
        first, a2, first_hosted = lose_and_regain(a, b, run, port)  # the agent started first
        procs.append(a2)
        second, b2, second_hosted = lose_and_regain(b, a2, run, port)  # then the other one
        procs.append(b2)
        ends = wait_all([a2, b2], 150)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [code for code, _, _ in ends] == [0, 0], [err[-3000:] for _, _, err in ends]
    assert sum("wrote the rendezvous state back" in p.logs[1].read_text() for p in (a, b)) == 1
    evts = events(run)
    segs = segments(evts)
    assert [w for w, _ in segs] == [2, 1, 2, 1, 2], segs  # lost a node and got it back, twice
    # One start per layout, each after the first resuming at once: a returning node whose workers started the
    # run afresh beside resuming survivors (its agent at restart 0) would sit in collectives that never
    # match until parallel.timeout_s and start once more.
    starts = [i for i, e in enumerate(evts) if e["event"] == "start"]
    assert [evts[i]["world"] for i in starts] == [2, 1, 2, 1, 2], evts
    assert all(evts[i + 1]["event"] == "resumed" for i in starts[1:]), evts
    for survivor in (b, a2):  # each survivor re-planned for one process
        assert "tp=1 pp=2 dp=1 -> tp=1 pp=1 dp=1" in survivor.logs[0].read_text()
    last = json.loads((run / "checkpoints" / f"step-{STEPS:06d}" / "trainer_state.json").read_text())
    assert last["layout"] == {"tp": 1, "pp": 2, "dp": 1, "virtual_stages": 1, "world_size": 2}  # original layout
    final = records(run / "metrics.jsonl")[-1]
    assert ledger_stats(final["samples_applied"], STEPS, 4) == {"lost_samples": 0, "duplicated_samples": 0}
    steps = [r["step"] for r in records(run / "metrics.jsonl") if "loss" in r]
    assert sorted(steps) == list(range(STEPS))

    # The fault-free run: one launch of the original layout, no checkpoints (they change no numbers). Every
    # layout trains the same model, and pp1 and pp2 run the same operations in the same order: the run through
    # its five layouts matches this one to the bit (both gaps printed 0.0).
    ref = tmp_path / "ref"
    cfg = parse_args(FLAGS + ["--run-dir", str(ref), "--checkpoint.every", "0"])
    started = time.monotonic()
    run_forked(cfg, nproc=2)
    ref_s = time.monotonic() - started
    ref_loss = {r["step"]: r["loss"] for r in records(ref / "metrics.jsonl") if "loss" in r}
    loss = {r["step"]: r["loss"] for r in records(run / "metrics.jsonl") if "loss" in r}
    loss_gap = max(abs(loss[s] - ref_loss[s]) for s in range(STEPS))
    x, y = final_state(run, cfg.model), final_state(ref, cfg.model)
    param_gap = max((x[k] - y[k]).abs().max().item() for k in x)
    hosts = {True: ", the round's rank 0: it hosted the workers' store", False: ""}
    print(
        f"\nno single point of failure: the first agent joined {alone:.1f} s after its start; segments (world, "
        f"from step) {segs}; time to resume {first:.1f} s (first "
        f"agent lost{hosts[first_hosted]}), {second:.1f} s (second agent lost{hosts[second_hosted]}); ledger "
        f"{ledger_stats(final['samples_applied'], STEPS, 4)}; vs the fault-free run: loss {loss_gap:.2e}, params "
        f"{param_gap:.2e} (bound {TOL:g}; its launch {ref_s:.1f} s)"
    )
    assert loss_gap <= TOL and x.keys() == y.keys() and param_gap <= TOL


def test_a_store_that_stays_away_stops_the_run_which_resumes(tmp_path: Path) -> None:
    """The store killed for good: past read_timeout the agent stops its workers (they checkpoint) and
    exits with a line naming the store; the store started again and an agent of plain torchrun (its
    client through the `hybridpar-loopback` entry point) finish the run."""
    run, port = tmp_path / "run", free_port()
    store = rendezvous_store(port, run)
    one = [agent(run, port, ",read_timeout=2", alone=True)]
    try:
        wait_for(lambda: trained_since(run, 0, 1), "the first step", [store, *one])
        store.kill()
        store.wait(10)
        ((code, out, err),) = wait_all(one, 60)
        assert code == 143, err[-3000:]  # stopped and checkpointed
        assert f"store at 127.0.0.1:{port} stopped answering and did not come back within 2 s" in err
        stopped = records(run / "metrics.jsonl")[-1]["step"]
        assert stopped < SHORT - 1, "the run ended before the agent gave up on the store"
        store = rendezvous_store(port, run)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1"]
        rdzv = ["--rdzv-backend", "hybridpar-loopback", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "loss"]
        train = ["-m", "hybridpar.run.train", *FLAGS, *RESUME, "--parallel.pp", "1", "--train.steps", str(SHORT)]
        # Without the emulated sleeps: nothing is timed from here, the resumed run only has to finish.
        cmd = [*torchrun, *rdzv, "--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1", *train]
        one = [spawn([*cmd, "--run-dir", str(run)], run.with_name("torchrun"))]
        ((code, out, err),) = wait_all(one, 120)
    finally:
        for p in (store, *one):
            if p.poll() is None:
                p.kill()
    assert code == 0 and "hybridpar: resumed from" in out, err[-3000:]
    assert f"rendezvous store: the standalone store at 127.0.0.1:{port}" in err
    final = records(run / "metrics.jsonl")[-1]
    assert ledger_stats(final["samples_applied"], SHORT, 4) == {"lost_samples": 0, "duplicated_samples": 0}
    assert sorted(r["step"] for r in records(run / "metrics.jsonl") if "loss" in r) == list(range(SHORT))
    print(f"\nstore gone for good: stopped after step {stopped} (exit 143, a line naming it); resumed by torchrun")

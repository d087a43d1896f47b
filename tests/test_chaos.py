"""Recovery through the real launcher (hybridpar.launch -> torch's elastic agent): every injected fault ends
with the model of the fault-free run, bit for bit (same params_digest, the same loss at every step, and a
sample ledger with each step applied exactly once); re-planned runs (shrink 4 -> 2, grow 2 -> 4) match it
within the exactness tolerance. The watchdog names the SIGSTOPped and the hung rank within
hang_timeout_s + 5 s, and raises no alarm anywhere else — not in a checkpoint write or a validation that
each take twice its timeout.

The faults are spread over several launches (one per group of phases) rather than strung into one: each
test then stays far inside pytest's timeout on a loaded machine, and a failure names its group. All of
them are compared with one fault-free reference run (module fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridpar.config import Config
from hybridpar.emulate.faults import corrupt_newest
from hybridpar.resilience.commits import committed, verify_checkpoint
from tests.launches import run_forked
from tests.references import ref_for
from tests.tiny_flags import tiny_flags  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_equivalence import TOL, final_state, tiny_config  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts launchers and workers

STEPS = 8
HANG_S = 2.0
SLOW = f"sleep={2 * HANG_S}"
# Each fault fires once (chaos.jsonl); each failure makes the agent restart all workers, which resume
# from the newest verified checkpoint. Slow phases (twice the hang timeout) ride along: not hangs.
COMPUTE_KILLS = [
    f"rank=0:{SLOW}@step=0:phase=ckpt-write",  # slow, not hung
    "rank=1:kill@step=1:phase=forward",
    "rank=2:kill@step=1:phase=p2p",
    "rank=3:kill@step=2:phase=all-reduce",
    "rank=0:kill@step=2:phase=optimizer",
]
CKPT_KILLS = [
    "rank=1:kill@step=2:phase=ckpt-write",
    f"rank=1:{SLOW}@step=3:phase=validate",  # slow, not hung
    "rank=2:kill@step=3:phase=ckpt-barrier",
    "rank=0:kill@step=3:phase=ckpt-manifest",
    "rank=0:kill@step=3:phase=ckpt-rename",
    "rank=0:kill@step=3:phase=ckpt-done",
]
WEDGES = [
    "rank=3:raise@step=4:phase=forward",
    "rank=1:exit0@step=4:phase=optimizer",
    "rank=2:stop@step=4:phase=p2p",
    "rank=1:hang@step=5:phase=forward",
]
PREEMPT = "rank=3:term@step=6:phase=forward"  # SIGTERM on one rank: checkpoint after step 7, stop
# (culprit, phase, step) the watchdog must name: the SIGSTOPped rank and the hung one. A rank gone by
# sys.exit(0) may be named too (if its peers do not see the closed connection first), nothing else.
HUNG = {(2, "p2p", 4): ":stop@", (1, "forward", 5): ":hang@"}
GONE = {(1, "optimizer", 4): ":exit0@"}


def _cfg(run_dir: Path, fault: str = "", **parallel) -> Config:
    # 4 layers, 2 a stage: recovery does not depend on depth, and each layer more is more tensors in each
    # of the checkpoints every step writes, verifies and reads back at each restart.
    cfg = tiny_config(
        model=dict(n_layers=4),
        train=dict(steps=STEPS, val_every=4, monitor_every=0),
        parallel={"tp": 1, "pp": 2, "dp": 2, "schedule": "1f1b", "timeout_s": 30.0, **parallel},
        resilience=dict(
            hang_timeout_s=HANG_S, heartbeat_s=0.25, slow_phase_timeout_s=30.0, max_restarts=len(CKPT_KILLS) + 2
        ),
        checkpoint=dict(every=1, keep=STEPS + 1),
        emulate=dict(fault=fault),
    )
    cfg.run_dir = str(run_dir)
    return cfg


def _records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    return final_state(run_dir, _cfg(run_dir).model)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("reference")
    r, _ = run_forked(_cfg(d))
    assert len(r["losses"]) == STEPS
    return {**r, "model": _model(d)}


def _same_history(run_dir: Path, ref: dict) -> None:
    """Every step record in metrics.jsonl has the fault-free loss, bit for bit, each step exactly once
    (a resume cuts the file back to its restored step); the final record has the fault-free digest and a
    ledger with each step applied exactly once."""
    recs = _records(run_dir, "metrics.jsonl")
    steps = [r for r in recs if "step" in r and "loss" in r]
    assert sorted(r["step"] for r in steps) == list(range(STEPS))
    for r in steps:
        assert r["loss"] == ref["losses"][r["step"]], r
    final = recs[-1]
    assert final["final"] and final["params_digest"] == ref["params_digest"]
    assert final["samples_applied"] == [[0, STEPS]]


def _recovers(run: Path, faults: list[str], ref: dict) -> list[dict]:
    """One launch with `faults`: every fault fires once, the agent restarts the workers, the run ends with
    the fault-free model. Returns the watchdog's reports."""
    r, out = run_forked(_cfg(run, ",".join(faults)))
    assert r is not None and r["params_digest"] == ref["params_digest"]
    assert sorted(f["fault"] for f in _records(run, "chaos.jsonl")) == sorted(faults)  # each happened, once
    starts = [x for x in _records(run, "resilience.jsonl") if x["event"] == "start"]
    assert 2 <= len(starts) <= len(faults) + 1  # restarts happened (faults at one step may share one)
    assert "resumed from" in out
    _same_history(run, ref)
    return _records(run, "watchdog.jsonl")


def test_kills_in_compute_phases(tmp_path: Path, reference: dict) -> None:
    """SIGKILL in forward, p2p, all-reduce and optimizer; a checkpoint write twice the hang timeout long
    is no hang."""
    assert _recovers(tmp_path / "run", COMPUTE_KILLS, reference) == []


def test_kills_in_checkpoint_phases(tmp_path: Path, reference: dict) -> None:
    """SIGKILL in each phase of a checkpoint write (before, between and after the commit's steps): the
    restart resumes from the newest checkpoint that verifies; a slow validation is no hang."""
    run = tmp_path / "run"
    assert _recovers(run, CKPT_KILLS, reference) == []
    for step, path in committed(run / "checkpoints"):
        assert verify_checkpoint(path, step) is None, path


def test_raise_exit0_stop_hang_named_by_watchdog(tmp_path: Path, reference: dict) -> None:
    """An exception, an early sys.exit(0), a SIGSTOP and a hang: the watchdog names exactly the frozen and
    the hung rank, at their fault's phase and step, within hang_timeout_s + 5 s."""
    run = tmp_path / "run"
    reports = _recovers(run, WEDGES, reference)
    named = {(r["culprit"], r["phase"], r["step"]) for r in reports}
    assert set(HUNG) <= named <= set(HUNG) | set(GONE), named
    fired = _records(run, "chaos.jsonl")
    for r in reports:
        kind = {**HUNG, **GONE}[(r["culprit"], r["phase"], r["step"])]
        fault = next(f for f in fired if f["rank"] == r["culprit"] and kind in f["fault"])
        assert 0 < r["time"] - fault["time"] <= HANG_S + 5, (r, fault)


def test_preemption_then_resume_past_corrupt_checkpoints(tmp_path: Path, reference: dict) -> None:
    run = tmp_path / "run"
    # 1. SIGTERM on one rank (preemption): the step in flight finishes, is checkpointed, the run stops.
    r, out = run_forked(_cfg(run, PREEMPT))
    assert r is None  # preempted: no final model
    assert [f["fault"] for f in _records(run, "chaos.jsonl")] == [PREEMPT]
    newest = committed(run / "checkpoints")[0][1]
    assert newest.name == "step-000007" and verify_checkpoint(newest, 7) is None
    assert "preempted: checkpointed after step 7" in out

    # 2. Resume after the preemption: bit-exact.
    cfg = _cfg(run)
    cfg.checkpoint.resume = "auto"
    r, out = run_forked(cfg)
    assert r["start_step"] == 7 and r["losses"] == reference["losses"][7:]
    assert "resumed from" in out
    _same_history(run, reference)

    # 3. Damage the five newest checkpoints, one way each: resume falls back past all of them, naming each.
    for step, kind in [(8, "pickle"), (7, "mix"), (6, "delete"), (5, "truncate"), (4, "flip")]:
        ck = run / "checkpoints"
        for newer in committed(ck):
            if newer[0] > step:  # corrupt_newest damages the newest: set the newer ones aside meanwhile
                newer[1].rename(ck / f"hold-{newer[1].name}")
        corrupt_newest(ck, kind)
        for held in ck.glob("hold-*"):
            held.rename(ck / held.name[len("hold-") :])
    r, out = run_forked(cfg)
    assert r["start_step"] == 3 and r["params_digest"] == reference["params_digest"]
    for step, why in [
        (8, ".metadata does not match its sha256"),
        (7, ".distcp does not match its sha256"),
        (6, ".distcp is missing"),
        (5, ".distcp has"),
        (4, ".distcp does not match its sha256"),
    ]:
        assert f"skipped checkpoint step-{step:06d}" in out and why in out, (step, out)
    assert not (run / "checkpoints" / "PWNED").exists()  # the pickle was never unpickled
    _same_history(run, reference)


def test_shrink_then_grow(tmp_path: Path, reference: dict) -> None:
    run = tmp_path / "run"
    # 1. A 4-rank run preempted after step 4 (SIGTERM in step 3)...
    assert run_forked(_cfg(run, "rank=3:term@step=3:phase=forward"))[0] is None
    assert committed(run / "checkpoints")[0][1].name == "step-000004"
    # 2. ...resumes on 2 processes (tp1 pp2 dp1: shrink) and is preempted again...
    cfg = _cfg(run, "rank=1:term@step=5:phase=forward")
    cfg.checkpoint.resume = "auto"
    r, out = run_forked(cfg, nproc=2)
    assert r is None and "tp=1 pp=2 dp=2 -> tp=1 pp=2 dp=1" in out
    state = json.loads((run / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["layout"]["world_size"] == 2 and state["samples"]["applied"] == [[0, 6]]
    # 3. ...and grows back to 4 (tp1 pp2 dp2): the same training within the exactness tolerance.
    cfg.emulate.fault = ""
    r, _ = run_forked(cfg, nproc=4)
    assert r["start_step"] == 6
    losses = {x["step"]: x["loss"] for x in _records(run, "metrics.jsonl") if "loss" in x}
    assert max(abs(losses[s] - reference["losses"][s]) for s in range(STEPS)) <= TOL
    grown = _model(run)
    for name, t in reference["model"].items():
        assert (grown[name] - t).abs().max().item() <= TOL, name


def test_faults_after_a_live_rebalance_fire_and_the_run_recovers(tmp_path: Path) -> None:
    """The probe sits on whatever the current layout holds: a live re-partition replaces the gradient
    reduction and the optimizer, and faults planned in the all-reduce and optimizer phases after it
    still fire (they went silent when the probe was installed once, at start). The run recovers from
    both and trains the one-device model."""
    # The balancer decides after steps 3 and 7 (interval 4): two chances to move before the faults.
    steps, fault_step = 12, 8
    faults = [f"rank=0:raise@step={fault_step}:phase=all-reduce", f"rank=1:kill@step={fault_step + 1}:phase=optimizer"]
    cfg = tiny_config(
        parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b", partition="uniform", timeout_s=30.0),
        train=dict(steps=steps, val_every=steps, monitor_every=0),
        # Emulated fixed layer cost (benchmark mode) and rank 1 three times slower from the start: the
        # balancer moves layers off it after its warm-up and patience, well before the faults.
        emulate=dict(layer_ms=2.0, slowdown="rank=1:3.0@step=0", fault=",".join(faults)),
        balance=dict(mode="auto", interval=4, window=3, patience=2, threshold=1.6, persist=1),
        resilience=dict(hang_timeout_s=HANG_S, heartbeat_s=0.25, slow_phase_timeout_s=30.0, max_restarts=3),
        checkpoint=dict(every=1, keep=steps + 1),
    )
    cfg.run_dir = str(tmp_path / "run")
    r, out = run_forked(cfg)
    run = tmp_path / "run"
    moves = [e for x in _records(run, "metrics.jsonl") for e in x.get("balance", []) if e["event"] == "rebalance"]
    assert moves and moves[0]["applied"] and moves[0]["step"] < fault_step, moves
    assert sorted(f["fault"] for f in _records(run, "chaos.jsonl")) == sorted(faults)  # each fired, once
    assert len([x for x in _records(run, "resilience.jsonl") if x["event"] == "start"]) == 3
    assert "resumed from" in out
    ref_losses, _, ref_state = ref_for(cfg)
    losses = {x["step"]: x["loss"] for x in _records(run, "metrics.jsonl") if "loss" in x}
    assert sorted(losses) == list(range(steps))
    assert max(abs(losses[s] - ref_losses[s]) for s in range(steps)) <= TOL
    final = final_state(run, cfg.model)  # its own model (8 layers to move), not _cfg's
    for name, ref in ref_state.items():
        assert (final[name] - ref).abs().max().item() <= TOL, name


def test_cli_restarts_and_resumes_with_default_settings(tmp_path: Path) -> None:
    """`hybridpar train` as a user runs it (default resilience settings, torchrun in a subprocess): a killed
    rank is restarted by the agent and the run resumes by itself, ending with the fault-free model."""
    from hybridpar.config import parse_args

    flags = [
        "--parallel.tp",
        "1",
        "--parallel.pp",
        "2",
        *tiny_flags(4),
        "--checkpoint.every",
        "1",
    ]
    ref = parse_args(flags + ["--run-dir", str(tmp_path / "ref")])
    expected = run_forked(ref)[0]["params_digest"]
    run = tmp_path / "run"
    exe = Path(sys.executable).with_name("hybridpar")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [str(exe), "train", *flags, "--run-dir", str(run), "--emulate.fault", "rank=1:kill@step=2:phase=forward"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "step-000002" in out.stdout
    assert [r["restart"] for r in _records(run, "resilience.jsonl") if r["event"] == "start"] == [0, 1]
    assert _records(run, "metrics.jsonl")[-1]["params_digest"] == expected

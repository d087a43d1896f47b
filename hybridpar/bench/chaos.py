"""`hybridpar bench chaos`: a soak of random faults through `hybridpar train` (torch's elastic launcher),
judged against a fault-free run of the same config in the same invocation, plus synchronous vs
asynchronous checkpoint cost on the default model.

Soak: `--faults` faults (seeded) drawn over the run's steps. Inside the workers, each injected once by the
chaos testing mode: SIGKILL in any phase (forward, p2p, all-reduce, optimizer, step end, each checkpoint
phase), an exception, sys.exit(0), SIGSTOP, a hang, checkpoint damage (bit flip, truncation, deletion, a
file from another step, a pickle) followed by a kill — each makes the agent restart all workers, which
resume from the newest checkpoint that verifies — and SIGTERM to one worker (preemption: the launch
checkpoints and exits 143). From outside, as an adversary: SIGKILL to the launcher's whole process group
at a seeded moment (its workers must all be gone within seconds), and, between launches, a fresh run
(resume off, another seed) started on the soak's directory, which must be refused (exit 2, naming the
run) and change nothing. With `--faults` >= 3 each of these three kinds is drawn at least once. So the
soak is a sequence of launches on one run directory, each after the first with `--resume auto`, until
one finishes. Reported, all measured from the run's own records:

- faults_injected: faults that really happened (`chaos.jsonl`, kills sent, fresh runs tried), also by
  kind; launches: how each launch ended; recoveries: worker-group restarts inside launches;
- lost_samples / duplicated_samples: from the sample ledger carried through every checkpoint (a step
  never applied to the final model, or applied twice, counts global_batch samples);
- params_identical / losses_identical: final params_digest, and the loss of every step in metrics.jsonl
  (each step exactly once: a resume cuts the file back to its checkpoint), equal to the fault-free run's,
  bit for bit; run_id_kept: the final model belongs to the run the first launch started;
- exit_codes_honest: every launch's exit code says what its run.json says (0 finished, 143 preempted);
  orphaned_workers: workers alive 30 s after their launcher was killed (then killed by the bench);
  mean/max_workers_gone_s: kill -> none of that launch's workers alive (at once for training workers;
  seconds for one being restarted, which must import torch before it can notice); foreign_run_refused;
- mean_detect_s: fault -> watchdog verdict, over the faults the watchdog detects (frozen or hung ranks;
  dead ranks are seen by the agent's process monitor, whose latency is not observable from here);
- mean_restart_s: fault -> the restarted worker group starts; mean_recover_s: fault -> its first completed
  step; committed_steps_redone: checkpointed steps trained again because a restart resumed from an older
  checkpoint (the newest damaged or not yet committed); load_avg_1m: the machine's load average when the
  soak started and when it ended (other jobs slow every time here down);
- ckpt_sync_s: median seconds a synchronous save stops training (default model and layout);
  ckpt_async_stall_s: the same for an asynchronous save (snapshot + waiting for the previous write);
  their ratio, and the background write time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridpar.bench import emit, runs_dir
from hybridpar.bench.chaos_launches import Launch, foreign_run_refused, run_id_of, run_launch, steps_checkpointed
from hybridpar.config import Config
from hybridpar.report.rundata import read_jsonl

KILL_PHASES = ("forward", "p2p", "all-reduce", "optimizer", "step-end", "ckpt-write", "ckpt-barrier")
RANK0_PHASES = ("ckpt-manifest", "ckpt-rename", "ckpt-done")  # only rank 0 commits
CORRUPTIONS = ("flip", "truncate", "delete", "mix", "pickle")
# Fault kinds and their weights; term, launcher (SIGKILL the launcher) and foreign (a fresh run on the
# directory) each end or follow a launch, so they are rarer than the faults a launch recovers from itself.
KINDS = {"kill": 8, "raise": 1, "exit0": 1, "stop": 1, "hang": 1, "corrupt": 2, "term": 1, "launcher": 1, "foreign": 1}
ALWAYS = ("term", "launcher", "foreign")  # drawn first, so that a short soak has each at least once
SOAK = {
    "model.dim": 64,
    "model.n_layers": 4,
    "model.n_heads": 4,
    "model.ffn_dim": 128,
    "train.global_batch": 8,
    "train.microbatches": 2,
    "train.seq_len": 64,
    "train.warmup_steps": 2,
    "train.val_every": 10,
    "train.val_batches": 1,
    "train.sample_tokens": 0,
    "train.monitor_every": 0,
    "data.max_tokens": 400_000,
    "checkpoint.every": 1,
    "checkpoint.keep": 3,
    "resilience.hang_timeout_s": 2.0,
    "resilience.heartbeat_s": 0.25,
    "resilience.slow_phase_timeout_s": 60.0,
    "parallel.timeout_s": 30.0,
}


@dataclass
class SoakPlan:
    worker: list[str] = field(default_factory=list)  # emulate.fault entries, `term` included
    launcher_kills: list[tuple[int, float]] = field(default_factory=list)  # (after this many steps, of a step)
    foreign: list[int] = field(default_factory=list)  # try a fresh run once this many steps are checkpointed


def _step_of(entry: str) -> int:
    return int(entry.split("@step=")[1].split(":")[0])


def plan_faults(n: int, steps: int, seed: int, world: int = 4) -> SoakPlan:
    """`n` faults, seeded; every worker fault lands in a phase its rank executes. A SIGTERM gets a step of
    its own where one is free: a fault later in the same step, or a launcher kill due at its checkpoint,
    would stop the group before the preemption completes — and a restarted group knows nothing of the
    SIGTERM, so that launch would not end preempted."""
    rng = random.Random(seed)
    plan = SoakPlan()
    terms: list[tuple[int, str]] = []
    kinds = list(ALWAYS[:n]) + rng.choices(list(KINDS), list(KINDS.values()), k=max(0, n - len(ALWAYS)))
    for kind in kinds:
        step, rank = rng.randrange(1, steps - 1), rng.randrange(world)
        compute_phase = rng.choice(("forward", "p2p", "optimizer"))
        if kind == "term":
            terms.append((rank, compute_phase))  # placed below, once the other faults' steps are known
        elif kind == "launcher":
            plan.launcher_kills.append((step, round(rng.random(), 3)))
        elif kind == "foreign":
            plan.foreign.append(step)
        elif kind == "kill":
            phases = KILL_PHASES + (RANK0_PHASES if rank == 0 else ())
            plan.worker.append(f"rank={rank}:kill@step={step}:phase={rng.choice(phases)}")
        elif kind == "corrupt":
            plan.worker.append(f"rank={rank}:corrupt={rng.choice(CORRUPTIONS)}@step={step}:phase=step-end")
        else:  # raise, exit0, stop, hang
            plan.worker.append(f"rank={rank}:{kind}@step={step}:phase={compute_phase}")
    busy = {_step_of(f) for f in plan.worker} | {s + d for s, _ in plan.launcher_kills for d in (-1, 0)}
    free = [s for s in range(1, steps - 1) if s not in busy]
    for rank, phase in terms:
        step = free.pop(rng.randrange(len(free))) if free else rng.randrange(1, steps - 1)
        plan.worker.append(f"rank={rank}:term@step={step}:phase={phase}")
    plan.launcher_kills.sort()
    plan.foreign.sort()
    return plan


def soak_flags(run_dir: Path, steps: int, tp: int, **more: Any) -> list[str]:
    """`hybridpar train` flags of the soak: tp x pp2 (tp 2: the default layout) with a small model, so that
    60 faults take minutes; checkpoints every step."""
    flags = []
    for key, value in {**SOAK, "parallel.tp": tp, "parallel.pp": 2, "train.steps": steps, **more}.items():
        flags += [f"--{key}", str(value)]
    return flags + ["--run-dir", str(run_dir)]


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


def recovery_times(run_dir: Path) -> dict[str, Any]:
    """Detect / restart / recover times of the worker faults, and committed steps trained twice, from the
    run's own records (chaos.jsonl, resilience.jsonl, watchdog.jsonl)."""
    fired, events = read_jsonl(run_dir / "chaos.jsonl"), read_jsonl(run_dir / "resilience.jsonl")
    reports = read_jsonl(run_dir / "watchdog.jsonl")
    starts = [e for e in events if e["event"] == "start"]
    firsts = [e["time"] for e in events if e["event"] == "first_step"]
    restart_s, recover_s, detect_s = [], [], []
    for f in fired:
        nxt = next((s for s in starts if s["time"] > f["time"]), None)
        if nxt is not None and nxt["restart"] > 0:  # restarted by the agent (not: the launch ended)
            restart_s.append(nxt["time"] - f["time"])
            after = [x for x in firsts if x > nxt["time"]]
            if after:
                recover_s.append(after[0] - f["time"])
        seen = [
            r["time"] - f["time"]
            for r in reports
            if r["culprit"] == f["rank"] and r["time"] > f["time"] and (nxt is None or r["time"] < nxt["time"])
        ]
        if seen:
            detect_s.append(min(seen))
    # Attempts in order: where each resumed, how far its checkpoints got; the next one redoes the difference.
    progress: list[list[int]] = []
    for e in events:
        if e["event"] == "start":
            progress.append([0, 0])
        elif progress and e["event"] == "resumed":
            progress[-1] = [e["step"], e["step"]]
        elif progress and e["event"] == "checkpoint":
            progress[-1][1] = max(progress[-1][1], e["step"])
    redone = sum(max(0, a[1] - b[0]) for a, b in zip(progress, progress[1:]))
    return {
        "recoveries": sum(1 for s in starts if s["restart"] > 0),
        "mean_detect_s": _mean(detect_s),
        "detected_by_watchdog": len(detect_s),
        "mean_restart_s": _mean(restart_s),
        "mean_recover_s": _mean(recover_s),
        "committed_steps_redone": redone,
    }


def soak(work: Path, n_faults: int, steps: int, seed: int, tp: int, launch_timeout_s: float) -> dict[str, Any]:
    from hybridpar.resilience.session import ledger_stats

    ref_dir, run_dir, log = work / "reference", work / "soak", work / "launches.log"
    work.mkdir(parents=True, exist_ok=True)
    ref = run_launch(soak_flags(ref_dir, steps, tp), ref_dir, log, launch_timeout_s)
    ref_metrics = read_jsonl(ref_dir / "metrics.jsonl")
    if ref.end != "finished" or not ref_metrics or not ref_metrics[-1].get("final"):
        raise RuntimeError(f"the fault-free reference run did not finish ({ref.end}, exit {ref.code}): see {log}")
    ref_losses = {r["step"]: r["loss"] for r in ref_metrics if "loss" in r}
    plan = plan_faults(n_faults, steps, seed, world=2 * tp)
    load0 = round(os.getloadavg()[0], 2)
    t0 = time.time()
    launches, run_id, tried, refused = _soak_launches(run_dir, log, plan, n_faults, steps, tp, launch_timeout_s)
    wall = time.time() - t0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    step_recs = [r for r in metrics if "loss" in r and "step" in r]
    final = metrics[-1] if metrics and metrics[-1].get("final") else {}
    fired = [f["fault"] for f in read_jsonl(run_dir / "chaos.jsonl")]
    by_kind = {
        k: sum(f.split(":")[1].split("@")[0].split("=")[0] == k for f in fired)
        for k in KINDS
        if k not in ("launcher", "foreign")
    }
    by_kind.update(launcher_kill=sum(x.end == "launcher_killed" for x in launches), foreign_run=tried)
    ends = [x.end for x in launches]
    gone = [x.gone_s for x in launches if x.gone_s is not None]
    return {
        "faults_planned": n_faults,
        "faults_injected": sum(by_kind.values()),
        "injected_by_kind": by_kind,
        "launches": len(launches),
        "launch_ends": {e: ends.count(e) for e in dict.fromkeys(ends)},
        **(ledger_stats(final.get("samples_applied", []), steps, SOAK["train.global_batch"]) if final else {}),
        "params_identical": final.get("params_digest") == ref_metrics[-1]["params_digest"],
        "losses_identical": sorted(r["step"] for r in step_recs) == list(range(steps))
        and all(r["loss"] == ref_losses[r["step"]] for r in step_recs),
        "run_id_kept": final.get("run_id") == run_id,
        "exit_codes_honest": all(x.honest() for x in launches),
        "orphaned_workers": sum(x.orphans for x in launches),
        "mean_workers_gone_s": _mean(gone),
        "max_workers_gone_s": max(gone, default=None),
        "foreign_run_refused": refused,
        **recovery_times(run_dir),
        "soak_wall_s": round(wall, 1),
        "load_avg_1m": [load0, round(os.getloadavg()[0], 2)],  # at start and end: other jobs slow it all down
        "faults": fired,
        "launch_log": [asdict(x) for x in launches],
    }


def _soak_launches(
    run_dir: Path, log: Path, plan: SoakPlan, n_faults: int, steps: int, tp: int, launch_timeout_s: float
) -> tuple[list[Launch], str | None, int, int]:
    """The soak's launches on `run_dir`, with the foreign runs tried between them: (the launches, the run's
    id, foreign runs tried, foreign runs refused)."""
    kills, foreign = list(plan.launcher_kills), list(plan.foreign)
    launches: list[Launch] = []
    refused = tried = 0
    run_id = None
    # Each launch ends finished, preempted or killed; a failure or a timeout ends the soak (and fails it).
    while len(launches) < 3 + len(plan.launcher_kills) + sum(":term@" in f for f in plan.worker):
        kill = kills[0] if kills else (None, 0.0)
        flags = soak_flags(
            run_dir,
            steps,
            tp,
            **{
                "resilience.max_restarts": n_faults + 5,
                "emulate.fault": ",".join(plan.worker),
                "checkpoint.resume": "auto" if launches else "off",
            },
        )
        launch = run_launch(flags, run_dir, log, launch_timeout_s, *kill)
        launches.append(launch)
        run_id = run_id or run_id_of(run_dir)  # None until a launch got as far as claiming the directory
        if launch.end == "launcher_killed":
            kills.pop(0)
        going_on = launch.end in ("preempted", "launcher_killed")
        done = steps_checkpointed(run_dir)
        for f in [f for f in foreign if f <= done or not going_on]:  # between launches (after the last: all)
            foreign.remove(f)
            tried += 1
            other = soak_flags(
                run_dir, steps, tp, **{"train.seed": Config().train.seed + tried, "checkpoint.resume": "off"}
            )
            refused += foreign_run_refused(other, run_dir, log)
        if not going_on:
            break
    return launches, run_id, tried, refused


def checkpoint_cost(work: Path, steps: int) -> dict[str, Any]:
    """Sync vs async save on the default model and layout: seconds the training loop stands still. Each
    run is a launch whose workers are spawned: this process has started threads by now (the soak's,
    numpy's BLAS pool), so forking it is refused (launcher.fork_refusal)."""
    from hybridpar.run.launcher import launch

    out: dict[str, Any] = {}
    walls: dict[str, float] = {}
    for mode in ("sync", "async"):
        cfg = Config()
        cfg.train.steps, cfg.train.val_every, cfg.train.sample_tokens, cfg.train.monitor_every = steps, 0, 0, 0
        cfg.checkpoint.every, cfg.checkpoint.async_save = 2, mode == "async"
        cfg.run_dir = str(work / f"ckpt-{mode}")
        t0 = time.monotonic()
        launch(cfg, start_method="spawn", max_restarts=0)
        walls[mode] = round(time.monotonic() - t0, 2)
        saves = [e for e in read_jsonl(work / f"ckpt-{mode}" / "resilience.jsonl") if e["event"] == "checkpoint"]
        out[mode] = saves
    sync = statistics.median(e["stall_s"] for e in out["sync"])
    stall = statistics.median(e["stall_s"] for e in out["async"])
    writes = [e["last_write_s"] for e in out["async"] if e["last_write_s"] is not None]
    return {
        "ckpt_sync_s": round(sync, 4),
        "ckpt_async_stall_s": round(stall, 4),
        "ckpt_async_stall_ratio": round(stall / sync, 4),
        "ckpt_async_write_s": round(statistics.median(writes), 4) if writes else None,
        "ckpt_saves_per_mode": len(out["sync"]),
        "ckpt_launch_wall_s": walls,
    }


def passed(result: dict[str, Any]) -> bool:
    """Every part ran; nothing lost, doubled or changed, and every adversary's attempt met as it must be."""
    if any(k.endswith("_error") for k in result):
        return False
    return bool(
        result["params_identical"]
        and result["losses_identical"]
        and result["run_id_kept"]
        and result.get("lost_samples") == 0
        and result.get("duplicated_samples") == 0
        and result["exit_codes_honest"]
        and result["orphaned_workers"] == 0
        and result["foreign_run_refused"] == result["injected_by_kind"]["foreign_run"]
    )


def kernels() -> dict[str, Any]:
    """The CPU kernels the workers (which inherit this environment) run: ATen's vector width and the limits
    set on MKL and oneDNN, so that a run with kernels limited to another machine's says so."""
    import torch

    from hybridpar.model.reference import KERNELS

    limits = sorted({k for env in KERNELS.values() for k in env})
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_limits": {k: os.environ[k] for k in limits if k in os.environ},
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=32, help="random faults in the soak (default 32)")
    ap.add_argument("--steps", type=int, default=40, help="training steps of the soak run (default 40)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tp",
        type=int,
        default=2,
        choices=(1, 2),
        help="tensor-parallel size of the soak, with pp 2 (default 2: 4 processes; 1: 2 processes)",
    )
    ap.add_argument(
        "--ckpt-steps",
        type=int,
        default=12,
        help="steps of each checkpoint-cost run (default 12; 0 skips the checkpoint cost)",
    )
    ap.add_argument(
        "--launch-timeout-s",
        type=float,
        default=1800.0,
        help="longest one launch of the soak may take before it is killed and the soak fails",
    )
    ap.add_argument("--json", help="also write the result to this file")
    ap.add_argument(
        "--runs-dir",
        help="keep the run directories (reference, soak, ckpt-sync, ckpt-async) and launches.log here; "
        "`hybridpar report DIR/soak` reads the soak's restarts and faults (default: runs/bench/chaos-<time>)",
    )
    a = ap.parse_args(argv)
    if a.steps < 3 or a.faults < 1 or a.ckpt_steps < 0 or not 0 < a.launch_timeout_s < float("inf"):
        ap.error("--steps must be >= 3, --faults >= 1, --ckpt-steps >= 0 and --launch-timeout-s a positive number")
    work = runs_dir("chaos", a.runs_dir)
    print(f"hybridpar bench chaos: run directories in {work}", file=sys.stderr)
    result: dict[str, Any] = {
        "bench": "chaos",
        "mode": "soak through `hybridpar train` (torch elastic agent), CPU/gloo",
        "seed": a.seed,
        "steps": a.steps,
        "layout": f"tp{a.tp} x pp2",
        "runs_dir": str(work),
        **kernels(),
    }
    # Each part's figures are written as soon as it ends: a failure in a later part keeps them.
    for part, measure in (
        ("soak", lambda: soak(work, a.faults, a.steps, a.seed, a.tp, a.launch_timeout_s)),
        ("checkpoint_cost", lambda: checkpoint_cost(work, a.ckpt_steps) if a.ckpt_steps else {}),
    ):
        try:
            result.update(measure())
        except Exception as e:  # noqa: BLE001 - recorded in the result, which then fails
            result[f"{part}_error"] = f"{type(e).__name__}: {e}"
            print(f"hybridpar bench chaos: the {part} part failed: {result[f'{part}_error']}", file=sys.stderr)
        emit(result, a.json, echo=False)  # the figures so far: a later part's failure keeps them
    print(json.dumps(result, indent=1))
    return 0 if passed(result) else 1

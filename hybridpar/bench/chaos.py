"""`hybridpar bench chaos`: a soak of random faults through the real elastic launcher, judged against a
fault-free run of the same config in the same invocation, plus synchronous vs asynchronous checkpoint cost
on the default model.

Soak: `--faults` faults (seeded) drawn over the run's steps — SIGKILL in any phase (forward, p2p,
all-reduce, optimizer, step end, each checkpoint phase), an exception, sys.exit(0), SIGSTOP, a hang, and
checkpoint damage (bit flip, truncation, deletion, a file from another step, a pickle) followed by a kill
— each injected once by the chaos testing mode. Every failure makes the agent restart all workers, which
resume from the newest checkpoint that verifies. Reported, all measured from the run's own records:

- faults_injected: faults that really fired (`chaos.jsonl`); recoveries: worker-group restarts;
- lost_samples / duplicated_samples: from the sample ledger carried through every checkpoint (a step
  never applied to the final model, or applied twice, counts global_batch samples);
- params_identical / losses_identical: final params_digest, and every per-step loss ever logged
  (recomputed steps included), equal to the fault-free run's, bit for bit;
- mean_detect_s: fault -> watchdog verdict, over the faults the watchdog detects (frozen or hung ranks;
  dead ranks are seen by the agent's process monitor, whose latency is not observable from here);
- mean_restart_s: fault -> the restarted worker group starts; mean_recover_s: fault -> its first
  completed step; steps_recomputed: step records logged more than once;
- ckpt_sync_s: median seconds a synchronous save stops training (default model and layout);
  ckpt_async_stall_s: the same for an asynchronous save (snapshot + waiting for the previous write);
  their ratio, and the background write time.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridpar.config import Config

KILL_PHASES = ("forward", "p2p", "all-reduce", "optimizer", "step-end", "ckpt-write", "ckpt-barrier")
RANK0_PHASES = ("ckpt-manifest", "ckpt-rename", "ckpt-done")  # only rank 0 commits
CORRUPTIONS = ("flip", "truncate", "delete", "mix", "pickle")


def random_faults(n: int, steps: int, world: int, seed: int) -> list[str]:
    """`n` fault entries (emulate.fault syntax), seeded; every one lands in a phase its rank executes."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        step, rank = rng.randrange(1, steps - 1), rng.randrange(world)
        kind = rng.choices(["kill", "raise", "exit0", "stop", "hang", "corrupt"], [8, 1, 1, 1, 1, 2])[0]
        if kind == "kill":
            phases = KILL_PHASES + (RANK0_PHASES if rank == 0 else ())
            out.append(f"rank={rank}:kill@step={step}:phase={rng.choice(phases)}")
        elif kind == "corrupt":
            out.append(f"rank={rank}:corrupt={rng.choice(CORRUPTIONS)}@step={step}:phase=step-end")
        else:
            out.append(f"rank={rank}:{kind}@step={step}:phase={rng.choice(('forward', 'p2p', 'optimizer'))}")
    return out


def soak_config(run_dir: Path, steps: int, faults: str) -> Config:
    cfg = Config()  # the default layout (tp2 x pp2) with a small model, so that 30+ restarts take minutes
    m, t = cfg.model, cfg.train
    m.dim, m.n_layers, m.n_heads, m.ffn_dim = 64, 4, 4, 128
    t.steps, t.global_batch, t.microbatches, t.seq_len, t.warmup_steps = steps, 8, 2, 64, 2
    t.val_every, t.val_batches, t.sample_tokens, t.monitor_every = 10, 1, 0, 0
    cfg.data.max_bytes = 400_000
    cfg.checkpoint.every, cfg.checkpoint.keep = 1, 3
    r = cfg.resilience
    r.hang_timeout_s, r.heartbeat_s, r.slow_phase_timeout_s = 2.0, 0.25, 60.0
    cfg.parallel.timeout_s = 30.0
    cfg.emulate.fault = faults
    cfg.run_dir = str(run_dir)
    return cfg


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


def soak(work: Path, n_faults: int, steps: int, seed: int, start_method: str) -> dict[str, Any]:
    from hybridpar.resilience.session import ledger_stats
    from hybridpar.topology.launch import launch

    ref_dir, run_dir = work / "reference", work / "soak"
    ref = launch(soak_config(ref_dir, steps, ""), start_method=start_method, max_restarts=0)
    faults = random_faults(n_faults, steps, 4, seed)
    t0 = time.time()
    res = launch(soak_config(run_dir, steps, ",".join(faults)), start_method=start_method,
                 max_restarts=n_faults + 5)
    wall = time.time() - t0
    fired, events = _jsonl(run_dir / "chaos.jsonl"), _jsonl(run_dir / "resilience.jsonl")
    reports, metrics = _jsonl(run_dir / "watchdog.jsonl"), _jsonl(run_dir / "metrics.jsonl")
    starts = [e["time"] for e in events if e["event"] == "start" and e["restart"] > 0]
    firsts = [e["time"] for e in events if e["event"] == "first_step"]
    restart_s, recover_s, detect_s = [], [], []
    for f in fired:
        later = [s for s in starts if s > f["time"]]
        if later:
            restart_s.append(later[0] - f["time"])
            after = [x for x in firsts if x > later[0]]
            if after:
                recover_s.append(after[0] - f["time"])
        seen = [r["time"] - f["time"] for r in reports if r["culprit"] == f["rank"] and r["time"] > f["time"]
                and (not later or r["time"] < later[0])]
        if seen:
            detect_s.append(min(seen))
    step_recs = [r for r in metrics if "loss" in r and "step" in r]
    ref_losses = ref["losses"]
    final = metrics[-1] if metrics and metrics[-1].get("final") else {}
    ledger = ledger_stats(final.get("samples_applied", []), steps, 8) if final else {}
    return {
        "faults_planned": len(faults), "faults_injected": len(fired), "recoveries": len(starts),
        **ledger,
        "params_identical": res is not None and res["params_digest"] == ref["params_digest"],
        "losses_identical": {r["step"] for r in step_recs} == set(range(steps))
                            and all(r["loss"] == ref_losses[r["step"]] for r in step_recs),
        "mean_detect_s": _mean(detect_s), "detected_by_watchdog": len(detect_s),
        "mean_restart_s": _mean(restart_s), "mean_recover_s": _mean(recover_s),
        "steps_recomputed": len(step_recs) - steps, "soak_wall_s": round(wall, 1),
        "faults": [f["fault"] for f in fired],
    }


def checkpoint_cost(work: Path, steps: int, start_method: str) -> dict[str, Any]:
    """Sync vs async save on the default model and layout: seconds the training loop stands still."""
    from hybridpar.topology.launch import launch

    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        cfg = Config()
        cfg.train.steps, cfg.train.val_every, cfg.train.sample_tokens, cfg.train.monitor_every = steps, 0, 0, 0
        cfg.checkpoint.every, cfg.checkpoint.async_save = 2, mode == "async"
        cfg.run_dir = str(work / f"ckpt-{mode}")
        launch(cfg, start_method=start_method, max_restarts=0)
        saves = [e for e in _jsonl(work / f"ckpt-{mode}" / "resilience.jsonl") if e["event"] == "checkpoint"]
        out[mode] = saves
    sync = statistics.median(e["stall_s"] for e in out["sync"])
    stall = statistics.median(e["stall_s"] for e in out["async"])
    writes = [e["last_write_s"] for e in out["async"] if e["last_write_s"] is not None]
    return {"ckpt_sync_s": round(sync, 4), "ckpt_async_stall_s": round(stall, 4),
            "ckpt_async_stall_ratio": round(stall / sync, 4),
            "ckpt_async_write_s": round(statistics.median(writes), 4) if writes else None,
            "ckpt_saves_per_mode": len(out["sync"])}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=32, help="random faults in the soak (default 32)")
    ap.add_argument("--steps", type=int, default=40, help="training steps of the soak run (default 40)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-steps", type=int, default=12, help="steps of each checkpoint-cost run (default 12)")
    ap.add_argument("--start-method", default="fork", choices=("fork", "spawn"),
                    help="how the agent starts workers (fork: faster restarts; CPU only)")
    ap.add_argument("--json", help="also write the result to this file")
    ap.add_argument("--work-dir", help="keep run directories here (default: a temporary directory)")
    a = ap.parse_args(argv)
    if a.steps < 3 or a.faults < 1:
        ap.error("--steps must be >= 3 and --faults >= 1")
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="hybridpar-chaos-"))
    try:
        result = {"bench": "chaos", "mode": "soak through hybridpar.launch (torch elastic agent), CPU/gloo",
                  "seed": a.seed, "steps": a.steps, **soak(work, a.faults, a.steps, a.seed, a.start_method),
                  **checkpoint_cost(work, a.ckpt_steps, a.start_method)}
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    ok = result["params_identical"] and not result["lost_samples"] and not result["duplicated_samples"]
    return 0 if ok else 1

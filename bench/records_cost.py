"""What the per-step records and sinks cost: the default run (tp2 x pp2, default model) with them on —
per-rank summaries, measured bubble, MFU against the measured device peak, one step's timeline, TensorBoard
event files — side by side with them off (`--sinks.step_details false --sinks.tensorboard off`), in
alternating repeats in one process tree, so machine load drifts over both arms alike (JSON).

    .venv/bin/python bench/records_cost.py [--steps 40] [--repeats 3] [--json FILE]

First one run whose steps alternate on and off (paired: the fairest comparison on a loaded machine),
timing the step and what the run loop adds after it; `paired.cost` = added seconds / step time off, and
`paired.cost_timed_directly` = (the summaries' own work inside the step, timed alone, plus the loop's
added seconds) / step time off — the figure that other processes' load on the cores cannot blur.
Then whole launches, on and off in alternating order, two figures per launch: the median `step_time_s`
past the warm-up steps (what the trainer measures: the summaries ride on its loss reduction), and the
whole `train()` call's wall time per step (everything the run loop adds too: records, sinks, the peak
measurement, the timeline gather). Each arm's figure is the
median over its repeats; `cost` is on / off - 1. The load average is recorded before each launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridpar.config import Config
from hybridpar.testing import run_ranks

WARMUP = 3  # steps left out of the step-time median: allocations and lazy initialisation


def _worker(cfg_dict: dict) -> float:
    from hybridpar.train import train

    t0 = time.perf_counter()
    train(Config.from_dict(cfg_dict), log=False)
    return time.perf_counter() - t0


def _paired(cfg_dict: dict, steps: int) -> dict | None:
    """One run whose steps alternate records on and off (the trainer reads `sinks.step_details` every
    step), so drift in the machine's load falls on both alike; rank 0 also times what the run loop adds
    after each step (records, metrics.jsonl, sinks) against writing metrics.jsonl alone."""
    import torch

    from hybridpar.report.metrics import MetricsWriter
    from hybridpar.report.sinks import open_sinks
    from hybridpar.report.step_records import StepRecords
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p, run_dir = cfg.parallel, Path(cfg.run_dir)
    topo = build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s)
    trainer = Trainer(cfg, topo)
    records = StepRecords(cfg, topo, 0, 0, torch.float32)
    rank0 = topo.rank == 0
    full = MetricsWriter(run_dir / "metrics.jsonl", sinks=open_sinks(cfg.sinks, run_dir, 0, "bench")) if rank0 else None
    plain = MetricsWriter(run_dir / "plain.jsonl") if rank0 else None
    step_s: dict[bool, list[float]] = {True: [], False: []}
    after_s: dict[bool, list[float]] = {True: [], False: []}
    in_step_s: list[float] = []
    for step in range(steps):
        on = step % 2 == 0
        cfg.sinks.step_details = on  # the trainer holds this very config
        rec = trainer.step(step)
        t0 = time.perf_counter()
        if on:
            rec = records.add(rec)
            records.timeline(step, trainer.last_output)
        if rank0:
            (full if on else plain).write(rec)
        if step >= WARMUP:
            step_s[on].append(rec["step_time_s"])
            after_s[on].append(time.perf_counter() - t0)
            in_step_s.append(_summary_s(trainer, topo))
    if not rank0:
        return None
    full.close()
    plain.close()
    med = {
        k: {"on": statistics.median(v[True]), "off": statistics.median(v[False])}
        for k, v in (("step_time_s", step_s), ("after_step_s", after_s))
    }
    added = (
        med["step_time_s"]["on"] - med["step_time_s"]["off"] + med["after_step_s"]["on"] - med["after_step_s"]["off"]
    )
    # Timed directly (no noise from other steps): the summaries' own work in the step, plus the loop's.
    direct = statistics.median(in_step_s) + med["after_step_s"]["on"] - med["after_step_s"]["off"]
    return {
        "median": med,
        "summary_in_step_s": statistics.median(in_step_s),
        "cost": added / med["step_time_s"]["off"],
        "cost_timed_directly": direct / med["step_time_s"]["off"],
    }


def _summary_s(trainer: Any, topo: Any) -> float:
    """Seconds of what the step does for the records beyond its loss reduction: this rank's summary of
    the step just run, packed into the reduction's vector and unpacked again (report/records.py)."""
    import torch

    from hybridpar.report.records import FIELDS, rank_summary, step_fields, unpack

    t0 = time.perf_counter()
    n, world = len(FIELDS), topo.dims.world_size
    v = torch.zeros(2 + n * world, dtype=torch.float64)
    v[2 + n * topo.rank : 2 + n * (topo.rank + 1)] = torch.tensor(
        rank_summary(trainer.last_output, trainer._work(sum(trainer.plan.sizes[topo.dp_rank])))
    )
    step_fields(unpack(v[2:].tolist(), world))
    return time.perf_counter() - t0


def one_launch(on: bool, steps: int, work: Path) -> dict:
    cfg = Config()  # the default run
    cfg.train.steps, cfg.train.val_every, cfg.train.sample_tokens = steps, 0, 0
    cfg.sinks.step_details = on
    cfg.sinks.tensorboard = "auto" if on else "off"
    cfg.run_dir = str(work / f"run-{'on' if on else 'off'}-{time.monotonic_ns()}")
    load = os.getloadavg()[0]
    wall = run_ranks(_worker, cfg.parallel.world_size, cfg.to_dict(), timeout_s=900)[0]
    recs = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in recs if "loss" in r][WARMUP:]
    assert ("mfu" in recs[0]) == on and (Path(cfg.run_dir) / "tb").is_dir() == on, "the arm did not take"
    return {
        "records": "on" if on else "off",
        "median_step_time_s": statistics.median(times),
        "wall_per_step_s": wall / steps,
        "loadavg_1min_before": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paired-steps", type=int, default=60, help="steps of the run alternating on and off")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="hybridpar-records-cost-") as work:
        cfg = Config()
        cfg.train.steps, cfg.train.val_every, cfg.train.sample_tokens = a.paired_steps, 0, 0
        cfg.run_dir = str(Path(work) / "paired")
        load = os.getloadavg()[0]
        paired = run_ranks(_paired, cfg.parallel.world_size, cfg.to_dict(), a.paired_steps, timeout_s=900)[0]
        paired["loadavg_1min_before"] = load
        print(json.dumps({"paired": paired}), flush=True)
        for i in range(a.repeats):
            for on in (True, False) if i % 2 == 0 else (False, True):  # alternate which arm goes first
                runs.append(one_launch(on, a.steps, Path(work)))
                print(json.dumps(runs[-1]), flush=True)

    def med(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["records"] == arm)

    out = {
        "bench": "records_cost",
        "layout": "tp2 x pp2 (default run)",
        "steps": a.steps,
        "repeats": a.repeats,
        "paired_steps": a.paired_steps,
        "paired": paired,
        "runs": runs,
        "median_step_time_s": {"on": med("on", "median_step_time_s"), "off": med("off", "median_step_time_s")},
        "wall_per_step_s": {"on": med("on", "wall_per_step_s"), "off": med("off", "wall_per_step_s")},
    }
    for key in ("median_step_time_s", "wall_per_step_s"):
        out[f"cost_{key}"] = out[key]["on"] / out[key]["off"] - 1
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

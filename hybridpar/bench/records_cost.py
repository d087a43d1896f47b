"""What the per-step records and sinks cost: the default run (tp2 x pp2, default model) with them on —
per-rank summaries, measured bubble, MFU against the measured device peak, one step's timeline, TensorBoard
event files — side by side with them off (`--sinks.step_details false --sinks.tensorboard off`), in
alternating repeats in one process tree, so machine load drifts over both arms alike (JSON).

    .venv/bin/hybridpar bench records_cost [--steps 40] [--repeats 3] [--json FILE]

First one run in pairs of steps, one on and one off in a random order (paired: the fairest comparison
on a loaded machine), timing the step and what the run loop adds after it; `paired.cost` = (the median
in-pair step difference + the loop's added seconds) / step time off, with `cost_ci95` from the interval
of that median; `paired.cpu.cost` the same in CPU seconds summed over the ranks (what other jobs' load
cannot blur, and what wall time follows where ranks share cores); and
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
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridpar.bench import emit
from hybridpar.config import Config
from hybridpar.topology.spawn import run_ranks

WARMUP = 3  # steps left out of the step-time median: allocations and lazy initialisation


def _worker(cfg_dict: dict) -> float:
    from hybridpar.run.train import train

    t0 = time.perf_counter()
    train(Config.from_dict(cfg_dict), log=False)
    return time.perf_counter() - t0


def _paired(cfg_dict: dict, steps: int) -> dict | None:
    """One run in pairs of consecutive steps, one with records on and one off, the order inside each pair
    drawn at random (seeded: every rank draws the same), so that neither load drift nor anything that
    alternates with the step's parity falls on one arm. The trainer reads `sinks.step_details` every
    step. Rank 0 also times what the run loop adds after each step (records, metrics.jsonl, sinks)
    against writing metrics.jsonl alone."""
    import random

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
    rng = random.Random(0)
    pairs: list[dict[bool, float]] = []  # per pair: step time of each arm
    cpu_pairs: list[list[float]] = []  # per pair: this process's CPU seconds of [on, off] (every thread)
    after_s: dict[bool, list[float]] = {True: [], False: []}
    in_step_s: list[float] = []
    step = 0
    while step < steps:
        first = rng.random() < 0.5
        pair: dict[bool, float] = {}
        cpu: dict[bool, float] = {}
        for on in (first, not first):
            cfg.sinks.step_details = on  # the trainer holds this very config
            c0 = time.process_time()
            rec = trainer.step(step)
            t0 = time.perf_counter()
            if on:
                rec = records.add(rec)
                records.timeline(step, trainer.last_output)
            if rank0:
                (full if on else plain).write(rec)
            pair[on] = rec["step_time_s"]
            cpu[on] = time.process_time() - c0
            if step >= WARMUP:
                after_s[on].append(time.perf_counter() - t0)
                in_step_s.append(_summary_s(trainer, topo))
            step += 1
        if step > WARMUP + 1:
            pairs.append(pair)
            cpu_pairs.append([cpu[True], cpu[False]])
    if not rank0:
        return {"cpu_pairs": cpu_pairs}
    full.close()
    plain.close()
    diffs = [q[True] - q[False] for q in pairs]
    off = statistics.median(q[False] for q in pairs)
    after = statistics.median(after_s[True]) - statistics.median(after_s[False])
    lo, hi = _median_interval(diffs)
    # Timed directly (no noise from other steps): the summaries' own work in the step, plus the loop's.
    direct = statistics.median(in_step_s) + after
    return {
        "pairs": len(pairs),
        "median": {
            "step_time_s": {"on": statistics.median(q[True] for q in pairs), "off": off},
            "after_step_s": {"on": statistics.median(after_s[True]), "off": statistics.median(after_s[False])},
        },
        "step_difference_s": {"median": statistics.median(diffs), "ci95": [lo, hi]},
        "summary_in_step_s": statistics.median(in_step_s),
        "cost": (statistics.median(diffs) + after) / off,
        "cost_ci95": [(lo + after) / off, (hi + after) / off],
        "cost_timed_directly": direct / off,
        "cpu_pairs": cpu_pairs,
    }


def _cpu_cost(per_rank: list[list[list[float]]]) -> dict:
    """The records' cost in CPU time: per pair, every rank's CPU seconds of its on step and its off step
    (step and run loop, all threads) summed over the ranks; the median difference over the median off
    total. Other processes' load stretches wall time but hardly the CPU time of a given piece of work, so
    on a shared machine this is the figure that holds; where ranks share cores, as here, wall time follows it."""
    on = [sum(r[i][0] for r in per_rank) for i in range(len(per_rank[0]))]
    off = [sum(r[i][1] for r in per_rank) for i in range(len(per_rank[0]))]
    diffs = [a - b for a, b in zip(on, off)]
    base = statistics.median(off)
    lo, hi = _median_interval(diffs)
    return {
        "cpu_s_per_step": {"on": statistics.median(on), "off": base},
        "cost": statistics.median(diffs) / base,
        "cost_ci95": [lo / base, hi / base],
    }


def _median_interval(xs: list[float]) -> tuple[float, float]:
    """A distribution-free 95% interval of the median of `xs` (order statistics of the binomial: the
    ranks n/2 -+ 1.96 sqrt(n)/2), so one noisy pair cannot move it."""
    s, n = sorted(xs), len(xs)
    half = 1.96 * math.sqrt(n) / 2
    return s[max(0, math.floor(n / 2 - half))], s[min(n - 1, math.ceil(n / 2 + half) - 1)]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench records_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paired-steps", type=int, default=60, help="steps of the run alternating on and off")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    a = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="hybridpar-records-cost-") as work:
        cfg = Config()
        cfg.train.steps, cfg.train.val_every, cfg.train.sample_tokens = a.paired_steps, 0, 0
        cfg.run_dir = str(Path(work) / "paired")
        load = os.getloadavg()[0]
        ranks = run_ranks(_paired, cfg.parallel.world_size, cfg.to_dict(), a.paired_steps, timeout_s=900)
        paired = ranks[0]
        paired["cpu"] = _cpu_cost([r.pop("cpu_pairs") for r in ranks])
        paired["loadavg_1min_before"], paired["loadavg_1min_after"] = load, os.getloadavg()[0]
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
    }
    if runs:  # --repeats 0: the paired run alone
        for key in ("median_step_time_s", "wall_per_step_s"):
            out[key] = {"on": med("on", key), "off": med("off", key)}
            out[f"cost_{key}"] = out[key]["on"] / out[key]["off"] - 1
    emit(out, a.json, indent=2)
    return 0

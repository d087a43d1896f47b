"""Activation recomputation (`train.recompute`): activation peak and step time of none, full and
selective, side by side on one trainer (JSON).

    .venv/bin/hybridpar bench recompute [--layouts 1x1x1,2x2x1] [--seq-len 256] [--rounds 8] [--json FILE]

Layouts are TPxPPxDP, the model is the default one. In each layout one trainer runs rounds of blocks of
steps, one block per mode, the modes' order rotating every round, so a shared machine's drift hits all
of them alike. Peak: the activation meter's bytes held for backward (max over ranks, pipeline/activation_meter.py).
Time: the median step time per mode, and per round each mode's block median over none's, reported as
the median ratio with its spread (min, max over rounds). Wall time on a shared, loaded machine mostly
measures the wait for a core, so beside it the CPU time the ranks spent (process time per step, median
over blocks, summed over ranks) and its ratio over none's: the work each mode adds, whatever the load.
The load average is taken before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from hybridpar.bench import emit, layout_config
from hybridpar.config import Config
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.topology.spawn import run_ranks

MODES = ("none", "full", "selective")


def _worker(cfg_dict: dict, rounds: int, steps: int) -> dict:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    topo = build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s)
    trainer = Trainer(cfg, topo)
    step = 0
    times: dict[str, list[list[float]]] = {m: [] for m in MODES}  # per round, the block's step times
    peaks: dict[str, int] = {}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}  # per round, this rank's process time per step
    for r in range(rounds + 1):  # round 0 warms every mode up and is not counted
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            for st in trainer.stages.values():
                st.recompute = mode
            c0 = time.process_time()
            recs = [trainer.step(s) for s in range(step, step + steps)]
            step += steps
            if r > 0:
                cpu[mode].append((time.process_time() - c0) / steps)
                times[mode].append([x["step_time_s"] for x in recs])
                peaks[mode] = max([peaks.get(mode, 0)] + [x["activation_peak_bytes"] for x in recs])
    mine = {m: statistics.median(cpu[m]) for m in MODES}
    if topo.rank != 0:
        return {"cpu_s": mine}
    block = {m: [statistics.median(b) for b in times[m]] for m in MODES}
    out: dict = {"modes": {}}
    for m in MODES:
        ratios = [a / b for a, b in zip(block[m], block["none"])]
        out["modes"][m] = {
            "activation_peak_bytes": peaks[m],
            "peak_vs_none": peaks[m] / peaks["none"],
            "peak_reduction": 1 - peaks[m] / peaks["none"],
            "median_step_time_s": statistics.median(t for b in times[m] for t in b),
            "step_time_vs_none": statistics.median(ratios),
            "step_time_vs_none_spread": [min(ratios), max(ratios)],
        }
    return {**out, "cpu_s": mine}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench recompute", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="1x1x1,2x2x1")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8, help="measured rounds (one block per mode each)")
    ap.add_argument("--steps", type=int, default=2, help="steps per block")
    ap.add_argument("--json", default=None, help="also write the records to FILE")
    a = ap.parse_args(argv)
    records = []
    for layout in a.layouts.split(","):
        cfg = layout_config(layout)
        tp, pp, dp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp
        cfg.train.seq_len, cfg.train.val_every, cfg.train.monitor_every = a.seq_len, 0, 0
        validate_config(cfg, tp * pp * dp)
        load_before = os.getloadavg()
        ranks = run_ranks(_worker, tp * pp * dp, cfg.to_dict(), a.rounds, a.steps, timeout_s=1800)
        rec = ranks[0]
        cpu = {m: sum(r["cpu_s"][m] for r in ranks) for m in MODES}  # CPU seconds per step, all ranks
        for m in MODES:
            rec["modes"][m].update(cpu_s_per_step=cpu[m], cpu_time_vs_none=cpu[m] / cpu["none"])
        del rec["cpu_s"]
        rec = {
            "layout": f"tp{tp}-pp{pp}-dp{dp}",
            "schedule": cfg.parallel.schedule,
            "model": f"{cfg.model.dim}d-{cfg.model.n_layers}L-ffn{cfg.model.ffn_dim}",
            "seq_len": a.seq_len,
            "global_batch": cfg.train.global_batch,
            "microbatches": cfg.train.microbatches,
            "rounds": a.rounds,
            "steps_per_block": a.steps,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            **rec,
        }
        records.append(rec)
        print(json.dumps(rec), file=sys.stderr)
    emit(records, a.json)
    return 0

"""Median training-step time of the default model under several layouts, in one run (JSON).

    .venv/bin/hybridpar bench step_time [--steps 12] [--layouts 2x2x1,1x2x2] [--json FILE]

Layouts are TPxPPxDP. Each layout trains the default model on local gloo processes; the first two
steps (warm-up) are not counted. The ratio column compares each layout with the first one.
"""

from __future__ import annotations

import argparse
import json
import statistics

from hybridpar.bench import layout_config
from hybridpar.config import Config
from hybridpar.topology.spawn import run_ranks


def _worker(cfg_dict: dict, steps: int) -> float:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    trainer = Trainer(cfg, build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s))
    times = [trainer.step(s)["step_time_s"] for s in range(steps)]
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench step_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layouts", default="2x2x1,1x2x2,1x4x1,2x1x2,1x1x1")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    records = []
    for layout in a.layouts.split(","):
        cfg = layout_config(layout)
        tp, pp, dp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp
        cfg.train.microbatches = a.microbatches
        t = run_ranks(_worker, tp * pp * dp, cfg.to_dict(), a.steps, timeout_s=600)[0]
        records.append(
            {
                "tp": tp,
                "pp": pp,
                "dp": dp,
                "microbatches": a.microbatches,
                "step_time_s": t,
                "tokens_per_s": cfg.train.global_batch * cfg.train.seq_len / t,
            }
        )
    for r in records:
        r["ratio_vs_first"] = records[0]["step_time_s"] / r["step_time_s"]
    out = json.dumps(records, indent=1)
    print(out)
    if a.json:
        open(a.json, "w").write(out + "\n")
    return 0

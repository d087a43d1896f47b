"""fp32 against bf16 on the default model and layout (tp2 x pp2), side by side, in one invocation (JSON).

    .venv/bin/hybridpar bench precision [--steps 12] [--repeats 3] [--layout 2x2x1] [--json FILE] [--model.dim N ...]

Each repeat trains `--steps` steps in fp32 and then in bf16 (the order alternates between repeats) on
local gloo processes; the first two steps of each (warm-up) are not counted. Reported: the median step
time and tokens/s of each precision over all counted steps, the bf16/fp32 tokens/s ratio per repeat and
its median, the pipeline bytes each rank sent per step, the final training loss of each, and the load
average before and after. Any `--section.key VALUE` flag of `hybridpar train` changes the model or run
(e.g. `--model.dim 2048 --train.seq_len 2048` on a GPU, where the default model is too small to keep one
busy); the backend and device follow the machine (NCCL on CUDA).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from hybridpar.bench import emit
from hybridpar.config import Config
from hybridpar.config.parse import parse_args
from hybridpar.topology.spawn import run_ranks


def _worker(cfg_dict: dict, steps: int) -> dict:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    trainer = Trainer(cfg, build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s))
    recs = [trainer.step(s) for s in range(steps)]
    return {
        "step_time_s": [r["step_time_s"] for r in recs[2:]],
        "loss": recs[-1]["loss"],
        "p2p_bytes_per_step": sum(s.sent_bytes for s in trainer.p2p.stats.values()) / steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench precision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layout", default="2x2x1", help="TPxPPxDP")
    ap.add_argument("--json", default=None)
    a, rest = ap.parse_known_args(argv)
    base = parse_args(rest)  # --section.key VALUE overrides; a wrong key is named by parse_args
    tp, pp, dp = map(int, a.layout.split("x"))
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    ratios, last = [], {}
    for rep in range(a.repeats):
        order = ("fp32", "bf16") if rep % 2 == 0 else ("bf16", "fp32")
        per = {}
        for prec in order:
            cfg = Config.from_dict(base.to_dict())
            cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = tp, pp, dp
            cfg.train.precision = prec
            ranks = run_ranks(_worker, tp * pp * dp, cfg.to_dict(), a.steps, timeout_s=900)
            steps = [max(r["step_time_s"][i] for r in ranks) for i in range(a.steps - 2)]
            times[prec] += steps
            per[prec] = statistics.median(steps)
            last[prec] = {"loss": ranks[0]["loss"], "p2p_bytes_per_step_rank0": ranks[0]["p2p_bytes_per_step"]}
            print(f"repeat {rep + 1}/{a.repeats} {prec}: median step {per[prec]:.3f} s", file=sys.stderr, flush=True)
        ratios.append(per["fp32"] / per["bf16"])
    tokens = base.train.global_batch * base.train.seq_len
    out = {
        "layout": a.layout,
        "overrides": rest,
        "steps": a.steps,
        "repeats": a.repeats,
        **{f"{p}_median_step_s": statistics.median(t) for p, t in times.items()},
        **{f"{p}_tokens_per_s": tokens / statistics.median(t) for p, t in times.items()},
        "bf16_over_fp32_tokens_per_s_per_repeat": ratios,
        "bf16_over_fp32_tokens_per_s": statistics.median(ratios),
        "last": last,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "command": "hybridpar bench precision " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    emit(out, a.json)
    return 0

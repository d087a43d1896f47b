"""Median training-step time of the default model under several layouts, in one run (JSON).

    .venv/bin/hybridpar bench step_time [--steps 12] [--layouts 2x2x1,1x2x2] [--zero 1,2,3]
                                        [--regather microbatch,step] [--precisions fp32,bf16,copies]
                                        [--repeats 3] [--json FILE]

Layouts are TPxPPxDP. Each layout trains the default model on local gloo processes; the first two
steps (warm-up) are not counted. `--zero` runs each layout under each ZeRO level listed (ZeRO-3 under
each `--regather` mode: when gathered parameters are freed, dataparallel/zero3.py), and under each of
`--precisions` (fp32; bf16: autocast; copies: bf16 working copies, train.bf16_weights); `--repeats`
launches the whole set that many times, alternating layouts and levels launch by launch, so a change in
the machine's load falls on all of them alike: each record is the median over its launches of each
launch's median step, with the load average (1 min) seen at each launch's start and rank 0's gradient
and parameter bytes at the step's peak and at rest (trainer/held.py). The ratio column compares each record
with the first one (ratio_vs_first: the first one's time over this one's; step_time_vs_first: the inverse).
"""

from __future__ import annotations

import argparse
import os
import statistics

from hybridpar.bench import emit, layout_config
from hybridpar.config import Config
from hybridpar.topology.spawn import run_ranks

# --precisions: (train.precision, train.bf16_weights) of each
PRECISIONS = {"fp32": ("fp32", "autocast"), "bf16": ("bf16", "autocast"), "copies": ("bf16", "copies")}


def _worker(cfg_dict: dict, steps: int) -> tuple[float, dict]:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    trainer = Trainer(cfg, build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s))
    times = [trainer.step(s)["step_time_s"] for s in range(steps)]
    return statistics.median(times[2:]), dict(trainer.memory)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench step_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layouts", default="2x2x1,1x2x2,1x4x1,2x1x2,1x1x1")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--zero", default="0", help="ZeRO levels to run each layout under, comma-separated")
    ap.add_argument("--regather", default="microbatch", help="ZeRO-3's parallel.zero3_regather modes, comma-separated")
    ap.add_argument("--precisions", default="fp32", help="of fp32, bf16 (autocast), copies; comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="launches of each case, alternating")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    modes, precisions = a.regather.split(","), a.precisions.split(",")
    if not set(precisions) <= set(PRECISIONS):
        ap.error(f"--precisions takes {', '.join(PRECISIONS)}, comma-separated, got {a.precisions!r}")
    cases = [
        (layout, int(z), mode, prec)
        for layout in a.layouts.split(",")
        for z in a.zero.split(",")
        for mode in (modes if int(z) == 3 else modes[:1])
        for prec in precisions
    ]
    runs: dict[tuple[str, int, str, str], list[tuple[float, dict, float]]] = {c: [] for c in cases}
    for _ in range(a.repeats):
        for layout, zero, mode, prec in cases:
            cfg = layout_config(layout)
            cfg.train.microbatches, cfg.parallel.zero, cfg.parallel.zero3_regather = a.microbatches, zero, mode
            cfg.train.precision, cfg.train.bf16_weights = PRECISIONS[prec]
            load = os.getloadavg()[0]
            t, held = run_ranks(_worker, cfg.parallel.world_size, cfg.to_dict(), a.steps, timeout_s=600)[0]
            runs[(layout, zero, mode, prec)].append((t, held, load))
    records = []
    for (layout, zero, mode, prec), got in runs.items():
        cfg = layout_config(layout)
        t = statistics.median(x[0] for x in got)
        records.append(
            {
                "tp": cfg.parallel.tp,
                "pp": cfg.parallel.pp,
                "dp": cfg.parallel.dp,
                "zero": zero,
                "zero3_regather": mode if zero == 3 else None,
                "precision": prec,
                "microbatches": a.microbatches,
                "step_time_s": t,
                "launches_s": [x[0] for x in got],
                "load_avg_1m": [x[2] for x in got],
                "tokens_per_s": cfg.train.global_batch * cfg.train.seq_len / t,
                "grads_bytes": got[-1][1]["grads"],
                "grads_at_rest_bytes": got[-1][1]["grads_at_rest"],
                "params_bytes": got[-1][1]["params"],
                "params_at_rest_bytes": got[-1][1]["params_at_rest"],
                "optimizer_bytes": got[-1][1]["optimizer"],
            }
        )
    for r in records:
        r["ratio_vs_first"] = records[0]["step_time_s"] / r["step_time_s"]
        r["step_time_vs_first"] = r["step_time_s"] / records[0]["step_time_s"]
    emit(records, a.json)
    return 0

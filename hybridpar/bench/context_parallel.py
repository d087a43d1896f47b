"""Context parallelism (`parallel.cp`): activation peak per rank and step time against cp = 1, with the
memory model's prediction and the loss beside each (JSON).

    .venv/bin/hybridpar bench context_parallel [--cps 1,2,4] [--memory-seq-len 1024] [--time-seq-len 2048]
                                               [--sp-tp 2] [--rounds 3] [--steps 3] [--json FILE]

Memory: one launch per cp at --memory-seq-len, each rank a trainer of the default model (one sample per
step, so the peak is one sample's activations); the activation meter's peak (max over ranks,
pipeline/activation_meter.py) over cp = 1's, the memory model's prediction for the same configuration
(plan/memory_model.py) and their ratio, and the step losses, which must agree with cp = 1's (the layouts
train the same model); with --sp-tp T, each cp > 1 again at tp = T with sequence parallelism (cp x T ranks:
each cp rank's tokens cut over tp in the norm and residual regions). Time: at --time-seq-len, launches of cp
= 1 and of the largest other cp alternate for --rounds rounds, each timing --steps steps after one warm-up
step; the median step time per cp and the median of the per-round ratios, and the CPU seconds per step
summed over ranks (the work done, which a loaded machine's waits for a core do not inflate). Each rank runs
one thread (topology/spawn.py): cp ranks are cp cores, so the ratio shows what splitting a sequence over
more cores gains after the ring's traffic, which overlaps each block's compute. The load average is taken
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from hybridpar.bench import emit
from hybridpar.config import Config
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.topology.spawn import run_ranks


def bench_config(cp: int, seq_len: int, steps: int, sp_tp: int = 1) -> Config:
    """The default model, one rank per cp, one sample per step (one microbatch); with `sp_tp` > 1, tp of
    that size with sequence parallelism inside each cp rank (cp x tp ranks)."""
    cfg = Config()
    p, t = cfg.parallel, cfg.train
    p.tp, p.pp, p.dp, p.cp = sp_tp, 1, 1, cp
    p.sequence_parallel = sp_tp > 1
    t.seq_len, t.global_batch, t.microbatches, t.steps = seq_len, 1, 1, steps
    t.warmup_steps, t.val_every, t.monitor_every, t.sample_tokens = 1, 0, 0, 0
    cfg.data.max_tokens = 400_000
    validate_config(cfg, cp * sp_tp)
    return cfg


def _worker(cfg_dict: dict) -> dict:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    trainer = Trainer(cfg, build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s, p.cp))
    recs, cpu = [], []
    for s in range(cfg.train.steps):
        c0 = time.process_time()
        recs.append(trainer.step(s))
        cpu.append(time.process_time() - c0)
    return {
        "cpu_s": cpu[1:],
        "losses": [r["loss"] for r in recs],
        "step_times_s": [r["step_time_s"] for r in recs[1:]],  # the first step warms up
        "activation_peak_bytes": max(r["activation_peak_bytes"] for r in recs),
    }


def _launch(cfg: Config) -> dict:
    """Rank 0's record, with the CPU seconds per step summed over the ranks (median over steps)."""
    ranks = run_ranks(_worker, cfg.parallel.world_size, cfg.to_dict(), timeout_s=1800)
    return {**ranks[0], "cpu_s": sum(statistics.median(r["cpu_s"]) for r in ranks)}


def memory_records(cps: list[int], seq_len: int, steps: int, sp_tp: int = 1) -> list[dict]:
    """One record per cp of `cps` (the first cp = 1, the baseline), then, with `sp_tp` > 1, one per cp > 1
    of `cps` at tp = sp_tp with sequence parallelism."""
    from hybridpar.plan.memory_model import rank_memory

    out: list[dict] = []
    for cp, tp in [(c, 1) for c in cps] + [(c, sp_tp) for c in cps if c > 1 and sp_tp > 1]:
        cfg = bench_config(cp, seq_len, steps, tp)
        got = _launch(cfg)
        predicted = max(e.activations for e in rank_memory(cfg))
        rec = {"cp": cp, "tp": tp, "sequence_parallel": tp > 1, "seq_len": seq_len}
        rec["activation_peak_bytes"] = got["activation_peak_bytes"]
        rec.update(model_activation_bytes=predicted, model_vs_measured=predicted / got["activation_peak_bytes"])
        rec["losses"] = got["losses"]
        if out:
            base = out[0]
            rec["peak_vs_cp1"] = got["activation_peak_bytes"] / base["activation_peak_bytes"]
            rec["max_loss_difference_vs_cp1"] = max(abs(a - b) for a, b in zip(got["losses"], base["losses"]))
        out.append(rec)
        print(json.dumps(rec), file=sys.stderr)
    return out


def time_record(cp: int, seq_len: int, steps: int, rounds: int) -> dict:
    times: dict[int, list[float]] = {1: [], cp: []}
    cpu: dict[int, list[float]] = {1: [], cp: []}
    ratios = []
    for r in range(rounds):
        block = {}
        for c in (1, cp) if r % 2 == 0 else (cp, 1):  # alternate which goes first
            got = _launch(bench_config(c, seq_len, steps + 1))
            block[c] = statistics.median(got["step_times_s"])
            times[c] += [block[c]]
            cpu[c] += [got["cpu_s"]]
        ratios.append(block[cp] / block[1])
    return {
        "seq_len": seq_len,
        "cp": cp,
        "rounds": rounds,
        "steps_per_launch": steps,
        "median_step_time_s": {f"cp{c}": statistics.median(v) for c, v in times.items()},
        "step_time_vs_cp1": statistics.median(ratios),
        "step_time_vs_cp1_spread": [min(ratios), max(ratios)],
        # CPU seconds per step summed over the ranks: the work each does, whatever the machine's load
        "cpu_s_per_step": {f"cp{c}": statistics.median(v) for c, v in cpu.items()},
        "cpu_time_vs_cp1": statistics.median(cpu[cp]) / statistics.median(cpu[1]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench context_parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cps", default="1,2,4", help="cp sizes of the memory measurement; 1 first (the baseline)")
    ap.add_argument("--memory-seq-len", type=int, default=1024)
    ap.add_argument("--time-seq-len", type=int, default=2048)
    ap.add_argument("--sp-tp", type=int, default=1, help="also each cp > 1 at this tp with SP")
    ap.add_argument("--time-cp", type=int, default=2, help="the cp timed against cp = 1 (0: no timing)")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds (one launch per cp each)")
    ap.add_argument("--steps", type=int, default=3, help="steps per launch (timing: after one warm-up step)")
    ap.add_argument("--json", default=None, help="also write the result to FILE")
    a = ap.parse_args(argv)
    cps = [int(c) for c in a.cps.split(",")]
    if cps[0] != 1:
        print("hybridpar bench context_parallel: --cps must start with 1 (the baseline)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    result: dict = {"model": "default (128d, 4 layers, 4 heads)", "load_average_before": load_before}
    result["memory"] = memory_records(cps, a.memory_seq_len, a.steps, a.sp_tp)
    if a.time_cp > 1:
        result["time"] = time_record(a.time_cp, a.time_seq_len, a.steps, a.rounds)
    result["load_average_after"] = os.getloadavg()
    emit(result, a.json)
    return 0

"""`hybridpar bench memory_accuracy`: what each rank holds, measured, beside the analytic memory model.

For the default model, a larger one, the default with grouped-query attention (`gqa`) and the default as GPT-2
(`gpt2`), at tp2 x pp2 and dp2 x pp2 (and tp2 x pp2 with sequence parallelism, `--layouts tp2xpp2-sp`; with
context parallelism too, `--layouts cp2xtp2-sp` or `cp2xtp2xpp2-sp`; or dp4 alone, `--layouts dp4`), over
precision (fp32, bf16; `copies`: bf16 working copies, train.bf16_weights) x ZeRO (0, 1; `--zero` picks any of
0-3) x activation recomputation (none, full, selective), a short run counts per rank, from the tensors it holds
(trainer/held.py): parameters, gradients, optimizer state, activations (the meter's peak of what autograd saves)
and communication buffers; and the step time (the last step's, past the first step's allocations). Beside each
figure: `rank_memory` of plan/memory_model.py, computed from the configuration alone, and its relative error;
`max_rel_error` is the largest over every component of every rank of every case (the acceptance: at most 0.10).
Under ZeRO-3 `params` is the step's peak: the rank's slices plus the most whole parameters it had gathered at
once. ZeRO needs dp > 1: at dp = 1 it would shard nothing and is not run (listed under `skipped`). One launch
per layout runs all its cases.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from hybridpar.bench import emit
from hybridpar.config import Config
from hybridpar.pipeline.schedules import schedule_names
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.topology.spawn import run_ranks

LAYOUTS = {
    "tp2xpp2": dict(tp=2, pp=2, dp=1),
    "dp2xpp2": dict(tp=1, pp=2, dp=2),
    "tp2xpp2-sp": dict(tp=2, pp=2, dp=1, sequence_parallel=True),  # sequence parallelism (model/tp.py)
    "dp4": dict(tp=1, pp=1, dp=4),  # ZeRO's slices at a quarter
    # context parallelism with sequence parallelism: each cp rank's chunks cut again over tp (ring attention)
    "cp2xtp2-sp": dict(tp=2, pp=1, dp=1, cp=2, sequence_parallel=True),
    "cp2xtp2xpp2-sp": dict(tp=2, pp=2, dp=1, cp=2, sequence_parallel=True),
}
MODELS = {
    "default": dict(model={}, train={}),
    "larger": dict(model=dict(dim=256, n_layers=8, n_heads=8, ffn_dim=704), train=dict(seq_len=256, global_batch=8)),
    "gqa": dict(model=dict(n_kv_heads=2), train={}),  # the default with grouped-query attention (2 kv heads)
    # The default model's shapes as GPT-2 (LayerNorm with biases, learned positions, tied embeddings)
    "gpt2": dict(model=dict(family="gpt2", n_kv_heads=None), train={}),
}
COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers")


def case_config(
    model: str,
    layout: str,
    precision: str,
    zero: int,
    recompute: str,
    steps: int,
    schedule: str = "1f1b",
    p2p: str = "auto",
) -> Config:
    cfg = Config()
    for k, v in {**MODELS[model]["model"]}.items():
        setattr(cfg.model, k, v)
    weights = "copies" if precision == "copies" else "autocast"
    precision = "bf16" if precision == "copies" else precision
    run = {"precision": precision, "bf16_weights": weights, "recompute": recompute, "steps": steps}
    for k, v in {**MODELS[model]["train"], **run}.items():
        setattr(cfg.train, k, v)
    for k, v in {**LAYOUTS[layout], "zero": zero, "schedule": schedule, "p2p": p2p}.items():
        setattr(cfg.parallel, k, v)
    # At most a sample per microbatch: the larger model's 8 samples at dp4 are 2 per replica.
    cfg.train.microbatches = min(cfg.train.microbatches, cfg.train.global_batch // cfg.parallel.dp)
    cfg.data.max_tokens = 2_000_000
    validate_config(cfg)  # before any launch: a bad combination is named, not found by a rank
    return cfg


def cases(
    models: list[str],
    layouts: list[str],
    steps: int,
    schedule: str = "1f1b",
    zeros: tuple[int, ...] = (0, 1),
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    p2p: str = "auto",
) -> tuple[dict[str, list[dict]], list[str]]:
    """Config dicts per layout, and the combinations not run (with why)."""
    runs: dict[str, list[dict]] = {lay: [] for lay in layouts}
    skipped = []
    for lay in layouts:
        for model in models:
            for precision in precisions:
                for zero in zeros:
                    for recompute in ("none", "full", "selective"):
                        name = f"{model} {lay} {precision} zero={zero} recompute={recompute}"
                        if zero and LAYOUTS[lay]["dp"] == 1:
                            skipped.append(f"{name}: ZeRO-{zero} shards over dp, and dp=1 here")
                            continue
                        cfg = case_config(model, lay, precision, zero, recompute, steps, schedule, p2p)
                        runs[lay].append({"name": name, "config": cfg.to_dict()})
    return runs, skipped


def _worker(runs: list[dict], steps: int) -> list[dict[str, Any]]:
    import torch

    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    torch.set_num_threads(1)
    first = Config.from_dict(runs[0]["config"]).parallel
    topo = build_topology(first.dp, first.pp, first.tp, "gloo", first.timeout_s, first.cp)
    out = []
    for run in runs:
        tr = Trainer(Config.from_dict(run["config"]), topo)
        times = []
        for s in range(steps):
            t0 = time.perf_counter()
            tr.step(s)
            times.append(time.perf_counter() - t0)
        tr.p2p.close()
        coords = dict(rank=topo.rank, pp=topo.pp_rank, tp=topo.tp_rank, dp=topo.dp_rank, cp=topo.cp_rank)
        out.append({**coords, "step_time_s": times[-1], "measured": dict(tr.memory)})
    return out


def compare(cfg: Config, ranks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
    """Each rank's measurement beside the model's estimate for its pipeline rank; the largest error."""
    from hybridpar.plan.memory_model import rank_memory

    est = rank_memory(cfg)
    rows, worst = [], 0.0
    for r in ranks:
        e = est[r["pp"]]
        model = {k: getattr(e, k) for k in COMPONENTS}
        err = {k: _rel(model[k], r["measured"][k]) for k in COMPONENTS}
        worst = max([worst, *err.values()])
        rows.append({**r, "model": model, "rel_error": err})
    return rows, worst


def _rel(model: int, measured: int) -> float:
    if measured == 0:
        return 0.0 if model == 0 else float("inf")
    return abs(model - measured) / measured


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hybridpar bench memory_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default,larger", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--layouts", default="tp2xpp2,dp2xpp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--schedule", default="1f1b", choices=schedule_names(), help="pipeline schedule of every case")
    ap.add_argument("--zero", default="0,1", help="ZeRO levels, comma-separated, of 0-3")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated, of fp32, bf16, copies")
    ap.add_argument(
        "--p2p",
        default="auto",
        choices=("auto", "process_group", "shared_memory"),
        help="pipeline message transport (process_group: as on GPUs, messages in receive buffers of their own)",
    )
    ap.add_argument("--steps", type=int, default=2, help="training steps per case (>= 1; the last is reported)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per layout's launch")
    ap.add_argument("--json", default=None, help="write the results to FILE ('-' or none: stdout)")
    a = ap.parse_args(argv)
    bad = [m for m in a.models.split(",") if m not in MODELS] + [x for x in a.layouts.split(",") if x not in LAYOUTS]
    if bad:
        ap.error(f"unknown model or layout {', '.join(bad)}: models are {list(MODELS)}, layouts {list(LAYOUTS)}")
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    if not set(a.zero.split(",")) <= {"0", "1", "2", "3"}:
        ap.error(f"--zero takes levels of 0, 1, 2, 3, comma-separated, got {a.zero!r}")
    if not set(a.precisions.split(",")) <= {"fp32", "bf16", "copies"}:
        ap.error(f"--precisions takes fp32, bf16 and/or copies, comma-separated, got {a.precisions!r}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    zeros, precisions = tuple(int(z) for z in a.zero.split(",")), tuple(a.precisions.split(","))
    runs, skipped = cases(a.models.split(","), a.layouts.split(","), a.steps, a.schedule, zeros, precisions, a.p2p)
    results, worst = [], 0.0
    load_before = os.getloadavg()
    for lay, todo in runs.items():
        world = LAYOUTS[lay]["tp"] * LAYOUTS[lay]["pp"] * LAYOUTS[lay]["dp"] * LAYOUTS[lay].get("cp", 1)
        per_rank = run_ranks(_worker, world, todo, a.steps, timeout_s=a.timeout)
        for i, run in enumerate(todo):
            rows, err = compare(Config.from_dict(run["config"]), [r[i] for r in per_rank])
            worst = max(worst, err)
            step = max(r["step_time_s"] for r in rows)
            results.append({"case": run["name"], "step_time_s": step, "max_rel_error": err, "ranks": rows})
            print(f"{run['name']}: step {step:.2f} s, max relative error {err:.4f}", file=sys.stderr)
    out = {
        "bench": "memory_accuracy",
        "max_rel_error": worst,
        "steps": a.steps,
        "schedule": a.schedule,
        "p2p": a.p2p,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "models": MODELS,
        "skipped": skipped,
        "cases": results,
    }
    emit(out, a.json, echo=a.json in (None, "-"))
    return 0 if worst <= 0.10 else 1

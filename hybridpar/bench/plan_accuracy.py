"""`hybridpar bench plan_accuracy`: the planner's predicted step times against real training steps, on this machine.

    hybridpar bench plan_accuracy [--rounds 3] [--steps 5] [--warmup 2] [--cpu-bind auto] [--json FILE]

Each round runs every swept layout of the default model once — freshly launched ranks that probe the
machine (plan/probe.py's measurements), build a real `Trainer`, run `--warmup` steps and then `--steps`
timed ones (the step time the trainer records), and probe again — in an order rotated every round, so
drift of a shared machine hits every layout alike. Each launch's prediction comes from its own two
probes, taken in the same processes just before and after its steps (the cost model on the simulator,
plan/cost.py; nothing fitted to the steps): on a machine shared with other jobs the cores the ranks
get change from minute to minute, and a probe minutes away would describe another machine. Reported per
layout: medians over rounds of the measured and of the predicted step time, their error; overall:
`median_abs_error` (median of |predicted / measured - 1|, a fraction), `top_pick_over_best` (per world,
the measured throughput of the layout the planner ranks first among those swept over the best measured
one; the smaller of the two worlds), the load average. The swept set is a spread of layouts chosen by
hand plus the planner's own top pick at each world. Every launch binds its ranks to cores as
`--parallel.auto` would run the layout (`Hardware.fills_cores`, plan/hardware.py): where the ranks take
all the cores, a stage's ranks on different cores (topology/cpus.py), else left to the OS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from hybridpar.bench import emit
from hybridpar.config import Config
from hybridpar.config.sections import CPU_BINDINGS
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.plan.cost import CostModel
from hybridpar.plan.hardware import to_toml
from hybridpar.plan.probe import describe
from hybridpar.plan.step import predict
from hybridpar.topology.spawn import run_ranks

# Each probe window (seconds). Under foreign load a short window flatters: a rank that has just slept at a
# barrier gets the scheduler's sleeper credit for a while, which ranks computing through a step do not.
PROBE_S = 0.8
# (tp, pp, dp, schedule, microbatches)
LAYOUTS_4 = [
    (2, 2, 1, "1f1b", 4),
    (2, 2, 1, "gpipe", 8),
    (1, 4, 1, "1f1b", 4),
    (1, 4, 1, "1f1b", 8),
    (1, 4, 1, "zb-h1", 8),
    (1, 2, 2, "interleaved-1f1b", 4),
    (1, 2, 2, "1f1b", 4),
    (1, 2, 2, "zb-v", 4),
    (2, 1, 2, "1f1b", 2),
    (1, 1, 4, "1f1b", 2),
    (4, 1, 1, "1f1b", 4),
    (2, 2, 1, "zb-v", 8),
]
LAYOUTS_2 = [
    (1, 2, 1, "1f1b", 4),
    (1, 2, 1, "gpipe", 8),
    (2, 1, 1, "1f1b", 2),
    (1, 1, 2, "1f1b", 2),
    (1, 2, 1, "zb-v", 4),
]


def layout_config(tp: int, pp: int, dp: int, schedule: str, m: int, cpu_bind: str = "none") -> Config:
    cfg = Config()
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.schedule, p.cpu_bind = tp, pp, dp, schedule, cpu_bind
    cfg.train.microbatches = m
    cfg.train.val_every = cfg.train.monitor_every = 0
    validate_config(cfg, tp * pp * dp)
    return cfg


def _worker(cfg_dict: dict, steps: int) -> dict[str, Any]:
    """Probe, train, probe again, in the same processes: the probe sees the machine as the steps do."""
    from hybridpar.plan.probe import measure
    from hybridpar.topology.cpus import bind_local_rank
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    bind_local_rank(p.cpu_bind, layout=p.layout)  # as `hybridpar train` does, before any thread starts
    topo = build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s)
    # The layer times at this layout's shape (plan/calibrate.py), timed alongside the rest of the probe.
    shape = [(p.tp, cfg.train.global_batch // p.dp // cfg.train.microbatches)]
    probe = lambda: measure(PROBE_S, 20, cfg.model, cfg.train.seq_len, shape)  # noqa: E731
    before = probe()
    tr = Trainer(cfg, topo)
    recs = [tr.step(s) for s in range(steps)]
    # The busiest rank's compute and waits of each step (report/records.py): where a step's time went.
    busiest = [max(range(len(r["ranks"]["compute_s"])), key=r["ranks"]["compute_s"].__getitem__) for r in recs]
    return {
        "times": [r["step_time_s"] for r in recs],
        "compute": [r["ranks"]["compute_s"][i] for r, i in zip(recs, busiest)],
        "wait": [r["ranks"]["wait_s"][i] for r, i in zip(recs, busiest)],
        "probe": [before, probe()],
    }


def key(layout: tuple) -> str:
    tp, pp, dp, schedule, m = layout
    return f"tp{tp}-pp{pp}-dp{dp}-{schedule}-m{m}"


def main(argv: list[str] | None = None) -> int:
    from hybridpar.plan.calibrate import shapes_for
    from hybridpar.plan.main import default_memory
    from hybridpar.plan.probe import probe
    from hybridpar.plan.search import plan

    ap = argparse.ArgumentParser(prog="hybridpar bench plan_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--json", default=None, help="write the result here ('-' or none: stdout)")
    ap.add_argument(
        "--cpu-bind",
        default="auto",
        choices=("auto", *CPU_BINDINGS),
        help="the ranks' cores in every launch, probes included (--parallel.cpu_bind); auto: as "
        "--parallel.auto runs them, bound where the ranks take all the cores",
    )
    a = ap.parse_args(argv)
    t0, load_before = time.time(), os.getloadavg()
    worlds = {4: list(LAYOUTS_4), 2: list(LAYOUTS_2)}
    binding: dict[int, str] = {}
    for w, layouts in worlds.items():  # the planner's own top pick (on a probe of this machine) joins the sweep
        base = Config()
        hw = probe(
            w, model=base.model, seq_len=base.train.seq_len, shapes=shapes_for(base.model, base.train.global_batch, w)
        )
        binding[w] = a.cpu_bind if a.cpu_bind != "auto" else "cores" if hw.fills_cores(w) else "none"
        c = plan(base, hw, default_memory(), world=w, top=1).candidates[0]
        p, t = c.cfg.parallel, c.cfg.train
        if t.recompute == "none" and t.precision == "fp32" and p.zero == 0 and p.partition == "params":
            pick = (p.tp, p.pp, p.dp, p.schedule, t.microbatches)
            if pick not in layouts and p.virtual_stages in (None, 2):  # the sweep runs the default v
                layouts.append(pick)
    everything = [lay for w in worlds for lay in worlds[w]]
    measured: dict[str, list[float]] = {key(lay): [] for lay in everything}
    predicted: dict[str, list[float]] = {key(lay): [] for lay in everything}
    probes: list[dict[str, Any]] = []
    busiest: dict[str, list[dict[str, float]]] = {key(lay): [] for lay in everything}  # where each step went
    loads: list[float] = []

    def meta(rounds: int) -> dict[str, Any]:
        return {
            "rounds": rounds,
            "cpu_bind": {str(w): b for w, b in binding.items()},
            "steps": a.steps,
            "warmup": a.warmup,
            "load_average_before": load_before,
            "load_average_during": {"median": statistics.median(loads), "min": min(loads), "max": max(loads)},
            "load_average_after": os.getloadavg(),
            "cpus": os.cpu_count(),
            "busiest_rank": busiest,  # per layout and round: the busiest rank's compute and wait, medians
            "probes": probes,
            "wall_s": time.time() - t0,
        }

    for r in range(a.rounds):
        order = everything[r % len(everything) :] + everything[: r % len(everything)]
        for lay in order:
            world = lay[0] * lay[1] * lay[2]
            cfg = layout_config(*lay, binding[world])
            got = run_ranks(_worker, world, cfg.to_dict(), a.warmup + a.steps, timeout_s=900)[0]
            hw = describe(got["probe"], world)
            probes.append({"round": r, "layout": key(lay), "hardware": to_toml(hw)})
            pred = predict(CostModel(cfg.model, hw), cfg)
            predicted[key(lay)].append(pred.step_s)
            measured[key(lay)].append(statistics.median(got["times"][a.warmup :]))
            busiest[key(lay)].append({k: statistics.median(got[k][a.warmup :]) for k in ("compute", "wait")})
            loads.append(os.getloadavg()[0])
            got_b = busiest[key(lay)][-1]
            print(
                f"round {r} {key(lay)}: measured {measured[key(lay)][-1]:.4f} s, predicted "
                f"{predicted[key(lay)][-1]:.4f} s, load {loads[-1]:.2f} (probe: {hw.peak_flops('fp32') / 1e9:.1f} "
                f"GFLOP/s, {hw.cores_per_node:.2f} cores, collective {hw.collective_latency_us:.0f} us); busiest rank "
                f"compute {got_b['compute']:.4f} s (predicted {pred.compute_s:.4f}), wait {got_b['wait']:.4f} s "
                f"(predicted step - compute {pred.step_s - pred.compute_s:.4f})",
                file=sys.stderr,
            )
        write(summarize(everything, measured, predicted) | meta(r + 1), a.json)
    return 0


def summarize(everything: list[tuple], measured: dict, predicted: dict) -> dict[str, Any]:
    """Per-layout medians over the rounds so far, their errors, and each world's top pick against its best."""
    rows = []
    for lay in everything:
        k = key(lay)
        meas, pred = statistics.median(measured[k]), statistics.median(predicted[k])
        rows.append(
            {
                "layout": k,
                "world": lay[0] * lay[1] * lay[2],
                "measured_step_s": meas,
                "predicted_step_s": pred,
                "error": pred / meas - 1,
                "measured_rounds": measured[k],
                "predicted_rounds": predicted[k],
            }
        )
    ratios = {}
    for w in sorted({row["world"] for row in rows}):
        mine = [row for row in rows if row["world"] == w]
        pick = min(mine, key=lambda row: row["predicted_step_s"])
        best = min(mine, key=lambda row: row["measured_step_s"])
        ratios[str(w)] = {
            "top_pick": pick["layout"],
            "best_measured": best["layout"],
            "ratio": best["measured_step_s"] / pick["measured_step_s"],
        }
    return {
        "median_abs_error": statistics.median(abs(row["error"]) for row in rows),
        "top_pick_over_best": min(v["ratio"] for v in ratios.values()),
        "per_world": ratios,
        "layouts": rows,
    }


def write(out: dict[str, Any], path: str | None) -> None:
    emit(out, path, echo=path in (None, "-"))
    print(
        f"after {out['rounds']} round(s): median_abs_error {out['median_abs_error']:.3f}, "
        f"top_pick_over_best {out['top_pick_over_best']:.3f}",
        file=sys.stderr,
    )

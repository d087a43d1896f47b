"""`hybridpar bench balance`: throughput under emulated slow ranks and links, static layout vs live load
balancing, against the capacity bound — in one invocation, on the real trainer.

Layouts and slowdowns: bench/balance_cases.py (pp4 under 1f1b, interleaved, zb-h1 and zb-v, dp4, dp2xpp2;
one slow rank, two, a spike, a drift, a clean run, a slow link). For each (layout, slowdown) the baseline
(`--balance.mode off`; slow_link: fixed microbatches) and the contender (`--balance.mode auto`; slow_link:
the adaptive microbatch policy too) run `--repeats` times, alternating baseline and contender so that a
change of the machine's load hits both alike; every figure is a median over the repeats, and each repeat's
figures are kept beside it; each repeat also runs the capacity bound's clean run (the layout with no
slowdown and no balancer) just before its pair. Throughput is the median step over the last `--measure`
steps (drift: the whole drift's time against the bound integrated over it). The load average is recorded
before and after every pair.

Modes: `emulated` (`--emulate.layer_ms`, a named benchmark mode, off by default in training: every compute
action lasts a fixed time per layer and sample, the real compute inside it, so 4 ranks sharing 2 loaded
cores keep the emulated speeds — the acceptance figures) and
`compute` (the real blocks, reported beside; on a shared machine it measures the neighbours too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hybridpar.bench import runs_dir
from hybridpar.bench.balance_alternate import alternate_figures, measure_worker
from hybridpar.bench.balance_cases import (
    ACCEPTANCE,
    ACCEPTANCE_DEFAULTS,
    CASES,
    LAYOUTS,
    ONSET,
    analytic_step,
    case_config,
    figures,
    slow_factors,
)
from hybridpar.config import BalanceConfig, Config


def _worker(cfg_dict: dict) -> int:
    from hybridpar.run.train import train

    train(Config.from_dict(cfg_dict), log=False)
    return 0


ALTERNATING = ("one", "two", "spike")  # measured in one launch each (bench/balance_alternate.py)


def run(cfg: Config, run_dir: Path) -> list[dict[str, Any]]:
    """Train `cfg` on fresh processes in `run_dir` (kept, for `hybridpar report`); rank 0's metrics.jsonl rows."""
    from hybridpar.topology.spawn import run_ranks

    cfg.run_dir = str(run_dir)
    run_ranks(_worker, cfg.parallel.world_size, cfg.to_dict(), timeout_s=1200)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_alternating(cfg: Config, case: str, a: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One launch of bench/balance_alternate.py: its figures against the bound the launch measured."""
    from hybridpar.topology.spawn import run_ranks

    cfg.run_dir = str(run_dir)
    world = cfg.parallel.world_size
    res = run_ranks(measure_worker, world, cfg.to_dict(), a.steps, a.rounds, a.block, timeout_s=1800)[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "alternating.json").write_text(json.dumps(res, indent=1) + "\n")
    speeds = world if case == "spike" else world - sum(1.0 - 1.0 / f for f in slow_factors(case, 0).values())
    return alternate_figures(res, speeds, world, ONSET, analytic_step(cfg, world) if cfg.emulate.layer_ms > 0 else None)


def run_pair(layout: str, case: str, mode: str, a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """Every repeat of (baseline, contender) of one layout and slowdown, alternating; medians over them."""
    load_before, t0 = os.getloadavg(), time.perf_counter()
    reps: list[dict[str, Any]] = []
    repeats = a.clean_repeats if case == "clean" and a.clean_repeats else a.repeats
    for r in range(repeats):
        tag = f"{mode}-{layout}-{case}-{r}"
        cont_cfg = case_config(layout, case, mode, a, True)
        if case in ALTERNATING:  # one launch: balancing, then balanced / static / clean blocks in turn
            reps.append(run_alternating(cont_cfg, case, a, runs / f"{tag}-alternating"))
            continue
        if case == "clean":  # one run: the balancer on a clean machine
            rows = run(cont_cfg, runs / f"{tag}-balanced")
            reps.append(figures(cont_cfg, case, rows, rows, a))
            continue
        # The clean step of the bound, measured beside the pair (slow_link has no bound: ratio to static).
        bound = (
            None if case == "slow_link" else run(case_config(layout, "bound", mode, a, False), runs / f"{tag}-bound")
        )
        skip_static = case == "drift" and not a.drift_static  # its figure is against the bound
        base = None if skip_static else run(case_config(layout, case, mode, a, False), runs / f"{tag}-static")
        cont = run(cont_cfg, runs / f"{tag}-balanced")
        reps.append(figures(cont_cfg, case, base, cont, a, bound))
    med = summarise(case, reps)
    cfg = case_config(layout, case, mode, a, True)
    e = cfg.emulate
    return {
        "layout": layout,
        "case": case,
        "mode": mode,
        "schedule": cfg.parallel.schedule,
        "emulation": {
            k: getattr(e, k) for k in ("slowdown", "spike", "drift", "slow_link", "layer_ms") if getattr(e, k)
        },
        "median": med,
        "repeats": reps,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.perf_counter() - t0,
    }


def summarise(case: str, reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over the repeats of every figure numeric in any of them; a launch that never moved
    counts as never for steps_to_rebalance (None when that is the median), and launches_rebalanced says
    how many did. Drift: the worst repeat's direction changes and the shortest gap between two moves."""
    numeric = {k for x in reps for k, v in x.items() if k != "direction_changes" and _number(v)}
    med = {k: statistics.median(x[k] for x in reps if x.get(k) is not None) for k in sorted(numeric)}
    if "steps_to_rebalance" in reps[0]:
        steps = [x["steps_to_rebalance"] for x in reps]
        never = statistics.median(math.inf if x is None else x for x in steps)
        med["steps_to_rebalance"] = None if math.isinf(never) else never
        med["launches_rebalanced"] = sum(x is not None for x in steps)
    if case == "drift":  # oscillation is judged on the worst repeat, not the median
        med["direction_changes_max"] = max(x["direction_changes"] for x in reps)
        gaps = [x["min_move_gap"] for x in reps if x["min_move_gap"] is not None]
        med["min_move_gap_min"] = min(gaps, default=None)
    return med


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hybridpar bench balance", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--acceptance",
        action="store_true",
        help="the issue's whole acceptance set in one invocation (bench/balance_cases.py ACCEPTANCE: emulated, "
        "one slow under every layout, two slow, spike, drift, clean under every layout, slow link; compute "
        "mode, one slow at pp4-1f1b), sized for about 20 "
        f"minutes on a quiet 2-core machine: defaults {ACCEPTANCE_DEFAULTS} (each still overridable); "
        "--modes, --layouts and --cases are ignored",
    )
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated: {','.join(LAYOUTS)}")
    ap.add_argument("--cases", default="one,two,spike,clean", help=f"comma-separated: {','.join(CASES)}")
    ap.add_argument("--modes", default="emulated", help="comma-separated: emulated,compute")
    ap.add_argument("--repeats", type=int, default=3, help="baseline/contender pairs per case (medians over them)")
    ap.add_argument(
        "--layer-ms",
        type=float,
        default=2.0,
        help="emulated mode: forward ms per layer and sample (backward twice that); large enough that the real "
        "compute of the tiny model stays under it on a loaded machine (at 1.0 and load 30 it did not)",
    )
    ap.add_argument("--link-ms", type=float, default=2.0, help="slow_link: a normal link's emulated ms per message")
    ap.add_argument("--steps", type=int, default=40, help="steps of the one, two, spike and slow_link runs")
    ap.add_argument("--drift-steps", type=int, default=300, help="drift: steps from 1x to 2.5x and back")
    ap.add_argument("--rounds", type=int, default=3, help="one, two, spike: rounds of alternating blocks per launch")
    ap.add_argument("--block", type=int, default=5, help="one, two, spike: measured steps per block")
    ap.add_argument("--measure", type=int, default=10, help="throughput: median over the last N steps")
    ap.add_argument("--clean-steps", type=int, default=200, help="steps of the clean (no slowdown) run")
    ap.add_argument(
        "--min-action-ms",
        type=float,
        default=0.0,
        help="emulated mode: raise a layout's --layer-ms so that its smallest compute action (one chunk x one "
        "microbatch) lasts at least this long (0: off)",
    )
    ap.add_argument("--clean-repeats", type=int, default=0, help="launches of each clean run (0: --repeats)")
    ap.add_argument(
        "--drift-static",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="drift: also run the static layout (its figure, balanced / bound, needs none)",
    )
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument(
        "--runs-dir",
        default=None,
        help="keep every run's directory here, as <mode>-<layout>-<case>-<repeat>-<static|balanced> (`hybridpar "
        "report DIR/emulated-pp4-1f1b-clean-0-balanced` reads one; one, two and spike keep "
        "<...>-alternating/alternating.json); default: runs/bench/balance-<time>",
    )
    if "--acceptance" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(**ACCEPTANCE_DEFAULTS)
    a = ap.parse_args(argv)
    for key, known in (("layouts", LAYOUTS), ("cases", CASES), ("modes", ("emulated", "compute"))):
        for x in getattr(a, key).split(","):
            if x not in known:
                ap.error(f"unknown {key[:-1]} {x!r}; known: {', '.join(known)}")
    if a.steps < 10 + 10 + a.measure:
        ap.error(f"--steps={a.steps} leaves no room: need >= onset 10 + 10 steps to rebalance + --measure={a.measure}")
    if a.rounds < 1 or a.block < 1:
        ap.error(f"--rounds={a.rounds} and --block={a.block} must be >= 1")
    if a.layer_ms <= 0 or a.link_ms <= 0 or a.repeats < 1 or a.clean_steps < 10 or a.drift_steps < 10:
        ap.error("--layer-ms and --link-ms must be > 0, --repeats >= 1, --clean-steps and --drift-steps >= 10")
    if a.min_action_ms < 0 or a.clean_repeats < 0:
        ap.error(f"--min-action-ms={a.min_action_ms} and --clean-repeats={a.clean_repeats} must be >= 0")
    return a


def _line(r: dict[str, Any]) -> str:
    m = r["median"]
    keys = (
        "balanced_over_ideal",
        "static_over_ideal",
        "balanced_over_static",
        "steps_to_rebalance",
        "moves",
        "false_rebalances",
    )
    shown = "  ".join(f"{k} {m[k]:.3f}" if isinstance(m[k], float) else f"{k} {m[k]}" for k in keys if k in m)
    return f"{r['mode']:8s} {r['layout']:16s} {r['case']:9s} {shown}  load {r['load_average_before'][0]:.1f}"


def acceptance(results: list[dict[str, Any]]) -> dict[str, bool]:
    """The issue's acceptance figures, from the emulated runs measured (only what was run)."""
    em = [r for r in results if r["mode"] == "emulated"]
    by = {c: [r["median"] for r in em if r["case"] == c] for c in CASES}
    out = {}
    if by["one"]:
        out["one_slow_balanced_ge_0.95_ideal"] = all(m["balanced_over_ideal"] >= 0.95 for m in by["one"])
        out["one_slow_rebalanced_within_20_steps"] = all((m.get("steps_to_rebalance") or 99) <= 20 for m in by["one"])
    if by["two"]:
        out["two_slow_balanced_ge_0.90_ideal"] = all(m["balanced_over_ideal"] >= 0.90 for m in by["two"])
    if by["drift"]:
        out["drift_balanced_ge_0.90_ideal"] = all(m["balanced_over_ideal"] >= 0.90 for m in by["drift"])
        out["drift_no_oscillation"] = all(m["direction_changes_max"] <= 1 for m in by["drift"])
        interval = BalanceConfig().interval  # the bench runs the default balance settings
        out["drift_at_most_one_move_per_interval"] = all(
            m["min_move_gap_min"] is None or m["min_move_gap_min"] >= interval for m in by["drift"]
        )
    if by["spike"]:
        out["spike_no_moves"] = all(m["moves"] == 0 for m in by["spike"])
    if by["clean"]:
        out["clean_no_rebalance"] = all(m["false_rebalances"] == 0 for m in by["clean"])
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    runs = runs_dir("balance", a.runs_dir)
    print(f"hybridpar bench balance: run directories in {runs}", file=sys.stderr)
    results: list[dict[str, Any]] = []
    start = {"load_average": os.getloadavg(), "time": time.time(), "perf": time.perf_counter()}
    for mode, layout, case in _pairs(a):
        results.append(run_pair(layout, case, mode, a, runs))
        print(_line(results[-1]), file=sys.stderr, flush=True)
        text = _write(a, runs, results, start)  # after every case: a long run interrupted keeps its figures
    print(text)
    return 0


def _pairs(a: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(mode, layout, case) in the order they run: `--acceptance`'s set, else every layout x case."""
    if a.acceptance:
        return list(ACCEPTANCE)
    modes = a.modes.split(",")
    # slow_link's boundary 1:2 needs pipeline ranks 1 and 2
    pairs = [(layout, c) for layout in a.layouts.split(",") for c in a.cases.split(",")]
    return [(m, lay, c) for m in modes for lay, c in pairs if not (c == "slow_link" and LAYOUTS[lay]["pp"] < 4)]


def _write(a: argparse.Namespace, runs: Path, results: list[dict[str, Any]], start: dict[str, Any]) -> str:
    report = {
        "bench": "balance",
        "cpu_count": os.cpu_count(),
        "runs_dir": str(runs),
        "args": vars(a),
        "started_unix_s": start["time"],
        "load_average_start": start["load_average"],
        "load_average_now": os.getloadavg(),
        "wall_s": time.perf_counter() - start["perf"],
        "results": results,
        "acceptance_emulated": acceptance(results),
    }
    text = json.dumps(report, indent=2)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())

"""`hybridpar bench balance`: throughput with one rank 2x slow, static layout vs live load balancing,
against the capacity bound — in one invocation, on the real trainer.

Scenarios (24 layers, global batch 28, one rank emulated 2x slow from step 10 via
`--emulate.slowdown`): pp=4, dp=4, dp=2 x pp=2. Per scenario and mode, three runs:

- static: `--balance.mode off`; the slow rank drags its pipeline / replica.
- balanced: `--balance.mode auto`; steps_to_rebalance = step of the applied decision - slowdown step.
- clean: `--balance.mode auto` with no slowdown for `--clean-steps` steps: every rebalance is false.

Throughput is global_batch x seq_len / median step time over the last `--measure` steps. The ideal is
the continuous capacity bound: total work / summed rank speeds, plus the schedule's bubble — measured,
as the median step of the balanced run before the slowdown x world size / summed speeds (the clean
step already holds the work, the bubble and the per-step overheads of this layout; losing half a
rank's speed can at best stretch it by N / (N - 0.5)). In emulated mode the analytic bound (layer_ms x 3 x
samples x layers / summed
speeds x (m + p - 1) / m) is reported beside it.

Modes: `emulated` (`--emulate.layer_ms`, a named benchmark mode, off by default in training: every
layer costs a fixed sleep per sample, so 4 ranks on 2 cores do not distort speeds — the acceptance
figures) and `compute` (the real blocks, reported beside). The machine's load average is recorded
with every scenario: on a shared machine compute mode measures the neighbours too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hybridpar.bench import runs_dir
from hybridpar.config import Config
from hybridpar.pipeline.schedules import schedule_spec

SLOW_FROM = 10
SLOW_RANK = 2
SCENARIOS: dict[str, dict[str, int]] = {
    "pp4": dict(tp=1, pp=4, dp=1, microbatches=4),
    "dp4": dict(tp=1, pp=1, dp=4, microbatches=1),
    "dp2xpp2": dict(tp=1, pp=2, dp=2, microbatches=4),
}


def scenario_config(name: str, mode: str, layer_ms: float, steps: int, slowdown: bool, balance: str) -> Config:
    s = SCENARIOS[name]
    cfg = Config()
    m, t, p = cfg.model, cfg.train, cfg.parallel
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = 32, 24, 4, 2, 64
    p.tp, p.pp, p.dp, p.schedule, p.partition = s["tp"], s["pp"], s["dp"], "1f1b", "uniform"
    t.steps, t.global_batch, t.microbatches, t.seq_len = steps, 28, s["microbatches"], 16
    t.warmup_steps, t.val_every, t.monitor_every, t.sample_tokens = 2, 0, 0, 0
    cfg.data.max_tokens = 200_000
    cfg.emulate.layer_ms = layer_ms if mode == "emulated" else 0.0
    cfg.emulate.slowdown = f"rank={SLOW_RANK}:2.0@step={SLOW_FROM}" if slowdown else ""
    cfg.balance.mode = balance
    return cfg


def _worker(cfg_dict: dict) -> int:
    from hybridpar.run.train import train

    train(Config.from_dict(cfg_dict), log=False)
    return 0


def run(cfg: Config, run_dir: Path) -> list[dict[str, Any]]:
    """Train `cfg` on fresh processes in `run_dir` (kept, for `hybridpar report`); rank 0's metrics.jsonl rows."""
    from hybridpar.topology.spawn import run_ranks

    cfg.run_dir = str(run_dir)
    run_ranks(_worker, cfg.parallel.world_size, cfg.to_dict(), timeout_s=1200)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "step_time_s" in r]


def _decisions(rows: list[dict]) -> list[dict]:
    return [e for r in rows for e in r.get("balance", []) if e["event"] == "rebalance"]


def _tail_median(rows: list[dict], n: int) -> float:
    return statistics.median(r["step_time_s"] for r in _steps(rows)[-n:])


def run_scenario(name: str, mode: str, a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """The scenario's three runs, each kept in runs/<mode>-<name>-<static|balanced|clean>."""
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    case = f"{mode}-{name}"
    static = run(scenario_config(name, mode, a.layer_ms, a.steps, True, "off"), runs / f"{case}-static")
    balanced = run(scenario_config(name, mode, a.layer_ms, a.steps, True, "auto"), runs / f"{case}-balanced")
    clean_steps = a.clean_steps if mode == "emulated" else a.compute_clean_steps
    clean = run(scenario_config(name, mode, a.layer_ms, clean_steps, False, "auto"), runs / f"{case}-clean")
    cfg = scenario_config(name, mode, a.layer_ms, a.steps, True, "off")
    t, p = cfg.train, cfg.parallel
    tokens = t.global_batch * t.seq_len
    world = p.world_size
    speeds = world - 1 + 0.5  # one rank at half speed
    # The clean step of the same processes, just before the slowdown: no drift of the machine's load
    # between separate runs enters the ratio. The clean run's own median is reported beside it.
    clean_step = statistics.median(r["step_time_s"] for r in _steps(balanced)[cfg.balance.skip_steps : SLOW_FROM])
    clean_run_step = statistics.median(r["step_time_s"] for r in _steps(clean)[cfg.balance.skip_steps :])
    ideal_step = clean_step * world / speeds
    static_step, balanced_step = _tail_median(static, a.measure), _tail_median(balanced, a.measure)
    applied = [d for d in _decisions(balanced) if d["applied"]]
    first = next((d for d in applied if d["step"] >= SLOW_FROM), None)
    out: dict[str, Any] = {
        "scenario": name,
        "mode": mode,
        "layout": f"tp{p.tp} pp{p.pp} dp{p.dp}",
        "slowdown": f"rank={SLOW_RANK}:2.0@step={SLOW_FROM}",
        "ideal_tokens_per_s": tokens / ideal_step,
        "static_tokens_per_s": tokens / static_step,
        "balanced_tokens_per_s": tokens / balanced_step,
        "balanced_over_ideal": ideal_step / balanced_step,
        "static_over_ideal": ideal_step / static_step,
        "balanced_over_static": static_step / balanced_step,
        "steps_to_rebalance": None if first is None else first["step"] - SLOW_FROM,
        "false_rebalances_clean_run": len(_decisions(clean)),
        "clean_run_steps": clean_steps,
        "clean_step_s": clean_step,
        "clean_run_step_s": clean_run_step,
        "ideal_step_s": ideal_step,
        "static_step_s": static_step,
        "balanced_step_s": balanced_step,
        "measured_over_last_steps": a.measure,
        "decisions": [
            {k: d[k] for k in ("step", "kind", "reason", "new", "predicted_step_before_s", "predicted_step_after_s")}
            for d in _decisions(balanced)
        ],
        "clean_run_decisions": [d["reason"] for d in _decisions(clean)],
        "measured_outcomes": [e for r in balanced for e in r.get("balance", []) if e["event"] == "rebalance_measured"],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.perf_counter() - t0,
        "run_dirs": [str(runs / f"{case}-{k}") for k in ("static", "balanced", "clean")],
    }
    if mode == "emulated":
        bubble = 1.0 / (1.0 - schedule_spec(p.schedule).bubble_fraction(p.pp, 1, t.microbatches))  # step / work
        work = a.layer_ms / 1000 * 3 * t.global_batch * cfg.model.n_layers
        out["ideal_analytic_tokens_per_s"] = tokens / (work / speeds * bubble)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hybridpar bench balance", description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: pp4,dp4,dp2xpp2")
    ap.add_argument("--modes", default="emulated,compute", help="comma-separated: emulated,compute")
    ap.add_argument(
        "--layer-ms",
        type=float,
        default=0.5,
        help="emulated mode: forward ms per layer and sample (backward twice that)",
    )
    ap.add_argument("--steps", type=int, default=40, help="steps of the static and balanced runs")
    ap.add_argument("--measure", type=int, default=10, help="throughput: median over the last N steps")
    ap.add_argument("--clean-steps", type=int, default=200, help="steps of the clean (no slowdown) run")
    ap.add_argument(
        "--compute-clean-steps",
        type=int,
        default=60,
        help="steps of the clean run in compute mode (reported, not an acceptance figure)",
    )
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument(
        "--runs-dir",
        default=None,
        help="keep every run's directory here, as <mode>-<scenario>-<static|balanced|clean> (`hybridpar report "
        "DIR/emulated-pp4-balanced` reads one); default: runs/bench/balance-<time>",
    )
    a = ap.parse_args(argv)
    for s in a.scenarios.split(","):
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")
    for m in a.modes.split(","):
        if m not in ("emulated", "compute"):
            ap.error(f"unknown mode {m!r}; known: emulated, compute")
    if a.steps < SLOW_FROM + a.measure + 10:
        ap.error(
            f"--steps={a.steps} leaves no room: need >= slowdown step {SLOW_FROM} + 10 steps to "
            f"rebalance + --measure={a.measure}"
        )
    if a.layer_ms <= 0 or min(a.clean_steps, a.compute_clean_steps) < 10:
        ap.error("--layer-ms must be > 0 and --clean-steps, --compute-clean-steps >= 10")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    runs = runs_dir("balance", a.runs_dir)
    print(f"hybridpar bench balance: run directories in {runs}", file=sys.stderr)
    results = []
    for mode in a.modes.split(","):
        for name in a.scenarios.split(","):
            r = run_scenario(name, mode, a, runs)
            results.append(r)
            print(
                f"{mode:8s} {name:8s} ideal {r['ideal_tokens_per_s']:8.0f} static {r['static_tokens_per_s']:8.0f} "
                f"balanced {r['balanced_tokens_per_s']:8.0f} tok/s  balanced/ideal {r['balanced_over_ideal']:.3f}  "
                f"rebalanced after {r['steps_to_rebalance']} steps  clean-run rebalances "
                f"{r['false_rebalances_clean_run']}  load {r['load_average_before'][0]:.1f}",
                file=sys.stderr,
            )
    emulated = [r for r in results if r["mode"] == "emulated"]
    report = {
        "bench": "balance",
        "cpu_count": os.cpu_count(),
        "runs_dir": str(runs),
        "args": vars(a),
        "results": results,
        "acceptance_emulated": {
            "balanced_ge_0.90_ideal": all(r["balanced_over_ideal"] >= 0.90 for r in emulated),
            "rebalanced_within_20_steps": all(
                r["steps_to_rebalance"] is not None and r["steps_to_rebalance"] <= 20 for r in emulated
            ),
            "no_rebalance_in_clean_runs": all(r["false_rebalances_clean_run"] == 0 for r in emulated),
        }
        if emulated
        else None,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

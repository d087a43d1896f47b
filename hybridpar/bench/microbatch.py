"""`hybridpar bench microbatch`: the adaptive microbatch policy against every fixed split, on the same
model, ranks and global batch, in one launch per layout.

Every valid fixed microbatch count (balanced sizes, unequal where the count does not divide the batch)
is measured in interleaved rounds, so drift of a shared machine hits all of them alike. Then the
adaptive policy runs from a cold start until it settles (its convergence cost: steps, and its
throughput over them against the best fixed split's). Last, its steady state: rounds of blocks
alternate the settled policy with the sweep's two best fixed splits (among those within the memory
budget, when one is given; two, since the sweep's own best moves between runs) and the policy's own
split run fixed, when the sweep did not rank it top two; the order rotates round by round, and the
best of these over the comparison is the best fixed split. A fixed finalist shown more than 5% slower than
the best (its paired interval below 0.95, after `--compare-rounds`) stops running. Each round gives
one paired ratio, adaptive's block median over that split's; `ratio` is their median, `ratio_ci95` its
distribution-free 95% confidence interval (order statistics). Rounds go on until the interval's
half-width is under `--half-width` (0.025: finer than the 5% the acceptance judges) or
`--max-compare-rounds` is reached (precision alone decides when to stop). The verdict is decisive when
the interval lies wholly on one side of 0.95 and its half-width is under the 5% it judges; otherwise
`verdict` says "not decisive" rather than reading a verdict into noise. Throughput is the trainer's own
tokens/s per full optimizer step, measured on rank 0. `--background-load N` runs N busy-looping
processes for the whole measurement (other jobs on a shared machine), started and stopped by the bench;
the load average is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Iterator

from hybridpar.bench import emit
from hybridpar.pipeline.schedules import schedule_names
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.topology.spawn import run_ranks


class _Steps:
    """Runs the trainer's next `n` steps (step numbers go on across the phases) and returns their records."""

    def __init__(self, tr: Any) -> None:
        self.tr, self.step = tr, 0

    def __call__(self, n: int) -> list[dict]:
        out = [self.tr.step(s) for s in range(self.step, self.step + n)]
        self.step += n
        return out


def _worker(cfg_dict: dict, a: dict) -> dict[str, Any] | None:
    from hybridpar.batching.policy import count_rules
    from hybridpar.config import Config
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p, t = cfg.parallel, cfg.train
    topo = build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s)
    tr = Trainer(cfg, topo)
    run = _Steps(tr)
    batch = t.global_batch // p.dp
    least, multiple = count_rules(cfg)
    counts = [m for m in range(least, batch + 1) if m % multiple == 0]
    run(a["warmup"])
    clock = [time.perf_counter()]  # phase boundaries: sweep, settling, comparison
    sweep = _sweep(tr, run, batch, counts, a)
    clock.append(time.perf_counter())
    settle = _settle(cfg, tr, run, a)
    clock.append(time.perf_counter())
    sweep |= _finalists(settle, sweep)
    cmp = _compare(tr, run, settle["adaptive"], batch, sweep["finalists"], a)
    tr.policy = settle["adaptive"]
    clock.append(time.perf_counter())
    if topo.rank != 0:
        return None
    return _result(cfg, tr, sweep, settle, cmp, clock)


def _sweep(tr: Any, run: _Steps, batch: int, counts: list[int], a: dict) -> dict[str, Any]:
    """Every fixed split in interleaved rounds: tokens/s of each step ("fixed") and the activation peak
    ("peak") per microbatch count."""
    from hybridpar.batching.fixed import FixedPolicy

    fixed: dict[int, list[float]] = {m: [] for m in counts}
    peak: dict[int, int] = {}
    for _ in range(a["rounds"]):
        for m in counts:
            tr.policy = FixedPolicy(batch, count=m)
            recs = run(1 + a["steps_per_split"])[1:]  # first step after a change: new shapes, allocations
            fixed[m] += [r["tokens_per_s"] for r in recs]
            peak[m] = max([peak.get(m, 0)] + [r["activation_peak_bytes"] for r in recs])
    return {"fixed": fixed, "peak": peak}


def _settle(cfg: Any, tr: Any, run: _Steps, a: dict) -> dict[str, Any]:
    """The adaptive policy from a cold start until it settles: the policy ("adaptive"), the records of its
    steps ("recs"), its statistics ("stats") and its counters ("settled"), from which the comparison's count."""
    import torch
    import torch.distributed as dist

    from hybridpar.batching.policy import make_policy

    cfg.batching.policy = "adaptive"
    if a["memory_budget"] is not None:
        cfg.batching.memory_budget = a["memory_budget"]
    tr.policy = make_policy(
        cfg,
        tr.topo.dp_rank,
        memory_total_bytes=tr.monitor.sample().memory_total_bytes,
        resident_bytes=tr.monitor.sample().memory_used_bytes,
    )
    adaptive = tr.policy
    recs: list[dict] = []
    while True:  # until it settles; rank 0 decides, as for the rounds of the comparison
        recs += run(1)
        flag = torch.tensor([float(not adaptive.exploring or len(recs) >= a["adaptive_steps"])])
        dist.broadcast(flag, 0)
        if flag.item():
            break
    stats = adaptive.statistics()
    settled = {k: stats[k] for k in ("rounds", "rechecks", "explore_steps")} | {"drifts": len(stats["drifts"])}
    return {"adaptive": adaptive, "recs": recs, "stats": stats, "settled": settled}


def _finalists(settle: dict[str, Any], sweep: dict[str, Any]) -> dict[str, Any]:
    """The fixed splits within the memory budget ("allowed") and those the comparison runs ("finalists"):
    the sweep's best two and the policy's own."""
    import torch
    import torch.distributed as dist

    adaptive, budget, peak = settle["adaptive"], settle["stats"]["memory_budget_bytes"], sweep["peak"]
    med = {m: statistics.median(v) for m, v in sweep["fixed"].items()}
    allowed = [m for m in sweep["fixed"] if budget is None or peak[m] <= budget]
    finalists = sorted(allowed, key=lambda m: med[m], reverse=True)[:2]
    # The policy's own choice run as a fixed split too (when the sweep did not rank it top two): a noisy
    # sweep must not hand the policy a weak baseline; the best fixed split is then at least its split.
    finalists += [m for m in [len(adaptive.propose(0))] if m in allowed and m not in finalists]
    # Each rank timed the sweep itself: rank 0's finalists for all, or ranks would run different splits.
    chosen = torch.tensor(finalists + [0] * (3 - len(finalists)))
    dist.broadcast(chosen, 0)
    return {"allowed": allowed, "finalists": [int(m) for m in chosen if m > 0]}


def _compare(tr: Any, run: _Steps, adaptive: Any, batch: int, finalists: list[int], a: dict) -> dict[str, Any]:
    """The steady state: rounds of blocks, the settled policy against the finalists, until precise enough."""
    import torch
    import torch.distributed as dist

    from hybridpar.batching.fixed import FixedPolicy

    # Every rank must run the same number of rounds: rank 0's measurements decide when to stop.
    contenders: list[tuple[str, Any]] = [("adaptive", adaptive)] + [
        (f"fixed{m}", FixedPolicy(batch, count=m)) for m in finalists
    ]
    blocks: dict[str, list[float]] = {name: [] for name, _ in contenders}  # per round, the block median
    used: set[tuple[int, ...]] = set()  # splits the converged policy ran while compared
    off_rounds = 0  # rounds whose adaptive block ran some other split than the settled one (its races)
    settled_split = tuple(adaptive.propose(0))
    rounds, dropped = 0, []
    while True:
        order = contenders[rounds % len(contenders) :] + contenders[: rounds % len(contenders)]
        for name, policy in order:
            tr.policy = policy
            block = run(1 + a["steps_per_split"])
            blocks[name].append(statistics.median(r["tokens_per_s"] for r in block[1:]))
            if name == "adaptive":
                used |= {tuple(r["microbatches"]) for r in block}
                off_rounds += any(tuple(r["microbatches"]) != settled_split for r in block[1:])
        rounds += 1
        live = [m for m in finalists if m not in dropped]
        best = max(live, key=lambda m: statistics.median(blocks[f"fixed{m}"]))
        ratios = [x / y for x, y in zip(blocks["adaptive"], blocks[f"fixed{best}"])]
        v = judge_ratios(ratios)
        done = rounds >= a["compare_rounds"] and v["ratio_half_width"] < a["half_width"]
        # A finalist shown more than 5% slower than the best (the upper end of its paired interval
        # below 0.95) cannot be the best fixed split: it stops running, and the rounds left are shorter,
        # so adaptive's blocks and the best's lie closer in time. Rank 0's readings decide, for all.
        slow = [
            m for m in live if rounds >= a["compare_rounds"] and slower(blocks[f"fixed{m}"], blocks[f"fixed{best}"])
        ]
        flag = torch.tensor([float(done or rounds >= a["max_compare_rounds"])] + [float(m in slow) for m in finalists])
        dist.broadcast(flag, 0)
        if flag[0].item():
            break
        dropped += [m for m, f in zip(finalists, flag[1:].tolist()) if f and m not in dropped]
        contenders = [(n, q) for n, q in contenders if n == "adaptive" or int(n[5:]) not in dropped]
    return {
        "blocks": blocks,
        "used": used,
        "off_rounds": off_rounds,
        "rounds": rounds,
        "dropped": dropped,
        "best": best,
        "ratios": ratios,
        "verdict": v,
    }


def _result(
    cfg: Any, tr: Any, sweep: dict[str, Any], settle: dict[str, Any], cmp: dict[str, Any], clock: list[float]
) -> dict[str, Any]:
    """Rank 0's record of the whole measurement."""
    from hybridpar.batching.fixed import FixedPolicy

    p, t = cfg.parallel, cfg.train
    batch = t.global_batch // p.dp
    peak, allowed = sweep["peak"], sweep["allowed"]
    med = {m: statistics.median(v) for m, v in sweep["fixed"].items()}
    adaptive, stats, settled, recs = settle["adaptive"], settle["stats"], settle["settled"], settle["recs"]
    blocks, best = cmp["blocks"], cmp["best"]
    done, fixed_tps = stats["steps_to_converge"], statistics.median(blocks[f"fixed{best}"])
    cold = sum(r["tokens_per_s"] * r["step_time_s"] for r in recs) / sum(r["step_time_s"] for r in recs)
    return {
        "layout": f"tp{p.tp}-pp{p.pp}-dp{p.dp}",
        "schedule": p.schedule,
        "global_batch": t.global_batch,
        "seq_len": t.seq_len,
        "model": f"{cfg.model.dim}d-{cfg.model.n_layers}L",
        "fixed": [
            {
                "microbatches": m,
                "sizes": FixedPolicy(batch, count=m).split,
                "tokens_per_s": med[m],
                "peak_activation_bytes": peak[m],
                "within_budget": m in allowed,
            }
            for m in sweep["fixed"]
        ],
        "best_fixed_microbatches": best,
        "compared_fixed_microbatches": sweep["finalists"],
        "dropped_fixed_microbatches": cmp["dropped"],  # shown >5% slower than the best: not run to the end
        "best_fixed_sweep_tokens_per_s": med[best],
        "best_fixed_tokens_per_s": fixed_tps,
        "adaptive_tokens_per_s": statistics.median(blocks["adaptive"]),
        **cmp["verdict"],
        "compare_rounds": cmp["rounds"],
        "round_ratios": cmp["ratios"],
        "adaptive_split": adaptive.statistics()["current_split"],
        # Settled on the best fixed split itself: the steady-state ratio is then 1 but for the policy's
        # own overhead, and the measured one is the machine's noise.
        "adaptive_on_best_fixed_split": adaptive.statistics()["current_split"] == FixedPolicy(batch, count=best).split,
        "adaptive_compare_splits": sorted(cmp["used"]),
        # What the settled policy raced while compared: its re-checks and drift re-scans are part of its
        # steady-state cost, and these say how much of the comparison they touched.
        "adaptive_off_split_rounds": cmp["off_rounds"],
        "adaptive_compare_rechecks": adaptive.rechecks - settled["rechecks"],
        "adaptive_compare_rescans": adaptive.rounds - settled["rounds"],
        "adaptive_compare_explore_steps": adaptive.explore_steps - settled["explore_steps"],
        "adaptive_compare_drifts": adaptive.drifts[settled["drifts"] :],  # what started those re-scans
        "converged": stats["converged"],
        "steps_to_converge": done,
        "explore_steps": stats["explore_steps"],
        "adaptive_steps": len(recs),
        # Convergence cost: the settling run's tokens over its time, against the best fixed split in
        # the comparison (measured later: machine drift between the two phases is not cancelled).
        "cold_start_tokens_per_s": cold,
        "cold_start_ratio": cold / fixed_tps,
        "memory_budget_bytes": stats["memory_budget_bytes"],
        "peak_memory_bytes": max(r["activation_peak_bytes"] for r in recs),
        "oom_retries": tr.oom_retries,
        "adaptive_history": stats["history"],
        "phase_seconds": dict(zip(("sweep", "settle", "compare"), (t1 - t0 for t0, t1 in zip(clock, clock[1:])))),
    }


def judge_ratios(ratios: list[float], floor: float = 0.95) -> dict[str, Any]:
    """The comparison's verdict from its paired per-round ratios: decisive when the median's 95% interval
    lies wholly on one side of `floor` and is narrower than the margin it judges (half-width under
    1 - floor: 5% for 0.95); otherwise "not decisive", whatever the median says. The number of rounds is
    set by precision alone (`--half-width`, `--max-compare-rounds`), never by which side the interval is
    on, so stopping does not bias the verdict."""
    lo, hi = median_ci95(ratios)
    # Under 6 rounds even the full range is less than a 95% interval (2 * 0.5**n > 5%): nothing decided.
    decisive = len(ratios) >= 6 and (hi - lo) / 2 < 1.0 - floor and not lo < floor <= hi
    side = f"adaptive >= {floor}x best fixed" if lo >= floor else f"adaptive < {floor}x best fixed"
    return {
        "ratio": statistics.median(ratios),
        "ratio_ci95": [lo, hi],
        "ratio_half_width": (hi - lo) / 2,
        "decisive": decisive,
        "verdict": side if decisive else "not decisive",
        # Whatever the precision: where the whole interval lies against the floor.
        "interval_vs_floor": "above" if lo >= floor else "below" if hi < floor else "contains",
    }


def slower(xs: list[float], best: list[float], floor: float = 0.95) -> bool:
    """Whether the paired per-round ratios of `xs` to `best` (the rounds both ran) have their median's
    95% interval wholly below `floor`."""
    ratios = [x / y for x, y in zip(xs, best)]
    return len(ratios) >= 6 and median_ci95(ratios)[1] < floor


def median_ci95(xs: list[float]) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median of `xs` (order statistics: the k-th
    smallest and largest, k the largest with P(Binomial(n, 1/2) < k) <= 2.5%); the full range when n is
    too small for that (under 6: then it is not a 95% interval, and judge_ratios decides nothing)."""
    n, s = len(xs), sorted(xs)
    k, tail = 0, 0.0
    while k < n // 2 and tail + math.comb(n, k) / 2**n <= 0.025:
        tail += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return s[k - 1], s[n - k]


@contextlib.contextmanager
def background_load(n: int) -> Iterator[None]:
    """N processes spinning on a core each while the block runs, ended when it ends, whatever happens."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hybridpar bench microbatch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="2x2x1,1x4x1", help="tp x pp x dp layouts, comma-separated")
    ap.add_argument("--schedule", default="1f1b", choices=schedule_names(), help="pipeline schedule")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds over every fixed split")
    ap.add_argument("--steps-per-split", type=int, default=3, help="measured steps per split per round")
    ap.add_argument("--adaptive-steps", type=int, default=200, help="most steps for the policy to settle in")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--compare-rounds", type=int, default=8, help="least rounds of alternating adaptive / best-fixed blocks"
    )
    ap.add_argument("--max-compare-rounds", type=int, default=80, help="most rounds, if the interval stays wide")
    ap.add_argument(
        "--half-width", type=float, default=0.025, help="stop once the ratio's 95%% interval is narrower than 2x this"
    )
    ap.add_argument("--background-load", type=int, default=0, help="busy-looping processes run meanwhile")
    ap.add_argument("--memory-budget", type=float, default=None, help="adaptive: bytes, or fraction if <= 1")
    ap.add_argument("--json", default=None, help="write the records to FILE ('-': stdout)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from hybridpar.config import Config

    a = parse_args(argv)
    if not 0 < a.half_width < 1 or a.background_load < 0 or not 1 <= a.compare_rounds <= a.max_compare_rounds:
        raise SystemExit(
            f"need --half-width={a.half_width} in (0, 1), --background-load={a.background_load} >= 0 and "
            f"1 <= --compare-rounds={a.compare_rounds} <= --max-compare-rounds={a.max_compare_rounds}"
        )
    records = []
    for layout in a.layouts.split(","):
        tp, pp, dp = map(int, layout.split("x"))
        cfg = Config()
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.schedule = tp, pp, dp, a.schedule
        cfg.train.global_batch, cfg.train.microbatches = a.global_batch, max(pp, 1)
        cfg.train.val_every = cfg.train.monitor_every = 0
        validate_config(cfg, tp * pp * dp)
        load_before = os.getloadavg()
        with background_load(a.background_load):
            rec = run_ranks(_worker, tp * pp * dp, cfg.to_dict(), vars(a), timeout_s=3600)[0]
        rec.update(
            background_load=a.background_load, load_average_before=load_before, load_average_after=os.getloadavg()
        )
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("fixed", "adaptive_history")}), file=sys.stderr)
    emit(records, a.json, echo=a.json in (None, "-"))
    return 0

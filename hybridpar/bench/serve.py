"""`hybridpar bench serve`: request placement strategies under open-loop Poisson load.

Two (or more) real replicas of a small Llama (worker processes, KV-cached engine) serve a mix of
short and long prompts and outputs; replica 1 runs in the named EMULATION MODE `--slow 2.0` (its
ranks sleep once more their measured compute: a device 2x slower; off with --slow 1). First the
system's capacity is measured (a burst of requests, completed requests per second); the nominal
arrival rate is `--load` times that. Then every strategy serves the *same* arrival trace (same seed:
arrival times, lengths), each with a fresh router that learns the replicas' speeds from its own
measurements. Reported per strategy: p50/p99 latency (arrival to last token), throughput in
generated tokens per second, completed and failed (refused or timed out) requests, and the share
sent to the slow replica; plus hybrid's p99 over round_robin's, measured in the same run.

`--dtype bf16` serves in bf16 (`hybridpar serve --dtype`); `--dtype both` measures fp32 against bf16
instead of the strategies: per repeat, in alternating order, a fresh service in each dtype (no emulated
slowdown) serves the same burst of `--requests` requests (all at once) after a warm-up; reported are the
generated tokens per second of each, bf16 over fp32 per repeat and their median, and the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Any

from hybridpar.bench import emit
from hybridpar.config import ModelConfig
from hybridpar.serve.config import ServeConfig
from hybridpar.serve.router import STRATEGIES, Overloaded, Router, percentile

SCENARIOS = ("prefix", "kill", "transformers", "pp-vs-tp", "soak")  # serve_scenarios.py


def make_trace(n: int, rate: float, seed: int) -> list[dict[str, Any]]:
    """Poisson arrivals at `rate` per second; prompts and outputs each short or long at random."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        prompt = rng.randint(8, 24) if rng.random() < 0.5 else rng.randint(64, 160)
        gen = rng.randint(4, 12) if rng.random() < 0.5 else rng.randint(24, 64)
        out.append({"t": t, "prompt": [rng.randrange(256) for _ in range(prompt)], "max_tokens": gen})
    return out


def run_trace(svc: Any, trace: list[dict[str, Any]], strategy: str, timeout_s: float) -> dict[str, Any]:
    """Replay `trace` open-loop (each request at its time, whatever the backlog) under `strategy`."""
    with svc.lock:
        svc.router = Router(svc.cfg.dp, dataclasses.replace(svc.cfg.router(), strategy=strategy))
    lat: list[float] = []  # seconds, arrival to last token, of each completed request
    ttft: list[float] = []  # seconds, arrival to first token, of each completed request
    tokens = failed = 0
    lock = threading.Lock()
    waiters = []

    def wait(p: Any, t_arrive: float) -> None:
        nonlocal tokens, failed
        deadline, first = t_arrive + timeout_s, None
        while True:
            try:
                kind, val = p.events.get(timeout=max(0.01, deadline - time.perf_counter()))
            except Exception:  # queue.Empty: timed out
                svc.cancel(p.id)
                with lock:
                    failed += 1
                return
            if kind == "token" and first is None:
                first = time.perf_counter() - t_arrive
            if kind == "done":
                with lock:
                    if val.get("reason") == "error":
                        failed += 1
                    else:
                        lat.append(time.perf_counter() - t_arrive)
                        ttft.append(first if first is not None else lat[-1])
                        tokens += val["completion_tokens"]
                return

    t0 = time.perf_counter()
    for req in trace:
        time.sleep(max(0.0, t0 + req["t"] - time.perf_counter()))
        t_arrive = time.perf_counter()
        try:
            p = svc.submit(req["prompt"], req["max_tokens"], 0.0, 1.0, 0)
        except Overloaded:
            failed += 1
            continue
        w = threading.Thread(target=wait, args=(p, t_arrive), daemon=True)
        w.start()
        waiters.append(w)
    for w in waiters:
        w.join()
    wall = time.perf_counter() - t0
    stats = svc.statistics()
    routed = [sum(r["routed"].values()) for r in stats["replicas"]]
    return {
        "strategy": strategy,
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "tokens_per_s": tokens / wall,
        "completed": len(lat),
        "failed": failed,
        "wall_s": wall,
        "tokens": tokens,
        "latencies": lat,
        "ttfts": ttft,
        "p99_ttft_s": percentile(ttft, 99),
        "routed_per_replica": routed,
        "strategy_usage": stats["strategy_usage"],
    }


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One strategy's repeats together: percentiles over all their requests, throughput over all their time."""
    lat = [x for r in runs for x in r["latencies"]]
    usage: Counter = Counter()
    for r in runs:
        usage.update(r["strategy_usage"])
    return {
        "strategy": runs[0]["strategy"],
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "mean_s": sum(lat) / len(lat) if lat else None,
        "tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
        "completed": sum(r["completed"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "repeats": len(runs),
        "p99_s_per_repeat": [r["p99_s"] for r in runs],
        "routed_per_replica": [sum(x) for x in zip(*(r["routed_per_replica"] for r in runs))],
        "strategy_usage": dict(usage),
    }


def compare_dtypes(cfg: ServeConfig, model: ModelConfig, a: argparse.Namespace) -> dict[str, Any]:
    """fp32 against bf16 on one burst, alternating which goes first (see the module docstring)."""
    from hybridpar.serve.service import Service

    burst = make_trace(a.requests, 0.0, a.seed)
    per: dict[str, list[float]] = {"fp32": [], "bf16": []}
    load_before = os.getloadavg()
    for rep in range(a.repeats):
        for dtype in ("fp32", "bf16") if rep % 2 == 0 else ("bf16", "fp32"):
            svc = Service(dataclasses.replace(cfg, dtype=dtype, emulate_slowdown=""), model, cfg.source)
            try:
                run_trace(svc, burst[:4], "load_balanced", a.timeout_s)  # warm-up
                r = run_trace(svc, burst, "load_balanced", a.timeout_s)
            finally:
                svc.close()
            if r["failed"]:
                raise RuntimeError(f"{dtype}: {r['failed']} of {len(burst)} requests failed (raise --timeout-s?)")
            per[dtype].append(r["tokens_per_s"])
            print(f"repeat {rep + 1}/{a.repeats} {dtype}: {r['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    ratios = [b / f for f, b in zip(per["fp32"], per["bf16"])]
    return {
        **{f"{d}_tokens_per_s": statistics.median(v) for d, v in per.items()},
        **{f"{d}_tokens_per_s_per_repeat": v for d, v in per.items()},
        "bf16_over_fp32_tokens_per_s_per_repeat": ratios,
        "bf16_over_fp32_tokens_per_s": statistics.median(ratios),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hybridpar bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--slow", type=float, default=2.0, help="EMULATION: replica 1 this many times slower (1 = off)")
    ap.add_argument("--requests", type=int, default=160, help="requests per strategy")
    ap.add_argument("--load", type=float, default=0.65, help="arrival rate as a fraction of the measured capacity")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--repeats", type=int, default=2, help="passes over the strategies, alternating (pooled)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="a request not done by then counts as failed")
    ap.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "both"),
        default="fp32",
        help="what the replicas serve in; both: fp32 against bf16 on one burst instead of the strategies",
    )
    ap.add_argument(
        "--throughput",
        action="store_true",
        help="one replica's tokens/s and p99 time to first token at saturation and at --load of it, "
        "instead of the strategies",
    )
    ap.add_argument("--tp", type=int, default=1, help="--throughput: tensor-parallel degree of the replica")
    ap.add_argument("--pp", type=int, default=2, help="--throughput: pipeline stages of the replica")
    ap.add_argument(
        "--rate-rps", type=float, default=0.0, help="--throughput: the saturation rate --load applies to (0 = measured)"
    )
    ap.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default=None,
        help="instead of the strategies: prefix (shared-prefix trace: prefix caching on/off, cache_aware vs "
        "hybrid), kill (a replica killed mid-run), transformers (against generate), pp-vs-tp, soak (HTTP, "
        "--clients concurrent plus --slow-clients)",
    )
    ap.add_argument("--clients", type=int, default=200, help="--scenario soak: concurrent clients")
    ap.add_argument("--slow-clients", type=int, default=50, help="--scenario soak: clients trickling a request head")
    ap.add_argument("--client-timeout-s", type=float, default=2.0, help="--scenario soak: the server's client timeout")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    strategies = [s for s in a.strategies.split(",") if s]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or a.replicas < 2 or a.slow < 1 or not 0 < a.load or a.requests < 1 or a.repeats < 1:
        print(
            f"hybridpar bench serve: error: need --replicas >= 2, --slow >= 1, --load > 0, --requests >= 1 and "
            f"strategies among {', '.join(STRATEGIES)} (got {bad or ''})",
            file=sys.stderr,
        )
        return 2
    if a.scenario is not None:
        return _scenario(a, argv)
    if a.throughput:
        if a.tp < 1 or a.pp < 1 or not a.rate_rps >= 0:
            print("hybridpar bench serve: error: need --tp >= 1, --pp >= 1 and --rate-rps >= 0", file=sys.stderr)
            return 2
        from hybridpar.bench.serve_throughput import measure

        emit({**measure(a), "command": "hybridpar bench serve " + " ".join(argv)}, a.json)
        return 0
    from hybridpar.serve.service import Service

    model = ModelConfig(dim=64, n_layers=4, n_heads=4, ffn_dim=176)
    cfg = ServeConfig(
        source="init:0",
        dp=a.replicas,
        max_batch=4,
        max_groups=2,
        kv_tokens=4096,
        max_seq_len=256,
        max_outstanding=64,
        max_pending=512,
        emulate_slowdown=f"1:{a.slow}" if a.slow > 1 else "",
        dtype="fp32" if a.dtype == "both" else a.dtype,
    )
    cfg.validate(model)
    if a.dtype == "both":
        head = {"bench": "serve", "mode": "dtypes", "model": dataclasses.asdict(model), "replicas": a.replicas}
        out = {**head, "requests": a.requests, "repeats": a.repeats, **compare_dtypes(cfg, model, a)}
        out["command"] = "hybridpar bench serve " + " ".join(argv)
        emit(out, a.json)
        return 0
    svc = Service(cfg, model, cfg.source)
    try:
        burst = make_trace(48, 0.0, a.seed + 1)  # all at t=0: the replicas stay saturated until done
        run_trace(svc, burst[:8], "load_balanced", a.timeout_s)  # warm-up (allocations, first measurements)
        cal = run_trace(svc, burst, "performance_optimized", a.timeout_s)
        capacity = cal["completed"] / cal["wall_s"]
        rate = a.load * capacity
        trace = make_trace(a.requests, rate, a.seed)
        runs = [run_trace(svc, trace, s, a.timeout_s) for _ in range(a.repeats) for s in strategies]
        results = [pool_runs([r for r in runs if r["strategy"] == s]) for s in strategies]
    finally:
        svc.close()
    by = {r["strategy"]: r for r in results}
    ratio = (
        by["hybrid"]["p99_s"] / by["round_robin"]["p99_s"]
        if "hybrid" in by and "round_robin" in by and by["round_robin"]["p99_s"]
        else None
    )
    out = {
        "bench": "serve",
        "mode": f"emulated: replica 1 {a.slow}x slower" if a.slow > 1 else "real",
        "dtype": a.dtype,
        "model": dataclasses.asdict(model),
        "replicas": a.replicas,
        "capacity_rps": capacity,
        "load": a.load,
        "rate_rps": rate,
        "requests": a.requests,
        "repeats": a.repeats,
        "results": results,
        "hybrid_p99_over_round_robin_p99": ratio,
    }
    emit(out, a.json)
    return 0


def _scenario(a: argparse.Namespace, argv: list[str]) -> int:
    if a.clients < 1 or a.slow_clients < 0 or not 0 < a.client_timeout_s <= 60:
        print(
            "hybridpar bench serve: error: need --clients >= 1, --slow-clients >= 0 and --client-timeout-s in (0, 60]",
            file=sys.stderr,
        )
        return 2
    from hybridpar.bench.serve_scenarios import run

    emit({**run(a), "command": "hybridpar bench serve " + " ".join(argv)}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

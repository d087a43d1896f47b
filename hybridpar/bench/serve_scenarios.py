"""`hybridpar bench serve --scenario NAME`: the serving comparisons beside the strategies and --throughput,
each side by side in one run on the same model and trace, alternating the contenders per repeat,
reported as medians with every repeat's figures and the load average before and after.

- `prefix`: a shared-prefix trace (a few long system prompts, each request one of them plus a short
  question of its own; Poisson arrivals at --load of the capacity measured without prefix caching):
  time to first token with prefix caching against without (one replica), then `cache_aware` against
  `hybrid` routing on two replicas (p50 and p99). Every run draws prefixes of its own, so no run finds
  its prefixes cached by the one before.
- `kill`: two replicas serve a burst fault-free, then the same burst again with replica 0 killed once a
  third of its requests have streamed a token: failed requests (want 0), requests resumed mid-stream
  and started over, and greedy outputs identical to the fault-free run.
- `transformers`: against `transformers`' `generate` in one process on the same weights (exported to a
  Hugging Face directory): tokens/s at batch 1 (one request at a time) and at saturation (every request
  at once; `generate` gets them as one batch), greedy outputs compared.
- `pp-vs-tp`: decode throughput at saturation of one replica at pp2 against tp2 and pp4 against tp4.
- `soak`: see serve_soak.py.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import sys
import time
from typing import Any

from hybridpar.bench.serve import make_trace, run_trace
from hybridpar.bench.serve_throughput import MODEL, serve_config
from hybridpar.serve.router import percentile

# The prefix scenario's model is wider than the others' and its system prompts long: what prefix caching
# saves is prefill compute, which the others' small model (dim 64) spends too little of to tell.
PREFIX_MODEL = dataclasses.replace(MODEL, dim=256, ffn_dim=704)
PREFIX_LEN = 448


def prefix_trace(
    n: int, rate: float, seed: int, prefixes: int = 4, prefix_len: int = PREFIX_LEN
) -> list[dict[str, Any]]:
    """Poisson arrivals of requests that each start with one of `prefixes` shared system prompts."""
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(prefix_len)] for _ in range(prefixes)]
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        tail = [rng.randrange(256) for _ in range(rng.randint(8, 24))]
        out.append({"t": t, "prompt": rng.choice(heads) + tail, "max_tokens": rng.randint(4, 8)})
    return out


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _ttft(r: dict[str, Any]) -> dict[str, Any]:
    if r["failed"]:
        raise RuntimeError(f"{r['failed']} requests failed (raise --timeout-s?)")
    return {"p50_ttft_s": percentile(r["ttfts"], 50), "p99_ttft_s": percentile(r["ttfts"], 99), "wall_s": r["wall_s"]}


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"per_repeat": runs}


def prefix(a: Any) -> dict[str, Any]:
    from hybridpar.serve.service import Service

    one = dataclasses.replace(serve_config(1, 1), max_step_tokens=0, max_seq_len=512, kv_tokens=8192)
    one.validate(PREFIX_MODEL)
    svcs = {c: Service(dataclasses.replace(one, prefix_caching=c), PREFIX_MODEL, one.source) for c in (True, False)}
    caching: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    try:
        for s in svcs.values():
            run_trace(s, prefix_trace(8, 0.0, a.seed + 99), "load_balanced", a.timeout_s)  # warm-up
        cal = run_trace(svcs[False], prefix_trace(24, 0.0, a.seed + 98), "load_balanced", a.timeout_s)
        rate = a.load * cal["completed"] / cal["wall_s"]
        for rep in range(a.repeats):
            for i, c in enumerate((True, False) if rep % 2 == 0 else (False, True)):
                trace = prefix_trace(a.requests, rate, a.seed + 10 * rep + i)
                caching[c].append(_ttft(run_trace(svcs[c], trace, "load_balanced", a.timeout_s)))
            _say(f"prefix caching, repeat {rep + 1}: on {caching[True][-1]}, off {caching[False][-1]}")
    finally:
        for s in svcs.values():
            s.close()
    routing = _routing(a, dataclasses.replace(one, dp=2), rate * 2)
    on, off = _medians(caching[True]), _medians(caching[False])
    ratios = [x["p50_ttft_s"] / y["p50_ttft_s"] for x, y in zip(caching[True], caching[False])]
    return {
        "model": dataclasses.asdict(PREFIX_MODEL),
        "prefix_tokens": PREFIX_LEN,
        "rate_rps_one_replica": rate,
        "caching_on": on,
        "caching_off": off,
        "p50_ttft_on_over_off": statistics.median(ratios),
        "p99_ttft_on_over_off": on["p99_ttft_s"] / off["p99_ttft_s"],
        **routing,
    }


def _routing(a: Any, cfg: Any, rate: float) -> dict[str, Any]:
    from hybridpar.serve.service import Service

    svc = Service(cfg, PREFIX_MODEL, cfg.source)
    runs: dict[str, list[dict[str, Any]]] = {"cache_aware": [], "hybrid": []}
    try:
        run_trace(svc, prefix_trace(8, 0.0, a.seed + 97), "hybrid", a.timeout_s)
        for rep in range(a.repeats):
            order = ("cache_aware", "hybrid") if rep % 2 == 0 else ("hybrid", "cache_aware")
            for i, s in enumerate(order):
                trace = prefix_trace(a.requests, rate, a.seed + 1000 + 10 * rep + i)
                r = run_trace(svc, trace, s, a.timeout_s)
                runs[s].append({**_ttft(r), "p50_s": r["p50_s"], "p99_s": r["p99_s"]})
            _say(f"routing, repeat {rep + 1}: cache_aware {runs['cache_aware'][-1]}, hybrid {runs['hybrid'][-1]}")
    finally:
        svc.close()
    ca, hy = _medians(runs["cache_aware"]), _medians(runs["hybrid"])
    return {
        "routing_rate_rps": rate,
        "cache_aware": ca,
        "hybrid": hy,
        "p50_ttft_cache_aware_over_hybrid": ca["p50_ttft_s"] / hy["p50_ttft_s"],
        "p99_ttft_cache_aware_over_hybrid": ca["p99_ttft_s"] / hy["p99_ttft_s"],
    }


def _outputs(svc: Any, trace: list[dict[str, Any]], timeout_s: float, kill: bool) -> dict[str, Any]:
    """Submit `trace` at once; the tokens each request got (None if it failed). `kill`: kill replica 0's
    driver as soon as a third of its requests have streamed a token (so some are mid-stream, some not
    started)."""
    t0 = time.perf_counter()
    pend = [svc.submit(r["prompt"], r["max_tokens"], 0.0, 1.0, None) for r in trace]
    mine = [p for p in pend if svc.router.where.get(p.id) == 0]
    while kill and sum(p.streamed > 0 for p in mine) < len(mine) / 3 and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.005)
    if kill:
        svc.pool.procs[0].kill()
    out: list[list[int] | None] = []
    for p in pend:
        toks: list[int] = []
        while (ev := p.events.get(timeout=timeout_s))[0] == "token":
            toks.append(ev[1])
        out.append(toks if ev[1].get("reason") != "error" else None)
    return {"tokens": out, "wall_s": time.perf_counter() - t0, "counters": dict(svc.counters)}


def kill(a: Any) -> dict[str, Any]:
    from hybridpar.serve.service import Service

    cfg = dataclasses.replace(serve_config(1, 1), dp=2, strategy="round_robin")
    trace = make_trace(a.requests, 0.0, a.seed)
    runs = []
    for killed in (False, True):
        svc = Service(cfg, MODEL, cfg.source)
        try:
            runs.append(_outputs(svc, trace, a.timeout_s, killed))
        finally:
            svc.close()
    ref, hit = runs
    return {
        "requests": len(trace),
        "failed": sum(t is None for t in hit["tokens"]),
        "identical_to_fault_free": sum(x == y for x, y in zip(ref["tokens"], hit["tokens"])),
        "resumed_mid_stream": hit["counters"].get("requests_resumed", 0),
        "started_over": hit["counters"].get("requests_retried", 0),
        "wall_s_fault_free": ref["wall_s"],
        "wall_s_killed": hit["wall_s"],
    }


def pp_vs_tp(a: Any) -> dict[str, Any]:
    from hybridpar.serve.service import Service

    out: dict[str, Any] = {}
    for n in (2, 4):
        per: dict[str, list[float]] = {f"pp{n}": [], f"tp{n}": []}
        for rep in range(a.repeats):
            for name in list(per) if rep % 2 == 0 else list(per)[::-1]:
                pp, tp = (n, 1) if name.startswith("pp") else (1, n)
                cfg = dataclasses.replace(serve_config(pp, tp), max_groups=max(2, pp))
                svc = Service(cfg, MODEL, cfg.source)
                try:
                    run_trace(svc, make_trace(8, 0.0, a.seed + 99), "load_balanced", a.timeout_s)
                    r = run_trace(svc, make_trace(a.requests, 0.0, a.seed + rep), "load_balanced", a.timeout_s)
                finally:
                    svc.close()
                per[name].append(r["tokens_per_s"])
                _say(f"{name}, repeat {rep + 1}: {r['tokens_per_s']:.1f} tok/s")
        out[f"pp{n}_tokens_per_s"] = statistics.median(per[f"pp{n}"])
        out[f"tp{n}_tokens_per_s"] = statistics.median(per[f"tp{n}"])
        out[f"pp{n}_over_tp{n}"] = statistics.median(p / t for p, t in zip(per[f"pp{n}"], per[f"tp{n}"]))
        out[f"per_repeat_{n}"] = per
    return out


def run(a: Any) -> dict[str, Any]:
    before = os.getloadavg()
    if a.scenario == "soak":
        from hybridpar.bench.serve_soak import soak

        body = soak(a)
    elif a.scenario == "transformers":
        from hybridpar.bench.serve_hf import against_transformers

        body = against_transformers(a)
    else:
        body = {"prefix": prefix, "kill": kill, "pp-vs-tp": pp_vs_tp}[a.scenario](a)
    head = {"bench": "serve", "scenario": a.scenario, "model": dataclasses.asdict(MODEL)}  # prefix: its own
    if a.scenario in ("prefix", "transformers", "pp-vs-tp"):  # the others run once
        head["repeats"] = a.repeats
    return head | body | {"load_avg_before": before, "load_avg_after": os.getloadavg(), "cpus": os.cpu_count()}

"""`hybridpar bench serve --throughput`: one replica's throughput and time to first token under
open-loop load with mixed prompt and output lengths (prompts of 8-24 or 64-160 tokens, outputs of 4-12 or
24-64, at random: `make_trace`).

Per repeat, on one tp x pp replica (no emulated slowdown), after a warm-up:

- **saturation**: a burst of `--requests` requests at once, so the replica never runs dry: generated
  tokens per second (the capacity), completed requests per second, and p99 time to first token (here
  mostly queueing);
- **open loop at `--load` (0.65) of saturation**: Poisson arrivals of as many requests at `--load` times
  the rate of `--rate-rps` when given (so that two builds can be driven at the same arrival rate),
  else of this repeat's measured saturation rate: generated tokens per second and p99 time to first token.

Reported are the medians over repeats, each repeat's figures and the load average before and after.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Any

from hybridpar.config import ModelConfig
from hybridpar.serve.config import ServeConfig

MODEL = ModelConfig(dim=64, n_layers=4, n_heads=4, ffn_dim=176)


def serve_config(pp: int, tp: int) -> ServeConfig:
    """The replica measured: 2 micro-batches of 8 sequences, a 4096-token KV budget."""
    return ServeConfig(
        source="init:0",
        tp=tp,
        pp=pp,
        dp=1,
        max_batch=8,
        max_groups=2,
        kv_tokens=4096,
        max_seq_len=256,
        max_outstanding=100_000,
        max_pending=100_000,
    )


def _one(svc: Any, trace: list[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    from hybridpar.bench.serve import run_trace

    r = run_trace(svc, trace, "load_balanced", timeout_s)
    if r["failed"]:
        raise RuntimeError(f"{r['failed']} of {len(trace)} requests failed (raise --timeout-s?)")
    return {k: r[k] for k in ("tokens_per_s", "p99_ttft_s", "p99_s", "completed", "wall_s")}


def measure(a: Any) -> dict[str, Any]:
    from hybridpar.bench.serve import make_trace
    from hybridpar.serve.service import Service

    cfg = serve_config(a.pp, a.tp)
    cfg.validate(MODEL)
    load_before = os.getloadavg()
    svc = Service(cfg, MODEL, cfg.source)
    sat, loaded = [], []
    try:
        _one(svc, make_trace(8, 0.0, a.seed + 99), a.timeout_s)  # warm-up
        for rep in range(a.repeats):
            s = _one(svc, make_trace(a.requests, 0.0, a.seed + rep), a.timeout_s)
            s["requests_per_s"] = s["completed"] / s["wall_s"]
            sat.append(s)
            rate = a.load * (a.rate_rps if a.rate_rps else s["requests_per_s"])
            o = _one(svc, make_trace(a.requests, rate, a.seed + 1000 + rep), a.timeout_s)
            o["rate_rps"] = rate
            loaded.append(o)
            print(
                f"repeat {rep + 1}/{a.repeats}: saturation {s['tokens_per_s']:.1f} tok/s, p99 TTFT "
                f"{s['p99_ttft_s']:.2f} s; at {rate:.2f} req/s {o['tokens_per_s']:.1f} tok/s, p99 TTFT "
                f"{o['p99_ttft_s']:.3f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        svc.close()

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {
        "bench": "serve",
        "mode": "throughput",
        "model": dataclasses.asdict(MODEL),
        "tp": a.tp,
        "pp": a.pp,
        "limits": {"max_batch": cfg.max_batch, "max_groups": cfg.max_groups, "kv_tokens": cfg.kv_tokens},
        "requests": a.requests,
        "repeats": a.repeats,
        "load": a.load,
        "saturation": {k: med(sat, k) for k in ("tokens_per_s", "requests_per_s", "p99_ttft_s")},
        "open_loop": {k: med(loaded, k) for k in ("rate_rps", "tokens_per_s", "p99_ttft_s", "p99_s")},
        "saturation_per_repeat": sat,
        "open_loop_per_repeat": loaded,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
    }

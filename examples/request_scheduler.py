"""Measured request placement: two replicas of a small model (worker processes),
replica 1 in the named EMULATION MODE "2x slower" (its ranks sleep once more their measured
compute). A burst of mixed requests goes through the hybrid router, which learns each replica's
per-token latency from finished requests; then `statistics()` is printed: strategy usage, queue
depth per replica, measured latencies and percentiles. Every number is measured.

    .venv/bin/python examples/request_scheduler.py
"""

from __future__ import annotations

import json
import random

from hybridpar.config import ModelConfig
from hybridpar.serve.config import ServeConfig
from hybridpar.serve.service import Service

if __name__ == "__main__":
    model = ModelConfig(dim=64, n_layers=4, n_heads=4, ffn_dim=176)
    cfg = ServeConfig(
        source="init:0",
        dp=2,
        strategy="hybrid",
        max_batch=4,
        max_groups=2,
        kv_tokens=4096,
        max_seq_len=256,
        emulate_slowdown="1:2.0",
    )
    svc = Service(cfg, model, cfg.source)
    rng = random.Random(0)
    waves = []
    try:
        # Wave 1: nothing is measured yet, so both replicas look equal. Wave 2: the router has measured
        # per-token latencies from wave 1's completions and places by them.
        for n in (8, 40):
            before = [sum(r["routed"].values()) for r in svc.statistics()["replicas"]]
            pend = []
            for _ in range(n):
                prompt = [rng.randrange(256) for _ in range(rng.choice([12, 120]))]  # chat-like or document-like
                pend.append(svc.submit(prompt, rng.choice([8, 48]), 0.0, 1.0, 0))
            for p in pend:
                while p.events.get(timeout=300)[0] == "token":
                    pass
            stats = svc.statistics()
            waves.append([sum(r["routed"].values()) - b for r, b in zip(stats["replicas"], before)])
    finally:
        svc.close()
    print(f"requests per replica (replica 1 emulated 2x slower): wave 1 {waves[0]}, wave 2 {waves[1]}")
    print(json.dumps({k: stats[k] for k in ("strategy_usage", "latency_s", "replicas")}, indent=1))

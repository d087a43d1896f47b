"""Live load balancing on 4 local processes (pp=4, 1F1B): rank 2 is emulated 2x slow for steps
10-49, the balancer moves layers (with their AdamW state) off it while training runs, and gives them
back when it recovers. Every decision and its measured outcome is in metrics.jsonl.

    .venv/bin/python examples/load_balancer.py

The slow device is emulated (`emulate.slowdown`, a testing/benchmark mode); so is the fixed layer
cost (`emulate.layer_ms`) that keeps timings steady when 4 processes share a few cores. Drop both on
real, unequal devices: the balancer only ever reads measured compute times.
"""

import json
from pathlib import Path

from hybridpar import Config, launch

if __name__ == "__main__":
    cfg = Config()
    cfg.model.n_layers = 12
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.schedule = 1, 4, "1f1b"
    cfg.train.steps, cfg.train.val_every, cfg.train.sample_tokens = 80, 0, 0
    cfg.train.global_batch, cfg.train.seq_len = 16, 64
    cfg.emulate.slowdown = "rank=2:2.0@step=10,rank=2:1.0@step=50"
    cfg.emulate.layer_ms = 0.5
    cfg.balance.mode = "auto"  # "detect" logs the same decisions without applying them
    cfg.run_dir = "runs/load-balancer-example"
    summary = launch(cfg)
    rows = [json.loads(line) for line in Path(cfg.run_dir, "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for event in row.get("balance", []):
            if event["event"] == "rebalance":
                print(f"step {event['step']}: {event['reason']}")
            else:
                print(
                    f"  measured over the next steps: {event['measured_step_before_s']:.3f} s -> "
                    f"{event['measured_step_after_s']:.3f} s per step (predicted "
                    f"{event['predicted_step_before_s']:.3f} -> {event['predicted_step_after_s']:.3f})"
                )
    print(f"loss {summary['losses'][0]:.3f} -> {summary['losses'][-1]:.3f}; digest {summary['params_digest'][:16]}")

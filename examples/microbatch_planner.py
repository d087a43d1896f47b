"""Adaptive microbatching: train tp=2 x pp=2 with the
adaptive policy under an activation-memory budget, then show what it measured and chose.

    .venv/bin/python examples/microbatch_planner.py

The policy starts from the smallest microbatches, learns bytes per sample from the measured activation
peak, never proposes a split predicted over the budget, measures the throughput of each candidate in
blocks of steps and races the best ones again until one is shown fastest (or all left are within a
few percent), never deciding from one block. The global batch never changes, so the model trained is
the same as with any fixed split.
"""

import json
from pathlib import Path

from hybridpar import Config, launch

if __name__ == "__main__":
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.pp = 2, 2
    cfg.train.steps, cfg.train.val_every, cfg.train.sample_tokens = 120, 0, 0  # the race takes up to ~100
    cfg.batching.policy = "adaptive"
    cfg.batching.memory_budget = 16e6  # bytes of activations per rank: rules out 2 microbatches of 8
    cfg.run_dir = "runs/microbatch-example"
    launch(cfg)
    records = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
    steps, final = records[:-1], records[-1]
    for r in steps[:: max(1, len(steps) // 10)]:
        print(
            f"step {r['step']:3d}  microbatches {r['microbatches']}  peak {r['activation_peak_bytes'] / 1e6:6.2f} MB"
            f"  {r['tokens_per_s']:7.0f} tok/s"
        )
    stats = final["batching"]
    print(
        f"\nchose {stats['current_split']} after {stats['steps_to_converge']} steps; budget "
        f"{stats['memory_budget_bytes'] / 1e6:.1f} MB, {stats['bytes_per_sample'] / 1e6:.2f} MB per sample in flight"
    )
    for h in stats["history"]:
        print(f"  measured {h['split']}: {h['median_throughput']:.0f} tok/s")

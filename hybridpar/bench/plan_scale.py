"""How long `hybridpar plan` takes for a large cluster: 1,024 GPUs (128 DGX H100 nodes) and a 100-layer
model (d=8192, 64 heads, 8 kv heads, FFN 28672, vocab 128256, sequence 4096, global batch 1024).

    .venv/bin/hybridpar bench plan_scale [--nodes 128] [--top 10] [--json bench/results/plan_scale.json]

Memory: plan/memory_model.py's `rank_memory` where present; otherwise a stand-in counting only weights,
gradients and AdamW state of each rank's share (16 bytes per parameter, 4 of them for AdamW under ZeRO-1
divided by dp), which is labelled in the output. Reported: wall time of the search (the process's
imports and the model's shapes excluded and reported apart), layouts considered, simulated and
memory-checked, the top layouts, the load average, and the search's CPU time (on a shared machine the wall
time also holds other jobs' turns).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from hybridpar.bench import emit

ROOT = Path(__file__).resolve().parents[2]  # the source tree: docs/hardware/ lives there


@dataclasses.dataclass
class Weights:
    total: int


def weights_only(cfg):  # noqa: ANN001, ANN201 - the stand-in memory model (module docstring)
    m, p = cfg.model, cfg.parallel
    params = m.n_layers * (4 * m.dim * m.dim + 3 * m.dim * m.ffn_dim) + 2 * m.vocab_size * m.dim
    per_rank = params / (p.tp * p.pp)
    adam = 8 / p.dp if p.zero else 8
    return [Weights(int(per_rank * (4 + 4 + adam)))] * p.pp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench plan_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    from hybridpar.config import Config
    from hybridpar.model.registry import param_counts
    from hybridpar.plan.hardware import load_hardware
    from hybridpar.plan.search import plan

    try:
        from hybridpar.plan.memory_model import rank_memory as memory

        memory_model = "plan/memory_model.py rank_memory"
    except ImportError:
        memory, memory_model = weights_only, "stand-in: weights + gradients + AdamW state only"
    hw = dataclasses.replace(load_hardware(ROOT / "docs/hardware/dgx-h100.toml"), nodes=a.nodes)
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size = 8192, 100, 64, 8, 28672, 128256
    cfg.train.global_batch, cfg.train.seq_len = 1024, 4096
    param_counts(m)  # the model's shapes (a meta build, torch's first use): counted apart
    t1, cpu1 = time.perf_counter(), time.process_time()
    result = plan(cfg, hw, memory, top=a.top)
    t2, cpu2 = time.perf_counter(), time.process_time()
    out = {
        "devices": hw.devices,
        "model": "100 layers, d=8192, 64 heads (8 kv), ffn 28672, vocab 128256, seq 4096, global batch 1024",
        "memory_model": memory_model,
        "plan_s": t2 - t1,
        "plan_cpu_s": cpu2 - cpu1,  # the machine is shared: the planner's own CPU time beside the wall time
        "imports_and_shapes_s": t1 - t0,
        "considered": result.considered,
        "simulated": result.simulated,
        "memory_checked": result.memory_checked,
        "top": [c.to_dict() for c in result.candidates],
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    emit(out, a.json, echo=not a.json)
    print(
        f"planned {hw.devices} devices in {out['plan_s']:.1f} s, {out['plan_cpu_s']:.1f} s CPU "
        f"({result.simulated} simulated)",
        file=sys.stderr,
    )
    return 0

"""Checkpoint write time and bytes per rank: each rank writing its own shards (resilience/checkpoint.py, DCP)
against gathering the whole state to rank 0 and writing it there, in one run (JSON).

    .venv/bin/hybridpar bench checkpoint [--dp 4] [--zero 1,3] [--dim 512] [--layers 8] [--repeats 5]
                                         [--json FILE]

For each ZeRO level, one launch of dp local gloo ranks (tp = pp = 1) trains one step of a Llama model of
`--dim` and `--layers` (so the optimizer state exists), then saves `--repeats` times each way, alternating:
`sharded` is `save_checkpoint` as training calls it (each rank writes only what it holds: its slices of the
optimizer state, and under ZeRO-3 of the parameters; replicated parameters are written once, DCP spreading
them over the ranks); `gather` collects the whole parameters and optimizer state on rank 0 (ZeRO's slices
all-gathered) and rank 0 writes them alone through the same DCP save and commit — what a checkpoint
without sharding costs. Each record gives
the median wall time of a save (the slowest rank's, including the commit), the bytes the fullest rank
wrote, and both ratios (sharded / gather), with the load average (1 min) at the launch's start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from hybridpar.bench import emit
from hybridpar.config import Config
from hybridpar.topology.spawn import run_ranks


def _config(dp: int, zero: int, dim: int, layers: int) -> Config:
    cfg = Config()
    m, p, t = cfg.model, cfg.parallel, cfg.train
    p.tp, p.pp, p.dp, p.zero = 1, 1, dp, zero
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = dim, layers, 8, 4, 4 * dim
    t.global_batch, t.microbatches, t.seq_len, t.val_every = dp, 1, 64, 0
    return cfg


def _rank_bytes(ckpt: Path, rank: int) -> int:
    """Bytes of the files rank `rank` wrote into a DCP directory (`__<rank>_<n>.distcp`)."""
    return sum(f.stat().st_size for f in ckpt.glob(f"__{rank}_*.distcp"))


def _gather_save(tr, root: Path, step: int) -> Path:  # noqa: ANN001 - a Trainer, imported in the worker
    """The whole state on rank 0, written by rank 0 alone (collective: the gathers)."""
    import torch

    from hybridpar.dataparallel.zero import full_optimizer_state
    from hybridpar.resilience.checkpoint import write_committed

    whole = full_optimizer_state(tr.opt)
    if tr.zero3 is not None:
        tr.zero3.gather_all()
    state: dict[str, torch.Tensor] = {}
    if tr.topo.rank == 0:
        for s, st in tr.stages.items():
            for name, p in st.named_parameters():
                state[name] = p.detach().clone()
                for k, v in whole[p].items():
                    state[f"optim/{name}/{k}"] = v
    if tr.zero3 is not None:
        tr.zero3.release()
    # The same commit as the sharded save (manifest, fsyncs, rename): only who writes what differs.
    return write_committed(tr.topo, state, root / "gather", step, {"step": step}, 1, lambda phase: None)


def _worker(cfg_dict: dict, repeats: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from hybridpar.resilience.checkpoint import save_checkpoint
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    topo = build_topology(p.dp, p.pp, p.tp, "gloo", 600.0)
    tr = Trainer(cfg, topo)
    tr.step(0)
    times: dict[str, list[float]] = {"sharded": [], "gather": []}
    fullest: dict[str, int] = {}
    base = Path(root)
    for i in range(repeats):
        for way in ("sharded", "gather") if i % 2 == 0 else ("gather", "sharded"):
            dist.barrier()
            t0 = time.perf_counter()
            if way == "sharded":
                ckpt = save_checkpoint(topo, tr.stages, tr.opt, base / "sharded", i + 1, {"step": i + 1}, keep=1)
            else:
                ckpt = _gather_save(tr, base, i + 1)
            # The slowest rank's time, the fullest rank's bytes (a max over ranks: no pickled objects).
            v = torch.tensor([time.perf_counter() - t0, float(_rank_bytes(ckpt, topo.rank))], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            times[way].append(float(v[0]))
            fullest[way] = int(v[1])
    return {"times": times, "fullest_bytes": fullest}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--zero", default="1,3", help="ZeRO levels, comma-separated (one launch each)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="saves each way per launch, alternating")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    records = []
    for zero in (int(z) for z in a.zero.split(",")):
        cfg = _config(a.dp, zero, a.dim, a.layers)
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="hybridpar-bench-ckpt-") as root:
            got = run_ranks(_worker, a.dp, cfg.to_dict(), a.repeats, root, timeout_s=600)[0]
        t = {k: statistics.median(v) for k, v in got["times"].items()}
        b = got["fullest_bytes"]
        records.append(
            {
                "dp": a.dp,
                "zero": zero,
                "dim": a.dim,
                "layers": a.layers,
                "repeats": a.repeats,
                "sharded_s": t["sharded"],
                "gather_s": t["gather"],
                "sharded_saves_s": got["times"]["sharded"],
                "gather_saves_s": got["times"]["gather"],
                "time_ratio": t["sharded"] / t["gather"],
                "fullest_rank_bytes_sharded": b["sharded"],
                "fullest_rank_bytes_gather": b["gather"],
                "bytes_ratio": b["sharded"] / b["gather"],
                "target_ratio": 1 / a.dp + 0.10,
                "load_avg_1m": load,
            }
        )
    emit(records, a.json)
    return 0

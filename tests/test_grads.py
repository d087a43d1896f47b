"""Data-parallel gradient buckets start reducing during backward and change nothing in the math."""

from __future__ import annotations

import pytest
from test_equivalence import tiny_config

from hybridpar.topology.spawn import run_ranks

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _buckets(cfg_dict: dict, bucket_bytes: int | None) -> dict:
    from hybridpar.config import Config
    from hybridpar.dataparallel.grads import DataParallelGrads
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer
    from hybridpar.trainer.export import gather_full_state, params_digest

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    topo = build_topology(p.dp, p.pp, p.tp, "gloo", 60)
    tr = Trainer(cfg, topo)
    if bucket_bytes is None:  # reduce whole stages only after their last backward
        tr.dp.grads = DataParallelGrads(topo, tr.stages, None)
    else:
        tr.dp.grads = DataParallelGrads(topo, tr.stages, cfg.train.microbatches, bucket_bytes=bucket_bytes)
    losses = [tr.step(s)["loss"] for s in range(2)]
    state = gather_full_state(topo, tr.stages, tr.parts, cfg.model, tr.stage_ranks)
    n_buckets = sum(len(b) for b in tr.dp.grads._buckets.values())
    return {
        "losses": losses,
        "digest": params_digest(state.items()) if state else None,
        "overlapped": tr.dp.grads.overlapped,
        "buckets": n_buckets,
    }


def _both(cfg_dict: dict) -> list[dict]:
    """Small buckets, then whole stages: two trainers built from scratch, one after the other, in one
    launch (a launch costs ~5 s of four interpreters importing torch before their first step)."""
    return [_buckets(cfg_dict, 8 << 10), _buckets(cfg_dict, None)]


def test_buckets_overlap_backward_and_match_stage_reduction():
    cfg = tiny_config(parallel=dict(tp=1, pp=2, dp=2, schedule="1f1b")).to_dict()
    small, whole = zip(*run_ranks(_both, 4, cfg))  # per rank: (small, whole)
    assert small[0]["buckets"] > 2
    # every bucket but none is left to the end-of-stage fallback: all started inside the backward
    assert all(r["overlapped"] == 2 * r["buckets"] for r in small), small  # 2 steps
    assert all(r["overlapped"] == 0 for r in whole)
    assert small[0]["losses"] == whole[0]["losses"]
    assert small[0]["digest"] == whole[0]["digest"]

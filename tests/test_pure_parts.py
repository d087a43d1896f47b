"""Pure pieces of the engine: process layout, batch splitting, LR schedule, params digest, launch failures."""

from __future__ import annotations

import math
import os

import pytest
import torch

from hybridpar.batching.split import plan_batch, split_evenly
from hybridpar.config import ModelConfig, TrainConfig
from hybridpar.model.optim import lr_at
from hybridpar.model.registry import param_stages
from hybridpar.topology.mesh import AXES, ParallelDims
from hybridpar.topology.spawn import failure
from hybridpar.trainer.export import params_digest


def test_parallel_dims_coordinates_round_trip():
    dims = ParallelDims(dp=2, pp=3, tp=2, world_size=12)
    seen = set()
    for r in range(12):
        c = dims.coords(r)
        assert dims.rank_of(*c) == r
        seen.add(c)
    assert len(seen) == 12
    assert dims.coords(1) == (0, 0, 0, 1)  # tp is the fastest axis: tp peers are neighbours
    assert dims.coords(2) == (0, 1, 0, 0)
    cp = ParallelDims(dp=2, pp=1, tp=2, cp=2, world_size=8)  # cp next: its ring peers are near neighbours
    assert [cp.coord(r, "cp") for r in range(4)] == [0, 0, 1, 1] and cp.coords(5) == (1, 0, 0, 1)


def test_parallel_dims_named_axes():
    """Every axis is named once (AXES): shape, coordinates and moves along one axis follow from it."""
    dims = ParallelDims(dp=2, pp=3, tp=2, world_size=12)
    assert AXES == ("dp", "pp", "cp", "tp") and dims.shape == (2, 3, 1, 2)
    assert [dims.coord(7, a) for a in AXES] == list(dims.coords(7)) == [1, 0, 0, 1]
    assert dims.moved(7, pp=2) == dims.rank_of(1, 2, 0, 1) == 11
    assert dims.moved(7, pp=0, tp=0) == 6 and dims.moved(7) == 7
    with pytest.raises(ValueError, match=r"rank_of takes 4 coordinates \(dp, pp, cp, tp\), got 2"):
        dims.rank_of(1, 2)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dp=2, pp=2, tp=2, world_size=4), "dp × pp × cp × tp = 2 × 2 × 1 × 2 = 8 does not equal the world size 4"),
        (dict(dp=1, pp=1, tp=1, cp=0, world_size=1), "cp must be a positive integer"),
        (dict(dp=0, pp=2, tp=2, world_size=0), "dp must be a positive integer"),
    ],
)
def test_parallel_dims_rejects_bad_layouts(kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kw)


def test_parallel_dims_is_frozen():
    dims = ParallelDims(1, 1, 1, 1)
    with pytest.raises(Exception):
        dims.tp = 2  # type: ignore[misc]


def test_split_evenly_sums_and_orders():
    assert split_evenly(10, 4) == [3, 3, 2, 2]
    for total in range(1, 40):
        for parts in range(1, total + 1):
            s = split_evenly(total, parts)
            assert sum(s) == total and max(s) - min(s) <= 1 and len(s) == parts
    with pytest.raises(ValueError, match="cannot split 2 samples into 3"):
        split_evenly(2, 3)


def test_plan_batch_replicas_and_offsets():
    plan = plan_batch(11, 2, 4)
    assert plan.sizes == ((2, 2, 1, 1), (2, 1, 1, 1))
    assert plan.global_batch == 11 and plan.replica_offset(1) == 6
    explicit = plan_batch(10, 1, 4, microbatch_sizes=[4, 1, 2, 3])
    assert explicit.sizes == ((4, 1, 2, 3),)
    uneven = plan_batch(10, 2, 2, replica_sizes=[7, 3])
    assert uneven.sizes == ((4, 3), (2, 1)) and uneven.replica_offset(1) == 7
    with pytest.raises(ValueError, match="summing to 10"):
        plan_batch(10, 2, 2, replica_sizes=[6, 3])
    with pytest.raises(ValueError, match="4 positive sizes summing to 10"):
        plan_batch(10, 1, 4, microbatch_sizes=[4, 4, 1, 2])


def test_lr_schedule_warmup_then_cosine_to_min():
    t = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    assert lr_at(0, t) == pytest.approx(1e-4)
    assert lr_at(9, t) == pytest.approx(1e-3)
    assert lr_at(10, t) == pytest.approx(1e-3)
    assert lr_at(99, t) == pytest.approx(1e-4)
    mid = lr_at(10 + 89 // 2, t)
    assert 1e-4 < mid < 1e-3
    lrs = [lr_at(s, t) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), "cosine decay must not increase"
    assert not any(math.isnan(x) for x in lrs)


def test_params_digest_sensitive_to_values_names_and_order():
    a = [("x", torch.ones(3)), ("y", torch.zeros(2))]
    base = params_digest(a)
    assert base == params_digest([("x", torch.ones(3)), ("y", torch.zeros(2))])
    assert base != params_digest([("x", torch.ones(3)), ("y", torch.tensor([0.0, 1e-30]))])
    assert base != params_digest([("y", torch.zeros(2)), ("x", torch.ones(3))])
    assert base != params_digest([("x2", torch.ones(3)), ("y", torch.zeros(2))])


def test_param_stages():
    parts = [range(0, 2), range(2, 3), range(3, 4)]
    where = param_stages(ModelConfig(n_layers=4), parts)
    assert where["model.embed_tokens.weight"] == 0 and where["model.layers.1.self_attn.q_proj.weight"] == 0
    assert where["model.layers.2.mlp.up_proj.weight"] == 1
    assert where["model.layers.3.input_layernorm.weight"] == 2
    assert where["lm_head.weight"] == 2 and where["model.norm.weight"] == 2
    gpt2 = param_stages(ModelConfig(family="gpt2", n_layers=4), parts)  # learned positions: read first
    assert gpt2["transformer.wte.weight"] == 0 and gpt2["transformer.wpe.weight"] == 0
    assert gpt2["transformer.h.2.attn.c_attn.bias"] == 1 and gpt2["transformer.ln_f.bias"] == 2
    assert "lm_head.weight" not in gpt2  # tied: the head is the embedding


def test_launch_failure_names_a_rank_that_died_natively_first(tmp_path):
    """A rank killed by a signal writes no error file; its peers then fail on the lost connection. The
    report leads with the dead rank, its signal and its fault trace, then the peers' first error."""
    assert failure(tmp_path, {0: 0, 1: 0}) is None
    assert failure(tmp_path, {0: 0, 1: None}) is None  # still running when stopped: not a failure by itself
    (tmp_path / "rank2.fault").write_text("Fatal Python error: Aborted\n  File grads.py, line 160 in finish")
    (tmp_path / "rank0.err").write_text("RuntimeError: Read error: Connection reset by peer")
    (tmp_path / "rank3.err").write_text("RuntimeError: Connection closed by peer")
    os.utime(tmp_path / "rank3.err", ns=(2, 2))  # written after rank 0's (mtime 1 ns): the first is the cause
    os.utime(tmp_path / "rank0.err", ns=(1, 1))
    msg = failure(tmp_path, {0: 1, 1: None, 2: -6, 3: 1})
    head, peers = msg.split("\nthen ")
    assert head.startswith("rank2 died by SIGABRT without a Python error") and "line 160 in finish" in head
    assert peers.startswith("rank0 failed (then rank3):") and "Connection reset" in peers
    (tmp_path / "rank2.fault").write_text("")
    assert "rank2 died by SIGKILL without a Python error; no fault trace" in failure(tmp_path, {2: -9})
    assert failure(tmp_path, {1: 3}).startswith("rank1 exited with status 3 without a Python error")

"""parallel.grad_sum tree (dataparallel/tree.py) in process: a replica's microbatch gradients are summed
as the balanced tree over them, and the rules it needs are refused before launch, named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hybridpar.dataparallel.tree import TreeGrads
from hybridpar.model.reference import tiny_config
from hybridpar.pipeline.schedules.config_rules import validate_config


def _microbatch_grads(m: int) -> tuple[nn.Linear, list[torch.Tensor], torch.Tensor]:
    """A layer, each microbatch's own weight gradient, and the inputs (fixed seed)."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 64)
    xs = torch.randn(m, 8, 64) * torch.logspace(-3, 3, 64)  # magnitudes apart: the order shows in the ulps
    own = []
    for x in xs:
        layer.weight.grad = None
        layer(x).pow(2).sum().backward()
        own.append(layer.weight.grad.clone())
    layer.zero_grad(set_to_none=True)
    return layer, own, xs


def test_microbatches_are_summed_as_a_balanced_tree() -> None:
    layer, u, xs = _microbatch_grads(8)
    topo = SimpleNamespace(dims=SimpleNamespace(dp=1), dp_rank=0, rank=0, timeout_s=10.0)
    tree = TreeGrads(topo, {0: layer})
    for x in xs:
        layer(x).pow(2).sum().backward()
    tree.finish()
    pairs = [u[0] + u[1], u[2] + u[3], u[4] + u[5], u[6] + u[7]]
    want = (pairs[0] + pairs[1]) + (pairs[2] + pairs[3])
    assert torch.equal(layer.weight.grad, want)
    in_order = u[0].clone()
    for g in u[1:]:
        in_order += g
    assert not torch.equal(in_order, want)  # the inputs make the two orders differ: the test can fail
    tree.close()


@pytest.mark.parametrize(
    ("parallel", "train", "words"),
    [
        (dict(dp=3, pp=1, tp=1), dict(global_batch=12, microbatches=2), "parallel.dp must be a power of two, got 3"),
        (dict(dp=2, pp=1, tp=1), dict(global_batch=12, microbatches=3), "train.microbatches must be a power of two"),
        (dict(dp=2, pp=1, tp=1), dict(global_batch=10, microbatches=2), "multiple of parallel.dp × train.microbatches"),
        (dict(dp=2, pp=1, tp=1, zero=1), dict(global_batch=8, microbatches=2), "cannot run with parallel.zero"),
        (dict(dp=1, pp=2, tp=1, schedule="zb-h1"), dict(global_batch=8, microbatches=4), "backward is not split"),
    ],
)
def test_what_the_tree_needs_is_refused_before_launch(parallel: dict, train: dict, words: str) -> None:
    cfg = tiny_config(parallel=dict(parallel, grad_sum="tree"), train=train)
    with pytest.raises(ValueError, match="parallel.grad_sum=tree") as e:
        validate_config(cfg, cfg.parallel.world_size)
    assert words in str(e.value)

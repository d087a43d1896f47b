"""bf16 working copies (`--train.bf16_weights copies`, dataparallel/copies.py) without processes: what a rank
holds (bf16 parameters, fp32 gradients, fp32 masters and moments), the step, the checkpoint's tensors and the
refusals before launch. The layouts against one device are in tests/test_precision.py's launches."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hybridpar.config import Config
from hybridpar.dataparallel.copies import MasterAdamW
from hybridpar.model.reference import tiny_config
from hybridpar.model.registry import build_full_model
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.resilience.checkpoint import _opt_state, _param_shards, _tensors

COPIES = dict(precision="bf16", bf16_weights="copies")


def _one_rank() -> SimpleNamespace:
    """The Topology fields a dp-1 MasterAdamW reads (it all-gathers nothing)."""
    return SimpleNamespace(dims=SimpleNamespace(dp=1), dp_rank=0, timeout_s=10.0, group=lambda name: None)


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())


def test_a_rank_holds_bf16_weights_fp32_grads_and_fp32_masters() -> None:
    cfg = tiny_config(train=COPIES)
    model = build_full_model(cfg.model, 0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MasterAdamW(list(model.named_parameters()), cfg.train, _one_rank())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(q.dtype == torch.float32 for q in opt.views)
    assert all(torch.equal(q, start[n]) for (n, _), q in zip(model.named_parameters(), opt.views))
    x = torch.randint(0, cfg.model.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    parts = []
    for half in x.tensor_split(2):  # two microbatches: each bf16 weight gradient widened, summed in fp32
        _loss(model, half).backward()
        parts.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, parts[1][n]), n
    opt.step()
    for p, q in zip(model.parameters(), opt.views):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q.to(torch.bfloat16))
    moved = [n for (n, _), q in zip(model.named_parameters(), opt.views) if not torch.equal(q, start[n])]
    assert len(moved) == len(start)
    # What a checkpoint writes under each parameter's name: its fp32 master, never the bf16 copy.
    written = {k: t for k, t, _ in _tensors({0: model}, _opt_state(opt), False, _param_shards(opt))}
    for (n, _), q in zip(model.named_parameters(), opt.views):
        assert written[n].dtype == torch.float32 and torch.equal(written[n], q)
    opt.widen()  # the end of a run: the exported model is the masters
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), opt.views))


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(train=dict(bf16_weights="copies")), "train.bf16_weights=copies needs train.precision=bf16, got fp32"),
        (dict(train=COPIES, parallel=dict(zero=2, dp=2)), "it cannot run with parallel.zero=2"),
        (dict(train=COPIES | dict(compile=True)), "it cannot run with train.compile"),
        (dict(train=COPIES, balance=dict(mode="auto")), "it cannot run with balance.mode=auto"),
        (dict(train=COPIES, parallel=dict(cp=2, dp=1, pp=1)), "it cannot run with parallel.cp=2"),
    ],
)
def test_copies_refuse_what_they_do_not_run_before_launch(over: dict, message: str) -> None:
    cfg = Config.from_dict({k: v for k, v in over.items()})
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config(cfg, cfg.parallel.world_size)

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
from hybridpar.dataparallel.tree import TreeGrads
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


def test_a_rebuilt_optimizer_takes_the_carried_masters_not_the_bf16_copies() -> None:
    """What a layer move carries (gather_state: the AdamW state and the whole fp32 master of each parameter)
    rebuilds the optimizer with the very masters and moments: the bf16 parameters alone would round them."""
    cfg = tiny_config(train=COPIES)
    model = build_full_model(cfg.model, 0)
    opt = MasterAdamW(list(model.named_parameters()), cfg.train, _one_rank())
    x = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    _loss(model, x).backward()
    opt.step()
    masters = [q.detach().clone() for q in opt.views]
    assert any(not torch.equal(q, q.to(torch.bfloat16).float()) for q in masters)  # finer than bf16
    carry = opt.gather_state()
    again = MasterAdamW(list(model.named_parameters()), cfg.train, _one_rank(), carry=carry)
    for p, q, m in zip(model.parameters(), again.views, masters):
        assert torch.equal(q, m) and torch.equal(p, m.to(torch.bfloat16))
        assert set(again.state[q]) == {"step", "exp_avg", "exp_avg_sq"}  # the master is no AdamW state


def test_copies_need_bf16_and_run_with_zero3_the_tree_sum_and_compile() -> None:
    """What working copies once refused (ZeRO-3, the tree gradient sum, compile) validates; their runs against
    one-device working copies: tests/test_precision.py's layouts."""
    cfg = Config.from_dict(dict(train=dict(bf16_weights="copies")))
    with pytest.raises(ValueError, match=re.escape("train.bf16_weights=copies needs train.precision=bf16, got fp32")):
        validate_config(cfg, cfg.parallel.world_size)
    for over in (
        dict(parallel=dict(zero=3, dp=2)),
        dict(parallel=dict(grad_sum="tree", dp=2), train=dict(global_batch=8, microbatches=2)),
        dict(train=dict(compile=True)),
    ):
        cfg = Config.from_dict({**over, "train": COPIES | over.get("train", {})})
        validate_config(cfg, cfg.parallel.world_size)


def test_the_tree_sums_the_widened_microbatch_gradients() -> None:
    """parallel.grad_sum tree over bf16 working copies: each microbatch's bf16 weight gradient arrives widened
    to fp32 (grad_dtype), and the tree adds those fp32 gradients in its fixed order — the sum the tree gives
    fp32 parameters, from the same microbatch gradients."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 32).to(torch.bfloat16)
    layer.weight.grad_dtype = layer.bias.grad_dtype = torch.float32
    xs = (torch.randn(4, 8, 32) * torch.logspace(-2, 2, 32)).to(torch.bfloat16)
    own = []
    for x in xs:
        layer(x).float().pow(2).sum().backward()
        own.append(layer.weight.grad.clone())
        layer.zero_grad(set_to_none=True)
    topo = SimpleNamespace(dims=SimpleNamespace(dp=1), dp_rank=0, rank=0, timeout_s=10.0)
    tree = TreeGrads(topo, {0: layer})
    for x in xs:
        layer(x).float().pow(2).sum().backward()
    tree.finish()
    assert all(g.dtype == torch.float32 for g in own)
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, (own[0] + own[1]) + (own[2] + own[3]))
    tree.close()

"""Activation recomputation (model/recompute.py): full and selective train bit-for-bit the model that
no recomputation trains — alone, under the zero-bubble B/W split, and across (tp, pp, dp) layouts —
while the activations held for backward (pipeline/activation_meter.py's meter) shrink."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_equivalence import _worker, grid_config, tiny_config

from hybridpar.config import Config
from hybridpar.model import recompute
from hybridpar.model.registry import build_full_model
from hybridpar.pipeline.activation_meter import ActivationMeter
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.pipeline.split_backward import WeightGradDeferral
from hybridpar.topology.spawn import run_ranks

MODES = ("none", "full", "selective")


def small_model(family: str) -> Config:
    cfg = tiny_config()
    cfg.model.n_layers = 3
    if family == "gpt2":
        cfg.model.family, cfg.model.n_kv_heads, cfg.model.n_positions = "gpt2", None, 64
    return cfg


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (3, 40), generator=g), torch.randint(0, 256, (3, 40), generator=g)


def _train_grads(cfg: Config, mode: str, split: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of two microbatches (plain backward, or the zero-bubble B then W) and the meter's peak."""
    model = build_full_model(cfg.model, 0)
    model.recompute = mode
    meter = ActivationMeter()
    meter.reset(model.parameters())
    deferral = WeightGradDeferral(model) if split else None
    losses = []
    for m in range(2):
        x, y = _batch(m)
        if deferral is not None:
            deferral.key = (0, m)
        with meter.measuring():
            losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        if deferral is not None:
            deferral.key = None
    for m, loss in enumerate(losses):  # both forwards before any backward: both held at the peak
        if deferral is None:
            loss.backward()
        else:
            deferral.backward_input(loss, None, None, (0, m))
    for m in range(2):
        if deferral is not None:
            deferral.weight((0, m))
    assert meter.live == 0, "everything held for backward is released after it"
    return {n: p.grad for n, p in model.named_parameters()}, meter.peak


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("split", [False, True], ids=["backward", "zero-bubble-B-W"])
def test_recompute_is_bit_identical_and_holds_less(family: str, split: bool) -> None:
    cfg = small_model(family)
    runs = {mode: _train_grads(cfg, mode, split) for mode in MODES}
    ref, _ = _train_grads(cfg, "none", False)
    for mode, (grads, _) in runs.items():
        for name, g in ref.items():
            assert torch.equal(grads[name], g), f"{family} {mode} split={split}: gradient of {name} differs"
    peak = {mode: p for mode, (_, p) in runs.items()}
    # Full keeps one (B, T, d) input per layer; selective the matmul outputs; none everything.
    assert peak["full"] < peak["selective"] < peak["none"], peak


def test_selective_without_the_policy_seeing_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch before 2.13 gives the selective policy no op output (a GPU image with torch 2.11 failed on
    it): the recording dispatch mode keeps the same tensors, so gradients and the meter's peak match."""
    cfg = small_model("llama")
    grads, peak = _train_grads(cfg, "selective", False)
    monkeypatch.setattr(recompute, "_POLICY_SEES_OUTPUT", False)
    grads_old, peak_old = _train_grads(cfg, "selective", False)
    assert peak_old == peak
    assert all(torch.equal(grads_old[n], g) for n, g in grads.items())


def test_evaluation_and_serving_do_not_recompute() -> None:
    cfg = small_model("llama")
    model = build_full_model(cfg.model, 0)
    x, _ = _batch(0)
    with torch.no_grad():
        plain = model(x)
        model.recompute = "full"
        assert torch.equal(model(x), plain)
    assert model.recompute_phase is None


@pytest.mark.parametrize(
    "value,pp,message",
    [
        ("fulll", 2, "train.recompute='fulll' is not one of none, full, selective (did you mean 'full'?)"),
        ("full,none,full", 2, "train.recompute has 3 entries but parallel.pp × parallel.virtual_stages = 2 × 1"),
        ("full,some", 2, "train.recompute entry 1 (stage 1)='some' is not one of none, full, selective"),
    ],
)
def test_bad_recompute_is_refused(value: str, pp: int, message: str) -> None:
    cfg = tiny_config(parallel=dict(tp=1, pp=pp, dp=1), train=dict(recompute=value))
    with pytest.raises(ValueError) as e:
        validate_config(cfg, pp)
    assert message in str(e.value)


def test_recompute_per_stage() -> None:
    cfg = tiny_config(parallel=dict(tp=1, pp=2, dp=1, schedule="interleaved-1f1b", virtual_stages=2))
    cfg.train.recompute = "full,none,selective,none"
    validate_config(cfg, 2)
    assert cfg.train.recompute_modes(4) == ["full", "none", "selective", "none"]
    cfg.train.recompute = "selective"
    assert cfg.train.recompute_modes(4) == ["selective"] * 4


RECOMPUTE_LAYOUTS = [(2, 2, 1, "1f1b"), (1, 2, 2, "1f1b"), (1, 4, 1, "zb-h1")]


def _modes(pp: int) -> list[str]:
    mixed = ",".join(["full", "selective", "none", "full"][:pp])  # one mode per stage
    return ["none", "full", "selective", mixed]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """Every layout's runs in one launch (all are 4 ranks): a launch costs ~5 s of interpreters importing
    torch before its first step, more than a layout's four 3-step runs. Each run trains its own directory
    from scratch; each test compares only its own layout's runs."""
    out = tmp_path_factory.mktemp("recompute-layouts")
    # 4 layers, one a stage at pp4 (each stage its own mode in the mixed runs): bit identity does not
    # depend on depth.
    four = dict(n_layers=4)
    cfgs = [
        grid_config(pp, schedule, 1, model=four, parallel=dict(tp=tp, pp=pp, dp=dp), train=dict(recompute=m))
        for tp, pp, dp, schedule in RECOMPUTE_LAYOUTS
        for m in _modes(pp)
    ]
    assert {c.parallel.world_size for c in cfgs} == {4}
    return out, run_ranks(_worker, 4, [c.to_dict() for c in cfgs], str(out), timeout_s=400)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "tp,pp,dp,schedule", RECOMPUTE_LAYOUTS, ids=[f"tp{a}-pp{b}-dp{c}-{s}" for a, b, c, s in RECOMPUTE_LAYOUTS]
)
def test_recompute_layouts_bit_identical(tp: int, pp: int, dp: int, schedule: str, layout_runs) -> None:
    """fp32: the loss of every step and every parameter after 3 AdamW steps exactly equal to no
    recomputation's, in the same layout (tensor-parallel all-reduces rerun in backward included)."""
    out, all_results = layout_runs
    modes = _modes(pp)
    first = sum(len(_modes(lay[1])) for lay in RECOMPUTE_LAYOUTS[: RECOMPUTE_LAYOUTS.index((tp, pp, dp, schedule))])
    results = all_results[first : first + len(modes)]
    ref_losses, ref_val = results[0]
    ref_state = torch.load(out / f"state{first}.pt", weights_only=True)
    for i, mode in enumerate(modes[1:], start=1):
        losses, val = results[i]
        assert losses == ref_losses and val == ref_val, f"recompute={mode}: losses {losses} vs {ref_losses}"
        state = torch.load(out / f"state{first + i}.pt", weights_only=True)
        for name, ref in ref_state.items():
            assert torch.equal(state[name], ref), f"recompute={mode}: {name} differs from no recomputation"

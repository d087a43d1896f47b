"""The adaptive microbatch policy inside the trainer: measured activation memory under a budget, an
(emulated) out-of-memory redone with smaller microbatches, and the math unchanged throughout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_equivalence import check_layouts, tiny_config

from hybridpar.config import Config
from hybridpar.pipeline.activation_meter import ActivationMeter
from hybridpar.topology.spawn import run_ranks

STEPS = 10


def _records(run_dir: str) -> list[dict]:
    return [r for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl")) if "final" not in r]


def _budget_and_oom_runs(base: dict, out: str) -> dict:
    from hybridpar.run.train import train

    def run(name: str, **batching) -> list[dict]:
        cfg = Config.from_dict(base)
        cfg.run_dir = f"{out}/{name}"
        for k, v in batching.items():
            setattr(cfg.emulate if k == "memory_limit" else cfg.batching, k, v)
        train(cfg, log=False)
        dist.barrier()  # rank 0 has closed metrics.jsonl
        return _records(cfg.run_dir)

    fixed = run("fixed")  # 2 microbatches of 4 under 1F1B, pp=2: stage 0 holds both, 8 samples
    per_sample = max(r["activation_peak_bytes"] for r in fixed) / 8
    # Smallest split (8 x 1): 2 samples in flight; 4 x 2: 4 samples; 3, 3, 2: 6 samples; 2 x 4: 8 samples.
    budget = int(4.5 * per_sample)  # just above the second-smallest split
    # One measured step per block, none unmeasured: every split is reached within the 10 steps whatever
    # the machine's load (a block whose readings disagree is measured on, which depends on timing).
    quick = dict(policy="adaptive", steps_per_candidate=1, warmup_steps=0)
    budgeted = run("budget", memory_budget=float(budget), **quick)
    oom = run("oom", memory_limit=int(5 * per_sample), **quick)
    return {"fixed": fixed, "budget": budgeted, "budget_bytes": budget, "oom": oom}


@pytest.mark.multiprocess
def test_budget_holds_oom_is_redone_and_losses_equal_the_fixed_split(two_rank_runs: dict) -> None:
    res = two_rank_runs["budget"]
    fixed, budgeted, oom, budget = res["fixed"], res["budget"], res["oom"], res["budget_bytes"]
    for name, recs in (("budget", budgeted), ("oom", oom)):
        assert [r["step"] for r in recs] == list(range(STEPS)), f"{name}: a step was skipped or repeated"
        for a, b in zip(recs, fixed):
            assert abs(a["loss"] - b["loss"]) <= 1e-6, f"{name} step {a['step']}: {a['loss']} vs fixed {b['loss']}"
    # The budget: never exceeded, and the policy did move past the smallest microbatches.
    assert max(r["activation_peak_bytes"] for r in budgeted) <= budget
    splits = [tuple(r["microbatches"]) for r in budgeted]
    assert splits[0] == (1,) * 8 and (2,) * 4 in splits and (4, 4) not in splits, splits
    # Measured, not modelled: more samples per microbatch hold more activation bytes.
    peak = {tuple(r["microbatches"]): r["activation_peak_bytes"] for r in budgeted}
    assert peak[(1,) * 8] < peak[(2,) * 4] < fixed[0]["activation_peak_bytes"]
    # The emulated limit: the first split over it, 3 microbatches (3 + 3 samples in flight), runs out of
    # memory once; the step is redone with the best measured split that fits (8 x 1 or 4 x 2), and
    # neither it nor 2 x 4 (8 samples in flight) is tried again.
    failed = [r for r in oom if "oom" in r]
    assert len(failed) == 1 and failed[0]["oom"][0]["microbatches"] == [3, 3, 2], failed
    assert tuple(failed[0]["microbatches"]) in ((1,) * 8, (2,) * 4)
    assert all(tuple(r["microbatches"]) not in ((4, 4), (3, 3, 2)) for r in oom)


@pytest.mark.multiprocess
def test_adaptive_split_changing_every_step_matches_single_device(tmp_path: Path) -> None:
    """dp=2 x pp=2, unequal replicas (6/5): every step runs another microbatch count."""
    cfg = tiny_config(
        parallel=dict(tp=1, pp=2, dp=2, schedule="1f1b"),
        batching=dict(policy="adaptive", steps_per_candidate=1, warmup_steps=0),
    )
    check_layouts([cfg], tmp_path)


def test_meter_counts_storages_once_and_releases_with_the_graph() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    meter = ActivationMeter()
    meter.reset([w])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.measuring():
        y = (x @ w).tanh()  # saves x (matmul; w excluded) and y (tanh)
        z = y * y  # saves y again: same storage
    assert meter.live == meter.peak == 2 * 4 * 8 * 4
    z.sum().backward()
    assert meter.live == 0 and meter.peak == 2 * 4 * 8 * 4


def test_meter_limit_raises_out_of_memory() -> None:
    meter = ActivationMeter(limit_bytes=100)
    x = torch.randn(64, requires_grad=True)
    with meter.measuring():
        try:
            x.tanh()
        except torch.OutOfMemoryError as e:
            assert "memory_limit=100" in str(e)
        else:
            raise AssertionError("a 256-byte save under a 100-byte limit must fail")


def _resume_runs(base: dict, out: str) -> dict:
    from hybridpar.run.train import train

    def run(steps: int, **ck) -> None:
        cfg = Config.from_dict(base)
        cfg.run_dir, cfg.train.steps, cfg.checkpoint.every = out, steps, 3
        for k, v in ck.items():
            setattr(cfg.checkpoint, k, v)
        train(cfg, log=False)
        dist.barrier()

    run(3)  # checkpoint after step 3, mid-scan
    state = json.loads((Path(out) / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    run(7, resume="auto")
    final = [r for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if "final" in r][-1]
    return {"policy": state["batching_policy"], "records": _records(out), "final": final}


@pytest.mark.multiprocess
def test_resume_goes_on_with_the_adaptive_policy_measurements(two_rank_runs: dict) -> None:
    """dp=2 with unequal replicas (6/5): both model the largest replica, so the checkpoint's one policy
    state is every rank's; the resumed run proposes the split the policy was at and keeps its history."""
    r = two_rank_runs["resume"]
    saved, recs = r["policy"], r["records"]
    assert saved["replicas"] == [6, 5] and len(saved["recorder"]["history"]) == 3
    assert [x["step"] for x in recs] == [0, 1, 2, 3, 4, 5, 6]
    first_resumed = recs[3]["microbatches"]  # rank 0's replica: 6 samples
    assert len(first_resumed) == saved["current"] and saved["current"] not in [len(x["microbatches"]) for x in recs[:3]]
    hist = r["final"]["batching"]["history"]
    assert hist[:3] == saved["recorder"]["history"] and len(hist) > 3


def _both(budget: dict, resume: dict, out: str) -> dict:
    """The two 2-rank tests' runs in turn, each in its own directory from scratch."""
    return {"budget": _budget_and_oom_runs(budget, f"{out}/budget"), "resume": _resume_runs(resume, f"{out}/resume")}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Rank 0's results of the budget/OOM runs and of the resumed adaptive run, from one launch (a launch
    costs ~2.5 s of two interpreters importing torch before their first step)."""
    budget = tiny_config(
        parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b"),
        train=dict(global_batch=8, microbatches=2, steps=STEPS, val_every=0),
    )
    resume = tiny_config(
        parallel=dict(tp=1, pp=1, dp=2, schedule="gpipe"),
        train=dict(val_every=0),
        batching=dict(policy="adaptive", steps_per_candidate=1, warmup_steps=0),
    )
    out = tmp_path_factory.mktemp("two-rank")
    return run_ranks(_both, 2, budget.to_dict(), resume.to_dict(), str(out), timeout_s=300)[0]

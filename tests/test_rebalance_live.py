"""The balancer in a running job (`--balance.mode auto`): an emulated slow rank loses layers within a
few steps, gets them back when it recovers, every decision and its measured outcome are logged in
metrics.jsonl, and the model trained is still the one-device model (<= 1e-5)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hybridpar.config import Config
from hybridpar.topology.spawn import run_ranks
from tests.test_equivalence import TOL, ref_for, tiny_config

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _worker(cfg_dict: dict, out: str) -> tuple[list[float], list[float]]:
    """The run, then (same launch) the run resumed from its checkpoint (after step 14) to the same end."""
    from hybridpar.run.train import train

    cfg = Config.from_dict(cfg_dict)
    cfg.run_dir = str(Path(out) / "run")
    res = train(cfg, log=False)
    if res.state is not None:  # rank 0: keep what the resumed run will cut back to its step
        torch.save(res.state, Path(out) / "state.pt")
        shutil.copy(Path(cfg.run_dir) / "metrics.jsonl", Path(out) / "metrics.jsonl")
    cfg.checkpoint.resume, cfg.checkpoint.every = "auto", 0
    return res.losses, train(cfg, log=False).losses


def test_slow_rank_loses_layers_and_gets_them_back(tmp_path: Path) -> None:
    onset, recovery, steps = 7, 16, 25
    cfg = tiny_config(
        parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b", partition="uniform"),
        train=dict(steps=steps, val_every=steps, monitor_every=0),
        # Emulated fixed layer cost, rank 1 three times slower for steps onset..recovery-1, and the policy
        # reading the emulated cost of each action: on a loaded machine a sleep's late wake-up and the real
        # compute (the head's too) outgrow a small stage's cost and would read as a slow device (at load 8-17
        # the move back chose [0, 5], [5, 8]); step times (the measured outcome) stay measured.
        emulate=dict(
            layer_ms=2.0,
            slowdown=f"rank=1:3.0@step={onset},rank=1:1.0@step={recovery}",
            layer_timing="emulated",
        ),
        balance=dict(mode="auto", interval=4, window=3, patience=2, threshold=1.6),
        # One checkpoint, after step 14: between the move away (by step 13) and the move back (after 16).
        checkpoint=dict(every=14),
    )
    cfg.run_dir = str(tmp_path / "run")
    losses, resumed = run_ranks(_worker, 2, cfg.to_dict(), str(tmp_path), timeout_s=240)[0]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = [e for r in rows if "balance" in r for e in r["balance"]]
    decisions = [e for e in events if e["event"] == "rebalance"]
    assert len(decisions) == 2, decisions
    away, back = decisions
    assert away["applied"] and away["stragglers"] == [1] and "a straggler appeared; position 1 " in away["reason"]
    assert onset < away["step"] <= onset + 6  # confirmed over balance.persist (2) windows of 3 readings
    sizes = [[b - a for a, b in p] for p in away["new"]["parts"]]
    assert sizes[0][1] < 4 and away["old"]["parts"] == [[[0, 4], [4, 8]]]
    assert away["predicted_step_after_s"] < away["predicted_step_before_s"]
    assert back["applied"] and back["stragglers"] == [] and "recovered" in back["reason"]
    assert recovery < back["step"] and back["new"]["parts"] == [[[0, 4], [4, 8]]]
    assert back["step"] - away["step"] >= 4  # never more often than balance.interval
    assert away["move"]["layers_sent"] > 0 or away["move"]["layers_received"] > 0
    measured = [e for e in events if e["event"] == "rebalance_measured"]
    # Each applied decision is followed, balance.window steps later, by its measured step time.
    assert [m["step"] for m in measured] == [d["step"] for d in decisions if d["step"] + 3 < steps]
    # Moving work off the 3x slow rank shortened the bottleneck's compute per step, as predicted: before, rank
    # 1's 4 layers at 3x, 11 samples, forward 2 ms and backward 4 ms a layer and sample (the emulated time).
    # (The measured step, with the real compute in it, falls too on a quiet machine; at load 8-17 that
    # compute outgrows the 2 ms layers, and the step's time is the load's.)
    m = measured[0]
    assert m["measured_bottleneck_before_s"] == pytest.approx(3.0 * 4 * 11 * 6e-3)
    assert m["measured_bottleneck_after_s"] < m["measured_bottleneck_before_s"] and m["measured_step_after_s"] > 0

    ref_losses, _, ref_state = ref_for(cfg)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    # The restart keeps its balance: it starts from the partition the checkpoint recorded, says so, and
    # trains on exactly (its losses are the one-device ones of steps 14 to the end).
    said = [json.loads(x) for x in (tmp_path / "run" / "resilience.jsonl").read_text().splitlines()]
    layout = [e for e in said if e["event"] == "layout"]
    assert len(layout) == 1 and layout[0]["source"] == "checkpoint" and layout[0]["step"] == 14, layout
    assert layout[0]["layout"]["parts"] == away["new"]["parts"] != away["old"]["parts"]
    assert len(resumed) == steps - 14 and max(abs(a - b) for a, b in zip(resumed, ref_losses[14:])) <= TOL
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    for name, ref in ref_state.items():
        assert (state[name] - ref).abs().max().item() <= TOL, name

"""`--profile.steps`: torch.profiler over the chosen steps on every rank, Chrome traces that are valid JSON
with the pipeline's action ranges in them, and the training unchanged; bad step ranges are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridpar.config import Config, parse_args
from hybridpar.pipeline.schedules.config_rules import validate_config
from tests.references import ref_for
from tests.test_equivalence import TOL, tiny_config


@pytest.mark.parametrize(
    "value, message",
    [
        ("7-5", "profile.steps='7-5' must be a step or a range of steps like '5-7'"),
        ("five", "profile.steps='five' must be a step"),
        ("5-9", "profile.steps='5-9' reaches past the run's last step 7 (train.steps=8"),
    ],
)
def test_bad_profile_steps_are_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_config(parse_args(["--train.steps", "8", "--profile.steps", value]))


def test_trace_steps_are_checked_too() -> None:
    with pytest.raises(ValueError, match="profile.trace_steps='2-' must be a step"):
        validate_config(parse_args(["--profile.trace_steps", "2-"]))


def _worker(cfg_dict: dict) -> list[float]:
    from hybridpar.run.train import train

    return train(Config.from_dict(cfg_dict), log=False).losses


@pytest.mark.multiprocess
def test_profiled_steps_give_chrome_traces_with_our_action_ranges(tmp_path: Path) -> None:
    from hybridpar.topology.spawn import run_ranks

    cfg = tiny_config(parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b"), train=dict(steps=4, val_every=4))
    cfg.profile.steps = "1-2"
    cfg.run_dir = str(tmp_path / "run")
    losses = run_ranks(_worker, 2, cfg.to_dict(), timeout_s=240)[0]
    ref_losses, _, _ = ref_for(cfg)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL  # profiling changes no math
    for rank, stage in ((0, 0), (1, 1)):
        trace = json.loads((tmp_path / "run" / "profile" / f"rank{rank}.json").read_text())
        names = [e.get("name") for e in trace["traceEvents"]]
        # 4 microbatches: each F and B of this rank's stage once per profiled step, two steps.
        for mb in range(4):
            assert names.count(f"F{stage}.{mb}") == 2 and names.count(f"B{stage}.{mb}") == 2, (rank, mb)
        sends = "SEND_F0.0" if stage == 0 else "SEND_B1.0"
        assert names.count(sends) == 2
        assert any(n and n.startswith("aten::mm") for n in names)  # the operators under the ranges


def test_memory_snapshot_needs_profiled_steps() -> None:
    with pytest.raises(ValueError, match="profile.memory records the allocator over profile.steps, which is empty"):
        validate_config(parse_args(["--profile.memory", "true"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_memory_snapshot_is_refused_before_launch_without_cuda(tmp_path: Path) -> None:
    from hybridpar.run.preflight import preflight

    cfg = tiny_config(parallel=dict(tp=1, pp=1, dp=1), profile=dict(steps="1", memory=True))
    cfg.run_dir = str(tmp_path / "run")
    with pytest.raises(ValueError, match="profile.memory snapshots the CUDA caching allocator, and this run is on CPU"):
        preflight(cfg, 1, verify=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's history exists on CUDA only")
def test_memory_snapshot_is_json_with_the_allocations(tmp_path: Path) -> None:
    from hybridpar.report.profile import StepProfiler

    class Runtime:
        profiling = False

    prof = StepProfiler(range(0, 1), tmp_path, 0, torch.device("cuda"), memory=True)
    prof.before(0, Runtime())
    x = torch.ones(1 << 20, device="cuda")
    del x
    prof.after(0, Runtime())
    snap = json.loads(prof.memory_path.read_text())
    events = [e for dev in snap["device_traces"] for e in dev]
    assert any(e["action"] == "alloc" and e["size"] >= 4 << 20 for e in events), events[:5]

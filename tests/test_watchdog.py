"""The heartbeat watchdog on live ranks (spawn helper): a SIGSTOPped rank and a rank whose main thread hangs
are named within hang_timeout_s + 5 s and the run aborts with the watchdog's exit code — and a clean run
with a slow checkpoint write and a slow validation raises no alarm."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridpar.config import Config
from hybridpar.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
from test_equivalence import tiny_config  # noqa: E402

TIMEOUT_S = 2.0


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _train(cfg_dict: dict) -> dict:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.train import train

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    res = train(cfg, build_topology(p.dp, p.pp, p.tp, "gloo", p.timeout_s), log=False)
    return {"digest": res.digest, "losses": res.losses}


def _config(tmp_path: Path, fault: str, **train) -> Config:
    cfg = tiny_config(train={"steps": 4, "val_every": 0, "monitor_every": 0, **train},
                      parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b", timeout_s=60.0),
                      resilience=dict(hang_timeout_s=TIMEOUT_S, heartbeat_s=0.25, slow_phase_timeout_s=30.0),
                      emulate=dict(fault=fault))
    cfg.run_dir = str(tmp_path)
    return cfg


@pytest.mark.parametrize("fault,reason", [("rank=1:stop@step=2:phase=forward", "no heartbeat"),
                                          ("rank=1:hang@step=2:phase=forward", "no progress")])
def test_hung_rank_is_named_within_the_timeout(tmp_path: Path, fault: str, reason: str) -> None:
    cfg = _config(tmp_path, fault)
    with pytest.raises(RuntimeError, match=r"exited abnormally.*\(0, 70\)"):  # the watchdog's exit code
        run_ranks(_train, 2, cfg.to_dict(), timeout_s=90)
    injected = _records(tmp_path / "chaos.jsonl")[0]
    report = json.loads((tmp_path / "watchdog-rank0.json").read_text())
    assert report["culprit"] == 1 and reason in report["reason"]
    assert (report["phase"], report["step"]) == ("forward", 2)
    assert "rank 1 is hung" in report["message"] and "'forward' at step 2" in report["message"]
    waited = report["time"] - injected["time"]
    assert 0 < waited <= TIMEOUT_S + 5, f"named {waited:.1f} s after the fault (timeout {TIMEOUT_S} s)"


def test_no_false_alarm_in_slow_checkpoint_and_validation(tmp_path: Path) -> None:
    # Each sleep is twice the hang timeout, inside phases that may be slow: the run must just finish.
    cfg = _config(tmp_path, f"rank=0:sleep={2 * TIMEOUT_S}@step=1:phase=ckpt-write,"
                            f"rank=1:sleep={2 * TIMEOUT_S}@step=2:phase=validate", val_every=3)
    cfg.checkpoint.every = 2
    r = run_ranks(_train, 2, cfg.to_dict(), timeout_s=90)[0]
    assert len(r["losses"]) == 4 and r["digest"]
    assert not list(tmp_path.glob("watchdog-rank*.json"))
    assert len(_records(tmp_path / "chaos.jsonl")) == 2  # both slow phases really happened

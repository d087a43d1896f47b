"""Sinks beside metrics.jsonl: TensorBoard event files read back with TensorBoard's own reader hold the
very values of metrics.jsonl; W&B is off unless asked and a missing package is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.config import Config, SinksConfig
from hybridpar.report.metrics import MetricsWriter
from hybridpar.report.sinks import missing_packages, open_sinks, scalars_of
from tests.test_equivalence import tiny_config


class Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.rows.append((step, scalars))

    def close(self) -> None:
        self.closed = True


def test_step_records_reach_the_sinks_and_other_records_do_not(tmp_path: Path) -> None:
    sink = Recorder()
    w = MetricsWriter(tmp_path / "metrics.jsonl", sinks=[sink])
    rec = {"step": 3, "loss": 2.5, "lr": 1e-3, "mfu": None, "ranks": {"compute_s": [0.1, 0.2], "work": [1, 2]}}
    w.write(rec)
    w.write({"final": True, "params_digest": "x"})
    w.close()
    assert sink.rows == [(3, {"loss": 2.5, "lr": 1e-3, "ranks/compute_s/0": 0.1, "ranks/compute_s/1": 0.2})]
    assert sink.closed and scalars_of(rec) == sink.rows[0][1]


def test_missing_packages_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("wandb", "tensorboard") else real(n))
    assert missing_packages(SinksConfig()) is None  # auto: TensorBoard only when installed; W&B off
    assert open_sinks(SinksConfig(), Path("unused"), 0, "id") == []
    assert "sinks.wandb=true needs the wandb package" in missing_packages(SinksConfig(wandb=True))
    assert "sinks.tensorboard=on needs the tensorboard package" in missing_packages(SinksConfig(tensorboard="on"))
    from hybridpar.preflight import preflight

    cfg = Config()
    cfg.sinks.wandb = True
    with pytest.raises(ValueError, match="needs the wandb package"):
        preflight(cfg, None, verify=False)


def _worker(cfg_dict: dict) -> list[float]:
    from hybridpar.train import train

    return train(Config.from_dict(cfg_dict), log=False).losses


@pytest.mark.multiprocess
def test_tensorboard_reads_back_what_metrics_jsonl_holds(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the TensorBoard sink needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    from hybridpar.testing import run_ranks

    steps = 4
    cfg = tiny_config(
        parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b"), train=dict(steps=steps, val_every=2, monitor_every=0)
    )
    cfg.run_dir = str(tmp_path / "run")
    run_ranks(_worker, 2, cfg.to_dict(), timeout_s=240)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    expected: dict[str, dict[int, float]] = {}
    for r in recs:
        if "loss" in r:
            for tag, v in scalars_of(r).items():
                expected.setdefault(tag, {})[r["step"]] = v
    assert {"loss", "val_loss", "mfu", "bubble", "ranks/wait_s/1"} <= set(expected)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={TENSORS: 0})
    acc.Reload()
    assert set(acc.Tags()["tensors"]) == set(expected)
    for tag, by_step in expected.items():
        got = {e.step: make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)}
        assert got == by_step, tag  # exact: written in double precision

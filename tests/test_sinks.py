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
    from hybridpar.run.preflight import preflight

    cfg = Config()
    cfg.sinks.wandb = True
    with pytest.raises(ValueError, match="needs the wandb package"):
        preflight(cfg, None, verify=False)


def _worker(cfg_dict: dict) -> list[float]:
    from hybridpar.run.train import train

    return train(Config.from_dict(cfg_dict), log=False).losses


@pytest.mark.multiprocess
def test_tensorboard_reads_back_what_metrics_jsonl_holds(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the TensorBoard sink needs the tensorboard package")
    from hybridpar.topology.spawn import run_ranks

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
    got_all = _read_tensors(tmp_path / "run" / "tb")
    assert set(got_all) == set(expected)
    for tag, by_step in expected.items():
        got = got_all[tag]
        assert got == by_step, tag  # exact: written in double precision


def _read_tensors(tb_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard reads `tb_dir`; a step read twice for a tag fails."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(tb_dir), size_guidance={TENSORS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        events = acc.Tensors(tag)
        assert len({e.step for e in events}) == len(events), (tag, [e.step for e in events])
        out[tag] = {e.step: make_ndarray(e.tensor_proto).item() for e in events}
    return out


def test_a_resumed_run_replaces_tensorboard_steps_from_its_restart_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the TensorBoard sink needs the tensorboard package")
    from hybridpar.report.sinks import TB_DIR, TensorBoard

    first = TensorBoard(tmp_path, 0)  # steps 0..5, then a crash after step 5
    for step in range(6):
        first.write(step, {"loss": 10.0 + step, "ranks/wait_s/1": 0.5 + step})
    first.close()
    again = TensorBoard(tmp_path, 3)  # resumed from the checkpoint of step 3: steps 3.. are trained again
    for step in range(3, 5):
        again.write(step, {"loss": 20.0 + step, "ranks/wait_s/1": 1.5 + step})
    again.close()
    got = _read_tensors(tmp_path / TB_DIR)
    assert got["loss"] == {0: 10.0, 1: 11.0, 2: 12.0, 3: 23.0, 4: 24.0}
    assert got["ranks/wait_s/1"] == {0: 0.5, 1: 1.5, 2: 2.5, 3: 4.5, 4: 5.5}
    fresh = TensorBoard(tmp_path, 0)  # a fresh start in the same directory keeps nothing of the old run
    fresh.write(0, {"loss": 7.0})
    fresh.close()
    assert _read_tensors(tmp_path / TB_DIR) == {"loss": {0: 7.0}}

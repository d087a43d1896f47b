"""Per-step records: the per-rank compute/wait summaries and the measured bubble (report/records.py),
MFU against the device peak (report/mfu.py), the progress-line interval, and a real run whose every step
record carries them — with the one-device model still trained exactly."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch

from hybridpar.config import Config, parse_args
from hybridpar.model.registry import param_counts
from hybridpar.pipeline.runtime import ActionTime, StepOutput
from hybridpar.pipeline.schedules import Action, Op
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.report.metrics import Progress, ProgressDuty
from hybridpar.report.mfu import datasheet_peak, measure_matmul, mfu, model_flops_per_token
from hybridpar.report.records import bubble, rank_summary, step_fields, unpack
from tests.references import ref_for
from tests.test_equivalence import TOL, tiny_config


def _at(op: Op, start: float, end: float, stage: int = 0, mb: int = 0) -> ActionTime:
    return ActionTime(Action(stage, op, mb), start, end)


def test_rank_summary_takes_waits_out_of_compute() -> None:
    out = StepOutput(
        loss=None,
        timeline=[
            _at(Op.RECV_F, 10.0, 10.5),  # posting a receive: comm
            _at(Op.FORWARD, 10.5, 12.0),  # 1.5 s, of which 0.5 s blocked on the message
            _at(Op.SEND_F, 12.0, 12.25),
            _at(Op.BACKWARD, 12.25, 14.0),  # 1.75 s, 0.25 s blocked
            _at(Op.WEIGHT, 14.0, 15.0),
        ],
        waits=[_at(Op.RECV_F, 10.5, 11.0), _at(Op.RECV_B, 12.25, 12.5)],
    )
    compute, wait, comm, span, work = rank_summary(out, 7)
    assert compute == pytest.approx(1.5 + 1.75 + 1.0 - 0.75)
    assert (wait, comm, span, work) == (pytest.approx(0.75), pytest.approx(0.75), 5.0, 7.0)
    assert rank_summary(StepOutput(loss=None), 0) == [0.0, 0.0, 0.0, 0.0, 0.0]


def test_unpack_and_bubble_known_values() -> None:
    # Two ranks: rank 0 computed 3 of its 4 s, rank 1 computed 1 of 2 s; the wall is the longest, 4 s.
    ranks = unpack([3.0, 0.5, 0.1, 4.0, 10.0, 1.0, 0.9, 0.1, 2.0, 5.0], 2)
    assert ranks["compute_s"] == [3.0, 1.0] and ranks["pipeline_s"] == [4.0, 2.0] and ranks["work"] == [10.0, 5.0]
    assert bubble(ranks) == pytest.approx(1 - 4.0 / 8.0)
    assert step_fields(ranks)["bubble"] == 0.5
    assert bubble(unpack([0.0] * 5, 1)) is None  # nothing ran: no bubble to report, not 0 or 1
    with pytest.raises(ValueError, match="expected 10 values for 2 ranks, got 9"):
        unpack([0.0] * 9, 2)


def test_model_flops_per_token_by_hand() -> None:
    cfg = tiny_config()
    m, T = cfg.model, cfg.train.seq_len
    # Llama layer: q, o (d x d), k, v (d x kv_dim), SwiGLU gate, up, down (d x ffn).
    kv = m.kv_heads * m.head_dim
    weights = 2 * m.dim * m.dim + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim
    assert param_counts(m).layer_matmul == weights
    forward = m.n_layers * (2 * weights + 4 * T * m.dim) + 2 * m.dim * m.vocab_size
    assert model_flops_per_token(m, T) == 3 * forward
    assert mfu(100.0, 10, 2.0, 1000.0) == pytest.approx(0.5)
    assert mfu(100.0, 10, 0.0, 1000.0) is None


def test_measured_matmul_peak_is_a_real_rate() -> None:
    rate = measure_matmul(torch.device("cpu"), torch.float32, seconds=0.05, n=128)
    assert 1e7 < rate < 1e13  # between a slow interpreter and a whole server's worth of cores


def test_datasheet_peak_tells_the_boards_apart() -> None:
    """torch's names for the boards (torch.cuda.get_device_name): a PCIe H100 is not given the SXM peak, an NVL
    board (no figure here) is measured, an unknown GPU too."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert datasheet_peak("NVIDIA H100 80GB HBM3", bf16) == 989e12
    assert datasheet_peak("NVIDIA H100 PCIe", bf16) == 756e12
    assert datasheet_peak("NVIDIA H100 PCIe", fp32) == 51e12
    assert datasheet_peak("NVIDIA H200", bf16) == 989e12
    assert datasheet_peak("NVIDIA H100 NVL", bf16) is None
    assert datasheet_peak("NVIDIA H200 NVL", bf16) is None
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", bf16) == 312e12
    assert datasheet_peak("Tesla V100-SXM2-32GB", bf16) is None  # no bf16 units: measured
    assert datasheet_peak("NVIDIA GeForce RTX 4090", bf16) is None


def test_progress_interval() -> None:
    out = io.StringIO()  # not a terminal: plain lines at the first step, every N and the last
    log = logging.getLogger("test_progress_interval")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(logging.StreamHandler(out))
    p = Progress(10, log, out=io.StringIO(), every=4)
    for step in range(10):
        p.update(step, 1.0, 100.0, 0.1)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["1/10", "4/10", "8/10", "10/10"]
    assert parse_args(["--train.progress_every", "3"]).train.progress_every == 3
    with pytest.raises(ValueError, match="train.progress_every must be a positive integer, got 0"):
        validate_config(parse_args(["--train.progress_every", "0"]))


def test_a_balancer_decision_is_a_log_line() -> None:
    # A live move (or detect's would-be move) was only in metrics.jsonl: the console said nothing.
    out = io.StringIO()
    log = logging.getLogger("test_a_balancer_decision_is_a_log_line")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(logging.StreamHandler(out))
    duty = ProgressDuty(Config(), log, 0)
    rec = {"loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 0.1}
    moves = [{"event": "rebalance", "applied": True, "reason": "rank 2 straggles"}, {"event": "rebalance_measured"}]
    duty.after_step(22, {**rec, "balance": moves})
    duty.after_step(23, {**rec, "balance": [{"event": "rebalance", "applied": False, "reason": "rank 1 straggles"}]})
    lines = [x for x in out.getvalue().splitlines() if x.startswith("balance")]
    assert lines == ["balance: step 22: moved: rank 2 straggles", "balance: step 23: would move: rank 1 straggles"]


def test_progress_eta_after_a_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed at step 90 of 100, one second a step: 9 steps left after the first is 9 s, not 0."""
    from hybridpar.report import metrics

    clock = iter([0.0, 1.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    log = logging.getLogger("test_progress_eta_after_a_resume")
    log.propagate, log.level = False, logging.INFO
    out = io.StringIO()
    log.addHandler(logging.StreamHandler(out))
    Progress(100, log, out=io.StringIO(), every=1, start_step=90).update(90, 1.0, 100.0, 1.0)
    assert out.getvalue().split("ETA ")[1].strip() == "0:09"


def _worker(cfg_dict: dict) -> list[float]:
    from hybridpar.run.train import train

    return train(Config.from_dict(cfg_dict), log=False).losses


def test_a_timeline_write_cut_short_leaves_the_last_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rank 0's step_timeline.json is replaced whole: a write cut short (a kill, a full disk) leaves the file
    of the previous attempt, which `hybridpar report` draws, not a torn one it cannot read."""
    from types import SimpleNamespace

    from hybridpar.report import step_records
    from hybridpar.report.rundata import TIMELINE_FILE

    old = json.dumps({"step": 2, "attempt": 0, "slices": []})
    (tmp_path / TIMELINE_FILE).write_text(old, encoding="utf-8")
    recs = step_records.StepRecords.__new__(step_records.StepRecords)  # no collective peak: only the timeline
    recs.topo, recs.run_dir, recs.attempt, recs.timeline_step = SimpleNamespace(rank=0, device=None), tmp_path, 1, 5
    monkeypatch.setattr(step_records, "step_slices", lambda out, rank, step: [{"track": 0}] * 1000)
    monkeypatch.setattr(step_records, "all_gather_json", lambda rows, device: [rows])
    whole = Path.write_text

    def cut_short(self: Path, text: str, *args: object, **kwargs: object) -> int:
        whole(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m, pytest.raises(OSError):
        m.setattr(Path, "write_text", cut_short)
        recs.timeline(5, None)
    assert (tmp_path / TIMELINE_FILE).read_text(encoding="utf-8") == old
    assert [p.name for p in tmp_path.iterdir()] == [TIMELINE_FILE]  # and no part of the new one


@pytest.mark.multiprocess
def test_every_step_record_carries_time_mfu_bubble_and_ranks(tmp_path: Path) -> None:
    from hybridpar.balance.live import cost_model
    from hybridpar.topology.spawn import run_ranks
    from hybridpar.trainer.build import layer_partition

    steps = 5
    cfg = tiny_config(
        parallel=dict(tp=1, pp=2, dp=2, schedule="1f1b"), train=dict(steps=steps, val_every=steps, monitor_every=0)
    )
    cfg.run_dir = str(tmp_path / "run")
    losses = run_ranks(_worker, 4, cfg.to_dict(), timeout_s=240)[0]
    ref_losses, _, _ = ref_for(cfg)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL  # the records change no math

    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in rows if "loss" in r]
    assert [r["step"] for r in recs] == list(range(steps))
    times = [r["time"] for r in recs]
    assert times == sorted(times) and times[-1] - times[0] >= sum(r["step_time_s"] for r in recs[1:]) * 0.99
    peak = recs[0]["device_peak"]
    assert peak["world"] == 4 and peak["flops_per_s"] > 0 and "measured cpu matmul" in peak["source"]
    assert "device_peak" not in recs[1]
    cached = json.loads((tmp_path / "run" / "device_peak.json").read_text())
    assert cached == peak
    # Ranks (dp, pp) = (0, 0), (0, 1), (1, 0), (1, 1); replicas of 6 and 5 of the 11 samples.
    stage = cost_model(cfg).stage_costs(layer_partition(cfg))
    work = [6 * stage[0], 6 * stage[1], 5 * stage[0], 5 * stage[1]]
    for r in recs:
        ranks = r["ranks"]
        assert set(ranks) == {"compute_s", "wait_s", "comm_s", "pipeline_s", "work"}
        assert all(len(v) == 4 for v in ranks.values())
        for c, w, m, span in zip(ranks["compute_s"], ranks["wait_s"], ranks["comm_s"], ranks["pipeline_s"]):
            assert c > 0 and w >= 0 and m >= 0 and c + w + m <= span * 1.001 + 1e-6
            assert span <= r["step_time_s"]
        assert ranks["work"] == work  # the cost model's units, stage by stage and replica by replica
        assert 0 < r["bubble"] < 1
        assert r["bubble"] == pytest.approx(bubble(ranks), abs=1e-4)
        expected = model_flops_per_token(cfg.model, 16) * 11 * 16 / r["step_time_s"] / peak["flops_per_s"]
        assert r["mfu"] == pytest.approx(expected) and 0 < r["mfu"] < 1
        assert r["attempt"] == 0
    timeline = json.loads((tmp_path / "run" / "step_timeline.json").read_text())
    assert timeline["step"] == 2 and {s["track"] for s in timeline["slices"]} == {0, 1, 2, 3}
    assert {s["cat"] for s in timeline["slices"]} == {"compute", "comm", "wait"}

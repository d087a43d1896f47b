"""The command line: bad input is refused before any process starts; `hybridpar train` (torch's
elastic launcher) and plain `torchrun -m hybridpar.train` both train and write metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpar import cli

TINY = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2", "--model.ffn_dim", "64",
        "--train.steps", "3", "--train.global_batch", "4", "--train.microbatches", "2", "--train.seq_len", "16",
        "--train.val_every", "2", "--train.val_batches", "1", "--train.sample_tokens", "8",
        "--data.max_bytes", "100000"]


@pytest.fixture
def no_launch(monkeypatch):
    import torch.distributed.run as tdr

    def boom(*a, **k):
        raise AssertionError("a worker was launched for an invalid config")

    monkeypatch.setattr(tdr, "run", boom)


@pytest.mark.parametrize("argv,match", [
    (["--parallel.tp", "3"], "parallel.tp=3 does not divide model.n_heads=4"),
    (["--parallel.tpp", "2"], "did you mean --parallel.tp"),
    (["--nproc-per-node", "3"], "= 4, but 3 processes"),
    (["--parallel.pp", "4", "--model.n_layers", "2"], "model.n_layers=2"),
    (["--train.microbatches", "1"], "needs train.microbatches"),
    (["--train.global_batch", "2", "--train.microbatches", "4", "--parallel.schedule", "gpipe"], "exceeds"),
    (["--train.seq_len", "0"], "train.seq_len"),
])
def test_bad_config_refused_before_launch(argv, match, no_launch, capsys):
    assert cli.main(["train", *argv]) == 2
    assert match in capsys.readouterr().err


def test_split_argv_separates_torchrun_flags():
    theirs, ours = cli.split_argv(["--nproc-per-node", "4", "--parallel.tp=2", "--max-restarts=1", "--run-dir", "x"])
    assert theirs == ["--nproc-per-node", "4", "--max-restarts=1"]
    assert ours == ["--parallel.tp=2", "--run-dir", "x"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(run_dir: Path, steps: int) -> None:
    recs = _records(run_dir)
    per_step = [r for r in recs if "step" in r and not r.get("final")]
    assert [r["step"] for r in per_step] == list(range(steps))
    for r in per_step:
        assert {"loss", "lr", "tokens_per_s", "step_time_s"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
    assert any("val_loss" in r for r in per_step)
    final = recs[-1]
    assert final["final"] is True and len(final["params_digest"]) == 64


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_hybridpar_train_launches_through_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    exe = Path(sys.executable).with_name("hybridpar")
    out = subprocess.run([str(exe), "train", "--parallel.tp", "2", "--parallel.pp", "2", *TINY, "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=240, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    _check_run(run_dir, 3)
    assert "sample from the trained model" in out.stdout


def test_plain_torchrun_module(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "-m", "hybridpar.train", "--parallel.tp", "1", "--parallel.pp", "1",
           "--parallel.dp", "2", *TINY, "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    _check_run(run_dir, 3)

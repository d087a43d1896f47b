"""The benches that launch training runs keep their run directories (`--runs-dir`) for `hybridpar report`:
the default folder's rule, and a run of `hybridpar bench balance`'s launcher kept and read by the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.bench import runs_dir
from hybridpar.bench.balance import run
from hybridpar.model.reference import tiny_config
from hybridpar.report.page import main as report_main


def test_runs_dir_is_the_given_one_or_a_new_one_under_runs(tmp_path: Path) -> None:
    assert runs_dir("chaos", str(tmp_path / "x")) == tmp_path / "x"
    d = runs_dir("balance", None)
    assert d.parts[:2] == ("runs", "bench") and d.name.startswith("balance-") and not d.exists()


@pytest.mark.multiprocess
def test_balance_run_is_kept_and_reported(tmp_path: Path) -> None:
    cfg = tiny_config(parallel=dict(tp=1, pp=2, dp=1), train=dict(steps=4, val_every=2))
    kept = tmp_path / "runs" / "emulated-pp2-balanced"
    rows = run(cfg, kept)
    assert [r["step"] for r in rows if "step_time_s" in r] == [0, 1, 2, 3]
    assert (kept / "metrics.jsonl").is_file() and (kept / "final" / "model.safetensors").is_file()
    assert report_main([str(kept)]) == 0
    page = (kept / "report.html").read_text()
    assert "goodput" in page and "<img" in page

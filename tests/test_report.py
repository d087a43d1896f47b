"""`hybridpar report` on a synthetic run directory whose figures are known by hand: the page shows the
stability numbers (goodput, MTTR, MTBF, recomputed steps, ledger, CV) with their definitions, embeds
every figure as a decodable PNG, fetches nothing, overlays a second run, and refuses bad input with one
line and exit code 2."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path

import pytest

from hybridpar.cli import main as cli_main
from hybridpar.report.stability import DEFINITIONS

pytest.importorskip("matplotlib", reason="hybridpar report needs matplotlib (the report extra)")


def _jsonl(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _step(step: int, end: float, t: float = 1.0, ranks: bool = True) -> dict:
    rec = {
        "step": step,
        "loss": 5.0 - 0.1 * step,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "step_time_s": t,
        "tokens_per_s": 1000.0 / t,
        "microbatches": [3, 3],
        "activation_peak_bytes": 2**20,
        "time": end,
        "mfu": 0.01 / t,
        "bubble": 0.25,
    }
    if ranks:  # rank 1 does twice rank 0's work in twice the time: no straggler
        rec["ranks"] = {
            "compute_s": [0.5 * t, 1.0 * t],
            "wait_s": [0.1, 0.0],
            "comm_s": [0.01, 0.01],
            "pipeline_s": [0.9 * t, 0.9 * t],
            "work": [1.0, 2.0],
        }
    return rec


def synthetic_run(d: Path) -> Path:
    """Attempt 0 starts at t=100 and trains steps 0-4 (1 s each, ending 101..105); a fault at 105.5 kills it
    after its checkpoint of 3 steps. Attempt 1 starts at 108 and trains steps 3-9 from 109 (ending 110..116).
    Known: wall 16 s, productive 10 s, goodput 62.5 %, MTTR 3.5 s, MTBF 12.5 s, 2 recomputed steps."""
    d.mkdir(parents=True)
    first = [_step(s, 101.0 + s) for s in range(5)]
    second = [_step(s, 110.0 + s - 3) for s in range(3, 10)]
    second[2]["val_loss"] = 4.4
    second[4]["monitor"] = {"ranks": 2, "memory_used_bytes": [300 * 2**20, 310 * 2**20]}
    second[6]["monitor"] = {"ranks": 2, "memory_used_bytes": [301 * 2**20, 312 * 2**20]}
    second[6]["balance"] = [
        {
            "event": "rebalance_measured",
            "step": 6,
            "predicted_step_before_s": 1.0,
            "predicted_step_after_s": 0.8,
            "measured_step_before_s": 1.0,
            "measured_step_after_s": 1.0,
        }
    ]
    second[3]["balance"] = [
        {
            "event": "rebalance",
            "step": 6,
            "applied": True,
            "reason": "rank 1 straggles",
            "predicted_step_before_s": 1.0,
            "predicted_step_after_s": 0.8,
        },
    ]
    final = {
        "final": True,
        "params_digest": "ab" * 32,
        "ledger": {"lost_samples": 0, "duplicated_samples": 0},
        "batching": {
            "policy": "fixed",
            "current_split": [3, 3],
            "history": [{"split": [3, 3], "steps": 10, "mean_throughput": 1000.0}],
        },
    }
    _jsonl(d / "metrics.jsonl", first[:3] + second + [final])
    _jsonl(d / "metrics.superseded.jsonl", first[3:])
    _jsonl(
        d / "resilience.jsonl",
        [
            {"event": "start", "time": 100.0, "restart": 0, "mesh": {"tp": 1, "cp": 1, "pp": 2, "dp": 1}},
            {"event": "start", "time": 108.0, "restart": 1, "mesh": {"tp": 1, "cp": 2, "pp": 1, "dp": 1}},
        ],
    )
    (d / "chaos.jsonl").write_text('\n{"fault": "rank=1:kill@step=4:phase=forward", "rank": 1, "time": 105.5}\n')
    slices = [
        {"track": r, "name": f"F{r}.0", "start_s": r * 0.1, "end_s": r * 0.1 + 0.5, "cat": "compute"} for r in range(2)
    ]
    (d / "step_timeline.json").write_text(json.dumps({"step": 2, "slices": slices}))
    return d


def _cells(page: str, figure: str) -> list[str]:
    row = re.search(rf"<tr><th>{re.escape(figure)}</th>(.*?)</tr>", page)
    assert row, figure
    return re.findall(r"<td[^>]*>(.*?)</td>", row.group(1))


def _pngs(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_report_shows_the_known_figures_with_definitions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from matplotlib.image import imread

    run = synthetic_run(tmp_path / "run")
    assert cli_main(["report", str(run)]) == 0
    assert f"report written to {run / 'report.html'}" in capsys.readouterr().out
    page = (run / "report.html").read_text()
    assert _cells(page, "wall time")[0] == "16 s"
    assert "<tr><td>mesh (last start)</td><td>tp1 cp2 pp1 dp1</td>" in page  # the elastic restart's layout
    assert _cells(page, "productive time")[0] == "10 s"
    assert _cells(page, "goodput")[0] == "62.5 %"
    assert _cells(page, "interruptions")[0] == "1"
    assert _cells(page, "MTTR")[0] == "3.5 s"
    assert _cells(page, "MTBF")[0] == "12.5 s"
    assert _cells(page, "recomputed steps")[0] == "2"
    assert _cells(page, "lost / duplicated samples")[0] == "0 / 0"
    assert _cells(page, "step-time CV")[0] == "0"  # every step took 1 s
    assert _cells(page, "straggler episodes")[0] == "none"
    for name in DEFINITIONS:
        assert html.unescape(_cells(page, name)[-1]) == DEFINITIONS[name].format(threshold=1.25, patience=3)
    # Self-contained: no script, nothing fetched; every figure a PNG that decodes and is not blank.
    assert "<script" not in page and not re.search(r"(src|href)=\"(https?:)?//", page)
    pngs = _pngs(page)
    assert len(pngs) == 9  # every figure: this run recorded something for each
    for png in pngs:
        pixels = imread(io.BytesIO(png), format="png")
        assert pixels.shape[0] > 50 and pixels.shape[1] > 200 and pixels.std() > 0.01
    assert "rank 1 straggles" in page and "rank=1:kill@step=4:phase=forward" in page


def test_compare_overlays_a_second_run(tmp_path: Path) -> None:
    a = synthetic_run(tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    times = [2.0 if s != 5 else 9.0 for s in range(12)]  # back to back from t=200: ends at the running sums
    _jsonl(b / "metrics.jsonl", [_step(s, 200.0 + sum(times[: s + 1]), t, ranks=False) for s, t in enumerate(times)])
    out = tmp_path / "both.html"
    assert cli_main(["report", str(a), "--compare", str(b), "--out", str(out)]) == 0
    page = out.read_text()
    assert "hybridpar run a vs b" in page
    assert _cells(page, "goodput")[:2] == ["62.5 %", "100 %"]  # b: no attempt start recorded, steps back to back
    assert _cells(page, "interruptions")[:2] == ["1", "0"]
    assert _cells(page, "MTBF")[1] == "no failure"
    assert _cells(page, "outliers")[:2] == ["none", "5"]  # the 9 s step, far beyond Q3 + 3 x IQR
    assert _cells(page, "lost / duplicated samples")[1] == "— / —"  # b never finished: no ledger


def test_bad_run_directories_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err and "--run-dir" in err
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no step records" in capsys.readouterr().err
    run = synthetic_run(tmp_path / "run")
    assert cli_main(["report", str(run), "--compare", str(tmp_path / "empty")]) == 2

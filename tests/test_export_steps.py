"""`hybridpar export RUN --step N` for a step the run does not hold names each step it holds once (a run's
final model and its last checkpoint are usually of the same step). Pure: a run directory written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.trainer.export import newest_artefact


def test_a_missing_step_is_refused_naming_each_held_step_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"format": "hybridpar-run/1", "run_id": "abc"}), encoding="utf-8")
    for step in (6, 12):
        ck = run / "checkpoints" / f"step-{step:06d}"
        ck.mkdir(parents=True)
        (ck / "manifest.json").write_text(json.dumps({"run_id": "abc"}), encoding="utf-8")
    (run / "final" / "config.json").write_text("{}", encoding="utf-8")
    (run / "final" / "hybridpar.json").write_text(json.dumps({"step": 12}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"no checkpoint of step 7: --step takes one of 6, 12$"):
        newest_artefact(run, 7)
    assert newest_artefact(run, 12) == run / "final"
    assert newest_artefact(run, 6) == run / "checkpoints" / "step-000006"

"""`hybridpar export --out DIR` replaces DIR whole, so it refuses a DIR that holds anything but an earlier
export, before reading the source: a run directory, a run's final/, a checkpoint, someone's files (each was
deleted before). Pure: directories written by hand; the source is a model directory, which export copies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar import cli


def _model_dir(d: Path, step: int) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}", encoding="utf-8")
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "hybridpar.json").write_text(json.dumps({"step": step}), encoding="utf-8")
    return d


def _export(src: Path, out: Path) -> int:
    return cli.main(["export", str(src), "--out", str(out)])


@pytest.mark.parametrize(
    "files, said",
    [
        ({"notes.txt": "mine"}, "notes.txt"),
        ({"run.json": "{}", "metrics.jsonl": ""}, "metrics.jsonl, run.json"),  # a run directory
        ({".metadata": "", "__0_0.distcp": "", "manifest.json": "{}"}, ".metadata, __0_0.distcp"),  # a checkpoint
        ({"config.json": "{}", "model.safetensors": ""}, "config.json, model.safetensors"),  # someone's model
    ],
)
def test_an_out_holding_other_files_is_refused_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture, files: dict[str, str], said: str
) -> None:
    src, out = _model_dir(tmp_path / "src", 3), tmp_path / "out"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    assert _export(src, out) == 2
    assert f"holds files that are not an earlier export ({said}" in capsys.readouterr().err
    assert {p.name: p.read_text(encoding="utf-8") for p in out.iterdir()} == files


def test_a_runs_final_model_is_refused_even_before_it_exists(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src, run = _model_dir(tmp_path / "src", 3), tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}", encoding="utf-8")
    assert _export(src, run / "final") == 2
    assert "is the final model of the run" in capsys.readouterr().err
    assert not (run / "final").exists()


def test_an_earlier_export_is_replaced_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _export(_model_dir(tmp_path / "a", 3), out) == 0
    (out / "tokenizer.json").write_text("{}", encoding="utf-8")  # the earlier model's tokenizer
    assert _export(_model_dir(tmp_path / "b", 5), out) == 0
    assert json.loads((out / "hybridpar.json").read_text(encoding="utf-8")) == {"step": 5}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hybridpar.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left beside it

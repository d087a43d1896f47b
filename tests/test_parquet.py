"""Parquet input for `hybridpar data prepare` (`--input *.parquet`, `--text-key COLUMN`): a document per
row, read one row group at a time; the same token files as the same documents in JSON Lines; a file
without the column refused in one line naming the file and the column. Pure: small files under tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar import cli
from hybridpar.data.inputs import documents

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TEXTS = [f"document {i}: " + "words and more words " * (i % 7 + 1) for i in range(300)]


def _parquet(path: Path, column: str = "content", rows_per_group: int = 64) -> Path:
    table = pa.table({"id": list(range(len(TEXTS))), column: TEXTS})
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok"
    assert cli.main(["data", "train-tokenizer", "--vocab-size", "300", "--out", str(out), "--max-bytes", "30000"]) == 0
    return out


def test_rows_are_documents_as_json_lines_are(tok: Path, tmp_path: Path) -> None:
    src = _parquet(tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in TEXTS))
    for name in ("d.parquet", "d.jsonl"):
        argv = ["data", "prepare", "--tokenizer", str(tok), "--input", str(tmp_path / name), "--text-key", "content"]
        assert cli.main([*argv, "--out", str(tmp_path / f"{name}.bin")]) == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"d.parquet{ext}").read_bytes() == (tmp_path / f"d.jsonl{ext}").read_bytes()
    assert json.loads((tmp_path / "d.parquet.json").read_text())["documents"] == len(TEXTS)
    assert list(documents(str(src), text_key="content")) == TEXTS


def test_one_row_group_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _parquet(tmp_path / "d.parquet", rows_per_group=50)
    read: list[tuple[int, list[str]]] = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kw):
        read.append((i, columns))
        return original(self, i, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    docs = documents(str(src), text_key="content")
    assert [next(docs) for _ in range(60)] == TEXTS[:60]
    assert read == [(0, ["content"]), (1, ["content"])]  # two groups of 50 for 60 rows; only the text column


def test_missing_or_wrong_column_is_one_line(tok: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = _parquet(tmp_path / "d.parquet")
    for key, want in [("text", f"{src} has no column 'text' (its columns: id, content)"), ("id", "holds int64")]:
        capsys.readouterr()
        argv = ["data", "prepare", "--tokenizer", str(tok), "--input", str(src), "--out", str(tmp_path / "o.bin")]
        assert cli.main([*argv, "--text-key", key]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, err
        assert not (tmp_path / "o.bin").exists()
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="cannot be read as Parquet"):
        list(documents(str(tmp_path / "bad.parquet")))

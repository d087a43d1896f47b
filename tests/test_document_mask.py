"""data.document_mask: attention stays inside each document of a window, positions restart per document,
so each document's tokens get the logits they get alone; the document numbers come from the token file's
index; text without an index is refused before launch; and every schedule and axis with the mask trains
the same model as one device."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpar import cli
from hybridpar.data.corpus import TokenData
from hybridpar.data.mixture import open_data
from hybridpar.data.sources import default_corpus_files
from hybridpar.model.documents import DocumentMask
from hybridpar.model.reference import gpt2_config, tiny_config
from hybridpar.model.registry import build_full_model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_document_of_a_window_gets_its_logits_alone(family: str) -> None:
    cfg = tiny_config() if family == "llama" else gpt2_config()
    model = build_full_model(cfg.model, 0)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (2, n), generator=g) for n in (5, 3, 8)]  # a window of 16 holding three
    x = torch.cat(docs, dim=1)
    numbers = torch.cat([torch.full((2, d.shape[1]), i) for i, d in enumerate(docs)], dim=1)
    with torch.no_grad():
        out = model(x, DocumentMask(numbers))
        lo = 0
        for d in docs:
            alone = model(d)  # the plain causal forward of the document by itself
            assert (out[:, lo : lo + d.shape[1]] - alone).abs().max().item() <= 1e-5
            lo += d.shape[1]
        assert (model(x)[:, 5:8] - model(docs[1])).abs().max().item() > 1e-2  # without the mask: not alone
    mask = DocumentMask(numbers)
    assert mask.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tokenizer and a token file of many short documents (lines of the stdlib, one per document), so
    that most windows of 16 tokens span a boundary or two."""
    root = tmp_path_factory.mktemp("docs")
    tok = root / "tok"
    assert cli.main(["data", "train-tokenizer", "--vocab-size", "300", "--out", str(tok), "--max-bytes", "60000"]) == 0
    lines = [ln.strip() for f in default_corpus_files()[:40] for ln in f.read_text(errors="replace").splitlines()]
    (root / "lines.jsonl").write_text("".join(json.dumps({"text": ln}) + "\n" for ln in lines if ln.strip()))
    data = root / "docs.bin"
    argv = ["data", "prepare", "--tokenizer", str(tok), "--input", str(root / "lines.jsonl"), "--out", str(data)]
    assert cli.main([*argv, "--max-bytes", "120000"]) == 0
    return tok, data


def test_document_numbers_follow_the_index(short_docs: tuple[Path, Path]) -> None:
    _, data = short_docs
    idx = np.fromfile(data.with_suffix(".idx"), dtype="<u8")
    td = TokenData.open(str(data), None, 16, 0, 0.1)
    starts = np.arange(0, 16 * 200, 16, dtype=np.int64)
    got = td.documents(starts)
    for row, s in zip(got, starts):
        want = np.searchsorted(idx, s + np.arange(16), side="right")
        assert row.tolist() == (want - want[0]).tolist()
    assert int(got.max()) >= 1  # short documents: windows do span boundaries
    x, _ = td.train_samples(40, 4)  # each boundary inside a window is right after the end-of-text id
    d = td.train_documents(40, 4)
    eos = json.loads(data.with_suffix(".json").read_text())["eos_id"]
    assert torch.equal(d[:, 1:] != d[:, :-1], x[:, :-1] == eos)
    for ext in (".bin", ".idx", ".json"):  # a mixture's documents are each source's own
        shutil.copy(data.with_suffix(ext), data.with_name("again" + ext))
    mix = open_data(f"2:{data},1:{data.with_name('again.bin')}", None, 16, 0, 0.1)
    source, within = mix._locate(np.arange(24, 36))
    got = mix.step_documents(2, 12, 0, 12)
    for row, s, j in zip(got, source, within):
        assert torch.equal(row, mix.sources[s].train_documents(int(j), 1)[0])


def _refused(flags: list[str], run: Path, capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    rc = cli.main(["train", *flags, "--parallel.tp", "1", "--parallel.pp", "1", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and not run.exists(), err
    return err


def test_text_without_an_index_is_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a.txt").write_text("hello " * 2000)
    err = _refused(["--data.path", str(tmp_path / "a.txt"), "--data.document_mask", "true"], tmp_path / "r", capsys)
    assert "data.document_mask needs the document index of a prepared token file" in err and "a.txt" in err
    err = _refused(["--data.document_mask", "true"], tmp_path / "r", capsys)  # the default corpus: bytes
    assert "data.path=None is byte-level text" in err


@pytest.mark.multiprocess
def test_the_grid_with_the_mask_equals_one_device(short_docs: tuple[Path, Path], tmp_path: Path) -> None:
    """Every schedule and every axis once, in one launch of 4 ranks: the mask is applied inside each
    stage's attention, so what could break it is how a layout cuts the model and the batch."""
    from tests.references import ref_for
    from tests.test_equivalence import check_layouts, grid_config

    tok, data = short_docs
    docs = dict(path=str(data), tokenizer=str(tok), document_mask=True, max_tokens=None)
    vocab = dict(vocab_size=300)
    layouts = [  # (tp, pp, dp, schedule, virtual stages)
        (2, 2, 1, "1f1b", 1),
        (1, 2, 2, "zb-v", 2),
        (2, 1, 2, "gpipe", 1),
        (1, 2, 2, "interleaved-1f1b", 2),
        (1, 4, 1, "zb-h1", 1),
    ]
    cfgs = [
        grid_config(pp, s, v, model=vocab, parallel=dict(tp=tp, pp=pp, dp=dp), data=docs)
        for tp, pp, dp, s, v in layouts
    ]
    cfgs.append(gpt2_config(tp=2, pp=2, dp=1, schedule="1f1b"))
    cfgs[-1].model.vocab_size, cfgs[-1].data = 300, cfgs[0].data
    plain = tiny_config(model=vocab, data={**docs, "document_mask": False})
    assert ref_for(cfgs[0])[0] != ref_for(plain)[0]  # the mask changes the training: the check below has teeth
    check_layouts(cfgs, tmp_path)

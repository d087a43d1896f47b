"""Corpora at any size: token files read in place (each batch reads only its windows; nothing copied,
nothing capped unless data.max_tokens says so, and then said), and the retired data.max_bytes refused
with the key to use instead. Pure: small corpora under tmp_path, no process started."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpar import cli
from hybridpar.config import Config
from hybridpar.config.parse import parse_args
from hybridpar.data.corpus import TokenData
from hybridpar.data.inputs import documents
from hybridpar.data.sources import corpus_note, default_corpus_files, open_corpus
from hybridpar.data.tokenfile import TOKEN_DTYPES
from hybridpar.data.tokenizer import Tokenizer
from hybridpar.run.data_checks import check_corpus
from hybridpar.run.preflight import preflight


def _nanogpt(path: Path, n: int, seed: int = 0) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, 50_000, size=n).astype("<u2")
    ids.tofile(path)
    return ids


def test_token_file_is_mapped_not_copied(tmp_path: Path) -> None:
    ids = _nanogpt(tmp_path / "t.bin", 5000)
    data = TokenData.open(str(tmp_path / "t.bin"), None, 16, 0, 0.1)
    held = data.tokens
    assert isinstance(held, np.memmap) and Path(held.filename) == tmp_path / "t.bin"
    assert not held.flags.writeable and not held.flags.owndata  # a view of the mapping, not a copy
    x, y = data.train_samples(0, 8)
    assert x.dtype == torch.int64 and x.shape == (8, 16)
    assert data.tokens is held and data.vocab_needed == int(ids.max()) + 1
    cut = TokenData.open(str(tmp_path / "t.bin"), 3000, 16, 0, 0.1)
    assert isinstance(cut.tokens, np.memmap) and len(cut.tokens) == 3000  # a cut is a shorter view


def _resident_kb(path: Path) -> int:
    """This process's resident kB of its maps of `path` (/proc/self/smaps)."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[:1].isupper():  # a mapping's first line (its address); its fields are capitalised
            mine = line.rstrip().endswith(str(path))
        elif mine and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_read_windows_leave_no_page_of_the_file_resident(tmp_path: Path) -> None:
    _nanogpt(tmp_path / "t.bin", 4 << 20)  # 8 MB
    data = TokenData.open(str(tmp_path / "t.bin"), None, 256, 0, 0.05)
    for step in range(3):
        data.step_samples(step, 32, 0, 32)
        assert _resident_kb(tmp_path / "t.bin") == 0
    data.tokens[:: 1 << 16].sum()  # any other read maps pages (so the probe above does see them)
    assert _resident_kb(tmp_path / "t.bin") > 0


def test_windows_from_the_map_equal_windows_from_memory(tmp_path: Path) -> None:
    """The one sample path: a token file's windows are those of the same ids held in memory."""
    ids = _nanogpt(tmp_path / "t.bin", 7000, seed=3)
    mapped = TokenData.open(str(tmp_path / "t.bin"), None, 24, 5, 0.1)
    held = TokenData(torch.from_numpy(ids.astype(np.int64)), 24, 5, 0.1)
    for step in (0, 1, 17, 400):  # across several epochs
        for got, want in zip(mapped.step_samples(step, 6, 2, 3), held.step_samples(step, 6, 2, 3)):
            assert torch.equal(got, want)
    assert torch.equal(mapped.val_samples(4)[0], held.val_samples(4)[0])


def test_no_default_cap_and_a_cut_is_reported(tmp_path: Path) -> None:
    files = [f for f in default_corpus_files() if f.stat().st_size][:3]
    corpus = tmp_path / "text"
    corpus.mkdir()
    for i, f in enumerate(files):
        (corpus / f"{i}.py").write_bytes(f.read_bytes())
    whole = open_corpus(str(corpus))
    joined = b"\n".join(f.read_bytes() for f in files)
    assert bytes(whole.tokens) == joined and whole.total == len(joined) and corpus_note(whole, None) is None
    cut = open_corpus(str(corpus), 1000)
    assert bytes(cut.tokens) == joined[:1000] and cut.total == len(joined)
    note = corpus_note(cut, 1000)
    assert note == f"data: data.path={str(corpus)!r}, its first 1,000 of {len(joined):,} tokens (data.max_tokens=1,000)"
    args = ["--data.path", str(corpus), "--train.seq_len", "16", "--train.val_every", "0"]  # tails too short
    assert check_corpus(parse_args([*args, "--data.max_tokens", "1000"])) == [note]  # to validate on
    assert check_corpus(parse_args(args)) == []


def test_json_lines_read_as_bytes_get_a_note(tmp_path: Path) -> None:
    # A JSON Lines file given as data.path trained on its JSON syntax, silently; gzipped, it is refused as
    # binary, with the prepare command that reads it.
    lines = tmp_path / "c.jsonl"
    lines.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(200)))
    [note] = check_corpus(parse_args(["--data.path", str(lines), "--train.seq_len", "16"]))
    assert note.startswith(f"data: data.path={str(lines)!r} is read as bytes, its JSON syntax included")
    assert f"hybridpar data prepare --input {lines} --out DATA.bin" in note
    packed = tmp_path / "c.jsonl.gz"
    packed.write_bytes(gzip.compress(lines.read_bytes()))
    with pytest.raises(ValueError, match=f"data prepare --input '{packed}' --out DATA.bin, for gzipped JSON Lines"):
        check_corpus(parse_args(["--data.path", str(packed), "--train.seq_len", "16"]))


def test_a_corpus_too_small_for_validation_is_refused_with_what_fits(tmp_path: Path) -> None:
    """Validation's train.val_batches × train.global_batch windows must fit the held-out tail: refused
    before the launch (not by every worker after it), and each setting the error offers does fit."""
    _nanogpt(tmp_path / "t.bin", 20_000)  # a 5% tail of 1,000 tokens: 7 windows of 128
    args = ["--data.path", str(tmp_path / "t.bin"), "--model.vocab_size", "50000", "--train.global_batch", "4"]
    with pytest.raises(ValueError) as err:
        check_corpus(parse_args(args))  # 4 × 4 = 16 windows
    fixes = re.findall(r"(--[\w.]+) ([\d.]+)", str(err.value).split(": use ")[1])
    assert "4 × 4 = 16 windows" in str(err.value) and "holds 7" in str(err.value)
    assert [k for k, _ in fixes] == ["--train.val_batches", "--data.val_fraction", "--train.val_every"]
    for key, value in fixes:
        assert check_corpus(parse_args([*args, key, value])) == []
    assert float(fixes[1][1]) == 0.103  # 16 windows need 16 × 128 + 1 tokens: 10.25% of 20,000, rounded up
    with pytest.raises(ValueError, match="use --train.val_every 0 .* or a larger corpus"):
        check_corpus(parse_args([*args, "--train.global_batch", "8", "--train.val_batches", "16"]))  # over half


def test_max_bytes_is_refused_with_what_to_use(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--data.max_bytes: data.max_bytes is gone .* data.max_tokens N"):
        parse_args(["--data.max_bytes", "100000"])
    toml = tmp_path / "old.toml"
    toml.write_text("[data]\nmax_bytes = 100000\n")
    with pytest.raises(ValueError, match=r"old.toml.*data.max_bytes is gone"):
        parse_args(["--config", str(toml)])
    # What a run wrote before (config.toml, a checkpoint's trainer_state.json) still reads: a record.
    old = json.loads(json.dumps(Config().to_dict()))
    old["data"].pop("max_tokens")
    old["data"]["max_bytes"] = 16_000_000
    assert Config.from_dict(old, record=True).data.max_tokens is None
    with pytest.raises(ValueError, match="data.max_bytes is gone"):
        Config.from_dict(old)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok"
    assert cli.main(["data", "train-tokenizer", "--vocab-size", "300", "--out", str(out), "--max-bytes", "60000"]) == 0
    return out


def _prepare(tok: Path, out: Path, *extra: str) -> int:
    return cli.main(["data", "prepare", "--tokenizer", str(tok), "--out", str(out), "--max-bytes", "30000", *extra])


def _tokenizer_without_eos(tok_dir: Path, where: Path, special_map: dict | None = None) -> Path:
    where.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", where / "tokenizer.json")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (where / "special_tokens_map.json").write_text(json.dumps(special_map))
    return where


def test_the_end_of_text_id_is_the_tokenizers_own_or_the_one_given(tok_dir: Path, tmp_path: Path, capsys) -> None:
    tok = Tokenizer(tok_dir)
    assert _prepare(tok_dir, tmp_path / "a.bin") == 0
    meta = json.loads((tmp_path / "a.json").read_text())
    assert (meta["eos_token"], meta["eos_id"]) == ("<|im_end|>", tok.token_id("<|im_end|>"))
    assert "each closed by '<|im_end|>'" in capsys.readouterr().out
    assert _prepare(tok_dir, tmp_path / "b.bin", "--eos-token", "<|endoftext|>") == 0
    assert json.loads((tmp_path / "b.json").read_text())["eos_id"] == tok.token_id("<|endoftext|>")
    assert _prepare(tok_dir, tmp_path / "c.bin", "--eos-id", "7") == 0
    assert json.loads((tmp_path / "c.json").read_text())["eos_id"] == 7
    # special_tokens_map.json names it where tokenizer_config.json does not (older transformers saves)
    mapped = _tokenizer_without_eos(tok_dir, tmp_path / "mapped", {"eos_token": {"content": "<|endoftext|>"}})
    assert _prepare(mapped, tmp_path / "d.bin") == 0
    assert json.loads((tmp_path / "d.json").read_text())["eos_id"] == tok.token_id("<|endoftext|>")
    bare = _tokenizer_without_eos(tok_dir, tmp_path / "bare")
    capsys.readouterr()
    for extra, want in [
        ((), f"the tokenizer {bare} names no end-of-text token"),
        (("--eos-token", "</s>"), f"--eos-token '</s>' is not a token of {bare / 'tokenizer.json'}"),
        (("--eos-id", "300"), f"--eos-id 300 is not an id of {bare / 'tokenizer.json'} (0..299)"),
        (("--eos-id", "1", "--eos-token", "x"), "give --eos-token or --eos-id, not both"),
    ]:
        assert _prepare(bare, tmp_path / "e.bin", *extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, err
        assert not list(tmp_path.glob("e.*"))


def _v1(tmp_path: Path, tok_dir: Path) -> Path:
    """A token file as `prepare` wrote it before the binary index: document starts in the JSON."""
    tok = Tokenizer(tok_dir)
    docs = [
        tok.encode(t) + [tok.token_id("<|endoftext|>")] for t in ("def f(x):\n    return x\n" * 40, "y = 2\n" * 300)
    ]
    np.array([i for d in docs for i in d], dtype="<u2").tofile(tmp_path / "old.bin")
    meta = {
        "format": "hybridpar-tokens/1",
        "dtype": "uint16",
        "tokens": sum(map(len, docs)),
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok.sha256,
        "tokenizer": str(tok_dir),
        "eos_id": tok.token_id("<|endoftext|>"),
        "source": None,
        "documents": [0, len(docs[0])],
    }
    (tmp_path / "old.json").write_text(json.dumps(meta))
    return tmp_path / "old.bin"


def test_token_files_of_the_first_format_still_load(tok_dir: Path, tmp_path: Path) -> None:
    old = _v1(tmp_path, tok_dir)
    run = ["--run-dir", str(tmp_path / "run"), "--parallel.tp", "1", "--parallel.pp", "1", "--train.seq_len", "16"]
    run += ["--train.val_every", "0"]  # a tail too short to validate on
    cfg = parse_args(["--data.path", str(old), "--data.tokenizer", str(tok_dir), "--model.vocab_size", "300", *run])
    preflight(cfg, 1)  # the index (the JSON list) checked against the tokens, the tokenizer by hash
    data = TokenData.open(str(old), None, 16, 0, 0.1)
    assert isinstance(data.tokens, np.memmap) and np.array_equal(data.tokens, np.fromfile(old, dtype="<u2"))


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run as tdr

    def boom(*a, **k):
        raise AssertionError("a worker was launched for bad input")

    monkeypatch.setattr(tdr, "run", boom)


def _refused(flags: list[str], run: Path, capsys: pytest.CaptureFixture) -> str:
    """`hybridpar train FLAGS` through the CLI's pre-flight: exit 2, one line, nothing started or created."""
    capsys.readouterr()
    rc = cli.main(["train", *flags, "--parallel.tp", "1", "--parallel.pp", "1", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("hybridpar: error: "), err
    assert not run.exists()
    return err


@pytest.fixture(scope="module")
def hf_with_tokenizer(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_init_from import llama3_hf

    hf = tmp_path_factory.mktemp("hf") / "model"
    llama3_hf(hf, vocab=300)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, hf / name)
    return hf


def test_init_from_brings_its_tokenizer(hf_with_tokenizer: Path, tmp_path: Path) -> None:
    hf = hf_with_tokenizer
    assert _prepare(hf, tmp_path / "d.bin") == 0  # prepared with the model's own tokenizer directory
    flags = ["--model.init_from", str(hf), "--data.path", str(tmp_path / "d.bin"), "--train.seq_len", "16"]
    cfg = parse_args([*flags, "--parallel.tp", "1", "--parallel.pp", "1", "--run-dir", str(tmp_path / "r")])
    cfg, _ = preflight(cfg, 1)
    assert (cfg.data.tokenizer, cfg.model.vocab_size) == (str(hf), 300)
    other = parse_args(["--model.init_from", str(hf), "--data.tokenizer", "elsewhere"])
    assert other.data.tokenizer == "elsewhere"  # a given data.tokenizer stays


def test_fine_tuning_data_of_another_tokenizer_or_bytes_refused(
    hf_with_tokenizer: Path, tok_dir: Path, tmp_path: Path, no_launch: None, capsys: pytest.CaptureFixture
) -> None:
    hf, run = hf_with_tokenizer, tmp_path / "run"
    other = tmp_path / "other"
    assert (
        cli.main(["data", "train-tokenizer", "--vocab-size", "280", "--out", str(other), "--max-bytes", "30000"]) == 0
    )
    assert _prepare(other, tmp_path / "o.bin") == 0
    err = _refused(["--model.init_from", str(hf), "--data.path", str(tmp_path / "o.bin")], run, capsys)
    assert f"data.path={str(tmp_path / 'o.bin')!r} was prepared with another tokenizer ({str(other)!r}" in err
    assert f"than model.init_from={str(hf)!r} (its tokenizer)" in err
    err = _refused(["--model.init_from", str(hf)], run, capsys)
    assert f"model.init_from={str(hf)!r} (its tokenizer) needs a token file prepared with it" in err
    assert "data.path=None is byte-level text" in err
    bare = tmp_path / "bare"  # the model without its tokenizer: bytes for a 300-id vocabulary
    shutil.copytree(hf, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    text = tmp_path / "t.txt"
    text.write_text("hello\n" * 1000)
    err = _refused(["--model.init_from", str(bare), "--data.path", str(text)], run, capsys)
    assert f"model.init_from={str(bare)!r} has a vocabulary of 300 ids and no tokenizer.json, but data.path=" in err
    assert f"{str(text)!r} is byte-level text (ids 0-255)" in err


def _damage(data: Path, kind: str) -> str:
    """Damage a prepared token file (uint32, several documents) one way; returns what the line must say."""
    meta = json.loads(data.with_suffix(".json").read_text())
    idx, n = data.with_suffix(".idx"), meta["tokens"]
    bounds = np.fromfile(idx, dtype="<u8")
    if kind == "not-a-multiple":
        with open(data, "ab") as f:
            f.write(b"\0\0")
        return f"{data} holds {4 * n + 2} bytes, but {data.with_suffix('.json')} describes {n} uint32 tokens"
    if kind == "shorter":
        with open(data, "r+b") as f:
            f.truncate(4 * (n - 10))
        return f"{data} holds {4 * (n - 10)} bytes, but {data.with_suffix('.json')} describes {n} uint32 tokens"
    if kind == "index-missing":
        idx.unlink()
        return f"{idx} (the document index of {data}) is missing"
    if kind == "index-size":
        bounds[:-1].tofile(idx)
        return f"{idx} holds {8 * (len(bounds) - 1)} bytes, but {data.with_suffix('.json')} describes"
    if kind == "index-end":
        bounds[-1] = n - 1
        bounds.tofile(idx)
        return f"{idx} does not match its tokens ({data}): the last boundary is {n - 1}, not the token count {n}"
    if kind == "index-order":
        bounds[2], bounds[3] = bounds[3], bounds[2]
        bounds.tofile(idx)
        return f"{idx} does not match its tokens ({data}): the boundaries do not rise (document 2)"
    data.with_suffix(".json").write_text(json.dumps({"format": "hybridpar-tokens/2", "state": "writing"}))
    return f"{data} was not completely written (hybridpar data prepare was interrupted); prepare it again"


@pytest.mark.parametrize(
    "kind", ["not-a-multiple", "shorter", "index-missing", "index-size", "index-end", "index-order", "interrupted"]
)
def test_damaged_token_files_refused_before_launch(
    kind: str, tok_dir: Path, tmp_path: Path, no_launch: None, capsys: pytest.CaptureFixture
) -> None:
    data = tmp_path / "d.bin"
    assert _prepare(tok_dir, data, "--dtype", "uint32") == 0
    want = _damage(data, kind)
    flags = ["--data.path", str(data), "--data.tokenizer", str(tok_dir), "--model.vocab_size", "300"]
    err = _refused([*flags, "--train.seq_len", "16"], tmp_path / "run", capsys)
    assert want in err, err


def test_a_missing_token_file_is_named_missing(
    tok_dir: Path, tmp_path: Path, no_launch: None, capsys: pytest.CaptureFixture
) -> None:
    # With a tokenizer, the document mask or in a mixture, a path that does not exist was called "a token
    # file without its description" and sent the user to prepare what they may have prepared elsewhere.
    data, gone = tmp_path / "d.bin", tmp_path / "gone.bin"
    assert _prepare(tok_dir, data) == 0
    tok = ["--data.tokenizer", str(tok_dir), "--model.vocab_size", "300"]
    for flags in (
        ["--data.path", str(gone), *tok],
        ["--data.path", str(gone), "--data.document_mask", "true"],
        ["--data.path", f"0.5:{data},0.5:{gone}", *tok],
    ):
        err = _refused(flags, tmp_path / "run", capsys)
        assert f"data.path={str(gone)!r} does not exist: give a text file" in err, err
    err = _refused(["--data.path", str(data.with_suffix(".idx")), *tok], tmp_path / "run", capsys)
    assert f"is the document index of the prepared token file {str(data)!r}: give data.path=" in err, err


def test_prepare_stopped_by_sigterm_removes_what_it_wrote(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # A scheduler's SIGTERM killed prepare at once: NAME.bin.tmp and NAME.idx.tmp stayed behind.
    from hybridpar.data import tokenfile

    real_add, calls = tokenfile.TokenFileWriter.add, []

    def add_then_term(self, ids, lengths):  # type: ignore[no-untyped-def]
        real_add(self, ids, lengths)
        calls.append(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the temporary files hold a batch

    monkeypatch.setattr(tokenfile.TokenFileWriter, "add", add_then_term)
    capsys.readouterr()
    before = signal.getsignal(signal.SIGTERM)  # the default, or what an earlier test's launch left
    assert _prepare(tok_dir, tmp_path / "d.bin") == 143
    assert capsys.readouterr().err == "hybridpar: data prepare stopped by SIGTERM: nothing written\n"
    assert calls == [1] and not list(tmp_path.iterdir())
    assert signal.getsignal(signal.SIGTERM) is before  # given back


def test_interrupted_prepare_leaves_nothing_training_accepts(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_launch: None, capsys: pytest.CaptureFixture
) -> None:
    from hybridpar.data import prepare, tokenfile

    data = tmp_path / "d.bin"
    real_add, calls = tokenfile.TokenFileWriter.add, []

    def failing_add(self, ids, lengths):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # ^C halfway through the corpus
        real_add(self, ids, lengths)

    monkeypatch.setattr(tokenfile.TokenFileWriter, "add", failing_add)
    with pytest.raises(KeyboardInterrupt):  # one document per write: the second write fails
        prepare.prepare(str(tok_dir), str(data), None, 30_000, batch_docs=1)
    assert len(calls) == 2
    assert not list(tmp_path.iterdir())  # neither the files nor their temporary names
    monkeypatch.setattr(tokenfile.TokenFileWriter, "add", real_add)
    assert _prepare(tok_dir, data) == 0
    good = data.read_bytes()
    # Failing while the complete files are renamed into place (the .bin moved, the .idx not yet): the
    # description says so, and training refuses the set rather than read a mix of old and new.
    real_replace, renames = tokenfile.os.replace, []

    def failing_replace(src, dst):  # type: ignore[no-untyped-def]
        renames.append(dst)
        if str(dst).endswith(".idx"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(tokenfile.os, "replace", failing_replace)
    with pytest.raises(OSError):
        prepare.prepare(str(tok_dir), str(data), None, 20_000)
    assert data.read_bytes() != good and not list(tmp_path.glob("*.tmp"))
    err = _refused(["--data.path", str(data), "--data.tokenizer", str(tok_dir)], tmp_path / "run", capsys)
    assert f"{data} was not completely written (hybridpar data prepare was interrupted)" in err


TEXTS = ["first document\nwith two lines\n", "zweites Dokument — ünïcödé ✓", "x = 1\n" * 50, "🚀 last"]


def test_jsonl_plain_or_gzipped_gives_the_documents_of_a_folder(tok_dir: Path, tmp_path: Path) -> None:
    from hybridpar.data.prepare import prepare

    folder = tmp_path / "folder"
    folder.mkdir()
    for i, t in enumerate(TEXTS):
        (folder / f"{i}.txt").write_text(t, encoding="utf-8")
    lines = [json.dumps({"id": i, "body": t}) for i, t in enumerate(TEXTS)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines[:2] + ["", "  "] + lines[2:]) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    metas = {
        name: prepare(str(tok_dir), str(tmp_path / f"{name}.bin"), str(src), text_key=key)
        for name, src, key in [
            ("folder", folder, "text"),
            ("jsonl", tmp_path / "c.jsonl", "body"),
            ("gz", tmp_path / "c.jsonl.gz", "body"),
        ]
    }
    assert {m["documents"] for m in metas.values()} == {len(TEXTS)}
    want = (tmp_path / "folder.bin").read_bytes()
    assert (tmp_path / "jsonl.bin").read_bytes() == want == (tmp_path / "gz.bin").read_bytes()
    assert (tmp_path / "jsonl.idx").read_bytes() == (tmp_path / "folder.idx").read_bytes()


def test_a_bad_json_line_is_named_and_nothing_is_written(tok_dir: Path, tmp_path: Path, capsys) -> None:
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"txt": "no text key"}) + "\n")
    texts = documents(str(src))
    assert next(texts) == "fine"  # read as asked for: the bad line is not reached yet
    capsys.readouterr()
    assert _prepare(tok_dir, tmp_path / "out" / "d.bin", "--input", str(src)) == 2
    err = capsys.readouterr().err
    assert err == f"hybridpar: error: {src}:2: not a JSON object with a string under 'text' (--text-key names " + (
        "the key holding each document's text)\n"
    )
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.multiprocess
def test_workers_write_the_same_files_in_order(tok_dir: Path, tmp_path: Path) -> None:
    from hybridpar.data.prepare import prepare

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"{i} " + TEXTS[i % 4] * (i % 7 + 1)}) + "\n" for i in range(60)))
    lines: list[str] = []
    one = prepare(str(tok_dir), str(tmp_path / "one.bin"), str(src), batch_docs=4)
    many = prepare(
        str(tok_dir), str(tmp_path / "many.bin"), str(src), workers=2, batch_docs=4, progress=lines.append,
        progress_every_s=0,
    )  # fmt: skip
    assert (one["tokens"], one["documents"]) == (many["tokens"], many["documents"]) and many["documents"] == 60
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"many{suffix}").read_bytes()
    assert len(lines) == 15 and all(line.endswith(" tokens/s)") for line in lines)
    assert lines[-1].startswith(f"hybridpar: {many['tokens']:,} tokens of 60 documents so far (")


def test_a_slash_s_tokenizer_closes_every_json_line_with_one_end_id(tok_dir: Path, tmp_path: Path) -> None:
    """Llama-2-style tokenizers end documents with `</s>`: taken from the tokenizer's own eos_token, one end id
    per JSON line, never one inside a document, and the index's boundaries fall just after each."""
    from tokenizers import Tokenizer as HFTokenizer

    where = tmp_path / "slash_s"
    where.mkdir()
    hf = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    hf.add_special_tokens(["</s>"])
    hf.save(str(where / "tokenizer.json"))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (where / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "</s>"}))
    eos = Tokenizer(where).token_id("</s>")
    texts = [f"document {i}: " + "def f(x):\n    return x * %d\n" % i * (1 + i % 5) for i in range(40)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    out = tmp_path / "d.bin"
    assert cli.main(["data", "prepare", "--tokenizer", str(where), "--input", str(src), "--out", str(out)]) == 0
    meta = json.loads((tmp_path / "d.json").read_text())
    assert meta["eos_id"] == eos and meta["documents"] == len(texts)
    ids = np.fromfile(out, dtype=TOKEN_DTYPES[meta["dtype"]])
    ends = np.flatnonzero(ids == eos)
    assert len(ends) == len(texts)  # exactly one per line
    bounds = np.fromfile(tmp_path / "d.idx", dtype="<u8")
    assert list(bounds[1:]) == [int(e) + 1 for e in ends]  # each document ends with its end id


def test_a_binary_or_empty_input_to_prepare_says_so(tmp_path: Path) -> None:
    """A prepared token file given back to `data prepare` (or any binary file, or an empty one) is named for what it
    is: 'holds no text' alone sent users looking for an encoding problem."""
    tokens = tmp_path / "d.bin"
    np.arange(300, dtype=np.uint16).tofile(tokens)  # ids below 256 have a zero high byte: NULs, as a real one
    with pytest.raises(ValueError, match=rf"it is binary .* \(train on it as it is: --data.path '{tokens}'\)$"):
        documents(str(tokens))
    other = tmp_path / "image.png"
    other.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with pytest.raises(ValueError, match=r"it is binary .*give text files, JSON Lines or Parquet$"):
        documents(str(other))
    empty = tmp_path / "empty.txt"
    empty.touch()
    with pytest.raises(ValueError, match=r"holds no \(non-empty\) text: the file is empty$"):
        documents(str(empty))

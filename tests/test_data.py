"""Tests for hybridpar.data.corpus: loading, determinism, dp-size independence and split hygiene."""

from __future__ import annotations

import hashlib
import os
import pathlib

import numpy as np
import pytest
import torch

from hybridpar.data import joined
from hybridpar.data.corpus import TokenData, decode, encode
from hybridpar.data.sources import default_corpus_files, open_corpus


def positions(n: int) -> torch.Tensor:
    # Token value == its position, so every sample reveals exactly where it came from.
    return torch.arange(n, dtype=torch.int64)


def test_encode_decode_round_trip() -> None:
    text = "hello, wörld — ✓ 日本語 🚀\n\ttab"
    ids = encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)  # multi-byte chars really are multi-byte
    assert decode(ids) == text
    assert decode(torch.tensor(ids).tolist()) == text


def test_decode_out_of_range_and_broken_utf8() -> None:
    assert decode([104, 300, 105]) == "h\ufffdi"
    assert decode([104, -1, 105]) == "h\ufffdi"
    # a truncated multi-byte sequence becomes a replacement char, not an exception
    assert decode([0xE2, 0x82, 104]) == "\ufffdh"


def test_default_corpus() -> None:
    files = default_corpus_files()
    assert files and files == default_corpus_files()
    assert all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)
    a = open_corpus(None, 200_000).tokens
    b = open_corpus(None, 200_000).tokens
    assert a.dtype == np.uint8 and len(a) == 200_000
    assert np.array_equal(a, b)
    assert int(a.max()) < 256
    # the stream starts with the first file, unchanged
    first = files[0].read_bytes()[:100]
    assert bytes(a[: len(first)].tolist()) == first


def test_load_text_file(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "a.txt"
    f.write_bytes("héllo world".encode())
    t = open_corpus(str(f), 1000).tokens
    assert t.dtype == np.uint8
    assert decode(t.tolist()) == "héllo world"
    assert bytes(open_corpus(str(f), 3).tokens.tolist()) == b"h\xc3\xa9"


def test_text_file_read_in_place(tmp_path: pathlib.Path) -> None:
    # A text corpus of one file is memory-mapped as a token file is, not read into every rank's memory
    # (a 64 MB JSON Lines file as data.path added its 64 MB to each rank's resident set), and its
    # vocabulary is the largest byte, found without mapping the file.
    f = tmp_path / "a.txt"
    f.write_bytes(b"abc~" * 1000)
    t = open_corpus(str(f), 10).tokens
    assert isinstance(t, np.memmap) and t.dtype == np.uint8 and bytes(t.tolist()) == b"abc~abc~ab"
    assert TokenData.open(str(f), None, 16, 0, 0.1).vocab_needed == ord("~") + 1


def test_binary_file_refused(tmp_path: pathlib.Path) -> None:
    # Read byte by byte, a binary file trained silently on whatever its bytes were (a prepared file's .idx).
    f = tmp_path / "weights.dat"
    f.write_bytes(b"\x10\x00\x00\x00" * 300)
    with pytest.raises(ValueError, match=r"data.path='.*weights.dat' is not text \(a NUL byte"):
        open_corpus(str(f))


def test_index_or_description_of_a_prepared_file(tmp_path: pathlib.Path) -> None:
    # NAME.idx or NAME.json given where NAME.bin belongs: name the .bin (the .idx trained on its bytes, the
    # .json was "too short").
    from hybridpar.data.tokenfile import TokenFileWriter

    with TokenFileWriter(tmp_path / "c.bin", "uint16") as w:
        w.add(np.arange(3000, dtype=np.uint16) % 200, np.array([1000, 2000]))
        w.commit({"dtype": "uint16", "vocab_size": 200})
    for name, what in (("c.idx", "document index"), ("c.json", "description")):
        with pytest.raises(ValueError, match=f"is the {what} of the prepared token file '.*c.bin': give data.path="):
            open_corpus(str(tmp_path / name))
    # Their folder, read as text, trained on the description's JSON alone (the .bin and .idx are binary).
    with pytest.raises(ValueError, match=r"is a folder holding prepared token files \('.*c.bin'\): give one as"):
        open_corpus(str(tmp_path))


def test_load_folder(tmp_path: pathlib.Path) -> None:
    # walk order would give top-level files first; sorting by relative path puts a/ before b.txt
    (tmp_path / "c.txt").write_bytes(b"CC")
    (tmp_path / "b.txt").write_bytes(b"BB")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_bytes(b"ZZ")
    (tmp_path / "c.dat").write_bytes(b"x\0y")  # binary: skipped
    (tmp_path / ".hidden").write_bytes(b"HH")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_bytes(b"GG")
    t = open_corpus(str(tmp_path), 1000).tokens
    assert bytes(t.tolist()) == b"ZZ\nBB\nCC"
    assert bytes(open_corpus(str(tmp_path), 4).tokens.tolist()) == b"ZZ\nB"


def test_load_bin(tmp_path: pathlib.Path) -> None:
    ids = np.array([0, 1, 50000, 65535, 7, 256], dtype=np.uint16)
    f = tmp_path / "train.bin"
    ids.astype("<u2").tofile(f)
    t = open_corpus(str(f)).tokens
    assert isinstance(t, np.memmap) and t.dtype == np.dtype("<u2")  # read in place, not copied
    assert t.tolist() == ids.tolist()
    assert open_corpus(str(f), 3).tokens.tolist() == ids[:3].tolist()


def test_vocab_needed_for_bin(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "t.bin"
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=4000).astype(np.uint16)
    ids[1234] = 40000
    ids.tofile(f)
    data = TokenData(open_corpus(str(f), 10**6).tokens, seq_len=16, seed=0, val_fraction=0.1)
    assert data.vocab_needed == 40001


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: p / "missing.txt", "does not exist"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no .*text files"),
        (lambda p: (p / "odd.bin").write_bytes(b"abc") and p / "odd.bin", "odd size"),
        (lambda p: (p / "e.txt").write_bytes(b"") or p / "e.txt", "empty"),
    ],
)
def test_load_errors(tmp_path: pathlib.Path, setup, match: str) -> None:  # type: ignore[no-untyped-def]
    path = setup(tmp_path)
    with pytest.raises(ValueError, match=match) as err:
        open_corpus(str(path), 1000)
    assert str(path) in str(err.value)


def test_folder_of_only_binary_files(tmp_path: pathlib.Path) -> None:
    (tmp_path / "x.bin.gz").write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match="no .*text files"):
        open_corpus(str(tmp_path), 1000)


def test_corpus_too_short() -> None:
    with pytest.raises(ValueError, match=r"train\.seq_len=64.*needs at least 650 tokens"):
        TokenData(positions(649), seq_len=64, seed=0, val_fraction=0.1)
    TokenData(positions(650), seq_len=64, seed=0, val_fraction=0.1)  # the stated minimum suffices


def test_train_samples_deterministic_and_dp_independent() -> None:
    a = TokenData(positions(5000), seq_len=8, seed=3, val_fraction=0.1)
    b = TokenData(positions(5000), seq_len=8, seed=3, val_fraction=0.1)
    x, y = a.train_samples(20, 10)
    assert x.shape == y.shape == (10, 8) and x.dtype == y.dtype == torch.int64
    x2, y2 = b.train_samples(20, 10)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # dp=2: two ranks fetch halves of the same global batch (step 2 of global_batch 10)
    h0, t0 = b.step_samples(2, 10, 0, 5)
    h1, t1 = b.step_samples(2, 10, 5, 5)
    assert torch.equal(torch.cat([h0, h1]), x) and torch.equal(torch.cat([t0, t1]), y)
    # resumption: a fresh object asked for a later step first, then an earlier one, agrees
    c = TokenData(positions(5000), seq_len=8, seed=3, val_fraction=0.1)
    late = c.step_samples(500, 10, 3, 4)[0]
    assert torch.equal(c.step_samples(2, 10, 0, 10)[0], x)
    assert torch.equal(a.train_samples(5003, 4)[0], late)


def test_targets_are_inputs_shifted() -> None:
    data = TokenData(positions(3000), seq_len=16, seed=1, val_fraction=0.2)
    for x, y in (data.train_samples(0, 50), data.val_samples(5)):
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(y[:, -1], x[:, -1] + 1)
        assert torch.equal(x, x[:, :1] + torch.arange(16))  # contiguous windows


def test_epochs_cover_every_window_once() -> None:
    data = TokenData(positions(1000), seq_len=10, seed=7, val_fraction=0.1)
    n = data.n_train_windows
    assert n == (900 - 1) // 10
    expected = list(range(0, n * 10, 10))
    # fetch across an epoch boundary in odd-sized chunks
    x = torch.cat([data.train_samples(s, 7)[0] for s in range(0, 3 * n, 7)])[: 3 * n]
    for e in range(3):
        starts = x[e * n : (e + 1) * n, 0].tolist()
        assert sorted(starts) == expected
    assert x[:n, 0].tolist() != x[n : 2 * n, 0].tolist()  # each epoch reshuffles
    assert x[:n, 0].tolist() != expected  # and it is shuffled at all


def test_different_seeds_different_orders() -> None:
    a = TokenData(positions(5000), seq_len=8, seed=0, val_fraction=0.1)
    b = TokenData(positions(5000), seq_len=8, seed=1, val_fraction=0.1)
    assert not torch.equal(a.train_samples(0, 32)[0], b.train_samples(0, 32)[0])


def test_val_disjoint_from_train() -> None:
    n_tokens = 2000
    data = TokenData(positions(n_tokens), seq_len=12, seed=0, val_fraction=0.25)
    train_x, train_y = data.train_samples(0, data.n_train_windows)
    train_pos = set(train_x.flatten().tolist()) | set(train_y.flatten().tolist())
    val_x, val_y = data.val_samples(data.n_val_windows)
    val_pos = set(val_x.flatten().tolist()) | set(val_y.flatten().tolist())
    assert train_pos.isdisjoint(val_pos)
    assert min(val_pos) == n_tokens - 500 and max(train_pos) < n_tokens - 500
    assert torch.equal(data.val_samples(3)[0], val_x[:3])  # fixed set: a prefix is a prefix
    with pytest.raises(ValueError, match=f"only {data.n_val_windows} exist"):
        data.val_samples(data.n_val_windows + 1)


def test_uint8_tokens_widened() -> None:
    raw = open_corpus(None, 50_000).tokens
    data = TokenData(raw, seq_len=32, seed=0, val_fraction=0.1)
    x, y = data.train_samples(0, 4)
    assert x.dtype == torch.int64 and int(x.max()) < 256
    assert data.vocab_needed == int(raw.max()) + 1


def _joined_in_memory(files: list[pathlib.Path]) -> bytes:
    """What the tokens were when a folder was joined in memory: the text files' bytes, b"\\n" between."""
    return b"\n".join(b for f in files if (b := f.read_bytes()) and b"\0" not in b[:8192])


def test_a_folder_and_the_default_corpus_are_read_in_place(tmp_path: pathlib.Path) -> None:
    """One copy per node: every open (every rank) maps the same file of the join, the same bytes in the same
    order as the in-memory join they replace; a changed file makes a new join, never reads the old."""
    folder = tmp_path / "texts"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "z.txt").write_bytes(b"ZZ" * 5000)
    (folder / "b.txt").write_bytes("é\n".encode() * 3000)
    (folder / "c.dat").write_bytes(b"x\0y")  # binary: skipped
    (folder / "d.txt").write_bytes(b"")  # empty: skipped
    files = [folder / "a" / "z.txt", folder / "b.txt", folder / "c.dat", folder / "d.txt"]
    want = _joined_in_memory(files)
    first, second = open_corpus(str(folder)), open_corpus(str(folder))
    for c in (first, second):
        assert isinstance(c.tokens, np.memmap) and bytes(c.tokens) == want and c.total == len(want)
    assert first.tokens.filename == second.tokens.filename
    assert TokenData.open(str(folder), None, 16, 0, 0.1).vocab_needed == max(want) + 1
    cut = open_corpus(str(folder), 10_001)
    assert bytes(cut.tokens) == want[:10_001] and cut.total == len(want)
    (folder / "b.txt").write_bytes("è\n".encode() * 3000)  # same size, other bytes
    changed = open_corpus(str(folder))
    assert bytes(changed.tokens) == _joined_in_memory(files) != want
    assert changed.tokens.filename != first.tokens.filename
    default = open_corpus(None, 300_000).tokens
    assert isinstance(default, np.memmap)
    assert bytes(default) == _joined_in_memory(default_corpus_files())[:300_000]


def test_a_join_folder_another_user_could_write_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    shared = tmp_path / f"hybridpar-{os.getuid()}-joined"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (tmp_path / "t.txt").write_bytes(b"text")
    with pytest.raises(ValueError, match="must be a folder of this user's only"):
        open_corpus(str(tmp_path))


def test_a_join_that_cannot_be_written_says_where_and_why(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = str(tmp_path).encode()  # a join no earlier run wrote
    (tmp_path / "t.txt").write_bytes(text)

    def full(*args: object, **kw: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hybridpar.data.joined.os.replace", full)
    with pytest.raises(
        ValueError, match=rf"could not write the join of 1 text files \({len(text)} bytes\) to .*No space left"
    ):
        open_corpus(str(tmp_path))
    name = hashlib.sha256(text).hexdigest()
    assert not list(joined.cache_dir().glob(f".{name[:16]}-*")) and not (joined.cache_dir() / f"{name}.txt").exists()

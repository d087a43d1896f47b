"""Opening a corpus for training: text (bytes, the default) or a token file read in place.

The default corpus is the running interpreter's standard library source, which every machine with
Python has; a folder is its text files, sorted; a token file (`hybridpar data prepare`, or nanoGPT's
uint16 `.bin`) is memory-mapped, never copied, so opening it costs nothing whatever its size; text files
are mapped too, a folder's (and the default corpus's) joined into one file per node (`joined.py`).
"""

from __future__ import annotations

import functools
import os
import pathlib
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybridpar.data.joined import BINARY_SNIFF_BYTES, is_binary, join_files
from hybridpar.data.tokenfile import FORMAT, INDEX_DTYPE, index_path, max_id, open_tokens, read_sidecar

EXAMPLE_MIXTURE = '"0.7:web.bin,0.3:code.bin"'  # how a mixture is written (data/mixture.py)
# Directory names never taken into the default corpus: tests are huge, repetitive and full of
# deliberately odd data; site-packages differs between environments and would break determinism.
EXCLUDED_STDLIB_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__"})


def _walk_sorted(root: pathlib.Path, skip_dir: frozenset[str], suffix: str | None) -> list[pathlib.Path]:
    """Regular files under ``root``, sorted by relative POSIX path; hidden entries are skipped.

    Pruning during the walk (rather than filtering afterwards) keeps excluded trees such as
    site-packages from being traversed at all. Directory symlinks are not followed (no cycles).
    """
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dir]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            full = pathlib.Path(dirpath, name)
            if full.is_file():
                found.append((full.relative_to(root).as_posix(), full))
    found.sort(key=lambda item: item[0])
    return [p for _, p in found]


def default_corpus_files() -> list[pathlib.Path]:
    """The running interpreter's stdlib ``.py`` files, sorted by path relative to the stdlib.

    Skipped: hidden files/dirs and any directory named test, tests, site-packages, dist-packages
    or __pycache__ (see EXCLUDED_STDLIB_DIRS). idlelib and the rest are kept. The result depends
    only on the Python installation, so it is deterministic for a given interpreter.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return _walk_sorted(root, EXCLUDED_STDLIB_DIRS, ".py")


@functools.cache
def _default_corpus(cap: int | None) -> tuple[pathlib.Path, int]:
    """The default corpus's join (cut to ``cap``; joined.join_files) and the size of all of it, found once per
    process and cap: the interpreter's stdlib does not change while it runs, and listing, sniffing and
    hashing its ~800 files costs 0.1-0.2 s, which a process that trains many runs (the tests' references,
    a launch's worker running several configs) paid at every run."""
    data, _, total = join_files(default_corpus_files(), cap)
    return (pathlib.Path("") if data is None else pathlib.Path(data.filename)), total


@dataclass(frozen=True)
class Corpus:
    """A corpus opened for training, read in place: ``tokens`` is a read-only memory map (of a token file, a
    text file, or the join of a folder's or the default corpus's text files: joined.join_files), and only the
    windows a step asks for are ever read."""

    tokens: np.ndarray  # (n,) ids
    total: int  # tokens of the whole corpus: more than n where data.max_tokens cuts it
    name: str  # how messages name it
    vocab: Callable[[], int] = field(repr=False)  # ids are below this (read, or scanned, when asked)
    # A prepared file's document boundaries (the index, memory-mapped: each document's first token, then the
    # token count); None for text and nanoGPT files, which have none.
    index: np.ndarray | None = field(default=None, repr=False)


def open_corpus(path: str | None, max_tokens: int | None = None) -> Corpus:
    """Open a corpus, its first ``max_tokens`` tokens only where that is given.

    * ``None``: the default stdlib corpus (``default_corpus_files``), joined with b"\\n" (joined.join_files).
    * a folder: every non-hidden, non-binary regular file below it, sorted, joined alike.
    * ``*.bin`` with a ``.json`` sidecar (``hybridpar data prepare``): its uint16 or uint32 tokens.
    * ``*.bin``: nanoGPT-style little-endian uint16 tokens.
    * any other file: its bytes, memory-mapped (a binary file is refused).
    Problems raise ValueError naming the path.
    """
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"data.max_tokens must be a positive integer or none, got {max_tokens}")
    if path is None:
        joined, total = _default_corpus(max_tokens)
        if not total:
            raise ValueError(f"default corpus (stdlib at {sysconfig.get_paths()['stdlib']}) is empty")
        if not joined.is_file():  # removed since (a temporary directory cleaned): join again
            _default_corpus.cache_clear()
            joined, total = _default_corpus(max_tokens)
        return _text_corpus(np.memmap(joined, dtype=np.uint8, mode="r"), total, "the default corpus (data.path none)")
    p, name = pathlib.Path(path), f"data.path={path!r}"
    check_path(path)
    if p.is_dir():
        data, n_text, total = join_files(_walk_sorted(p, frozenset(), None), max_tokens)
        if data is None:
            raise ValueError(f"data folder {path!r} contains no (non-empty, non-hidden) text files")
        return _text_corpus(data, total, name)
    if not p.is_file():
        raise ValueError(f"data path {path!r} is neither a regular file nor a folder")
    if p.suffix == ".bin" and (meta := read_sidecar(p)) is not None:
        n = _cut(meta["tokens"], max_tokens)
        if meta["format"] == FORMAT:
            index = np.memmap(index_path(p), dtype=INDEX_DTYPE, mode="r")
        else:  # format 1: the starts as a JSON list
            index = np.asarray([*meta["documents"], meta["tokens"]], dtype=INDEX_DTYPE)
        return Corpus(open_tokens(p, meta["dtype"], n), meta["tokens"], name, lambda: meta["vocab_size"], index)
    if p.suffix == ".bin":
        size = p.stat().st_size
        if size == 0:
            raise ValueError(f"token file {path!r} is empty")
        if size % 2:
            raise ValueError(f"token file {path!r} has odd size {size} bytes; expected uint16 tokens")
        n = _cut(size // 2, max_tokens)
        return Corpus(open_tokens(p, "uint16", n), size // 2, name, lambda: max_id(p, "uint16", n) + 1)
    return _text_file(p, name, max_tokens)


def check_path(path: str) -> None:
    """What a corpus path cannot be, whatever else is asked of it (the pre-flight's token checks ask this
    too): a path that does not exist, a folder of prepared token files, and a prepared file's index or
    description given for its `.bin`."""
    p, name = pathlib.Path(path), f"data.path={path!r}"
    if not p.exists():
        raise ValueError(
            f"{name} does not exist: give a text file or a folder of them (read as bytes), a token file "
            f"(hybridpar data prepare --out DATA.bin), or no data.path for the embedded corpus"
        )
    if p.is_dir() and (bins := sorted(str(b) for b in p.glob("*.bin") if b.with_suffix(".json").is_file())):
        # Read as a folder of text, it would train on the descriptions' JSON as bytes (the .bin and .idx
        # skipped as binary): the token files were surely meant.
        raise ValueError(
            f"{name} is a folder holding prepared token files ({', '.join(map(repr, bins[:3]))}"
            f"{', …' if len(bins) > 3 else ''}): give one as data.path, or several as a mixture "
            f"(data.path={EXAMPLE_MIXTURE})"
        )
    prepared = p.with_suffix(".bin")
    if p.suffix in (".idx", ".json") and prepared.is_file() and read_sidecar(prepared) is not None:
        what = "document index" if p.suffix == ".idx" else "description"
        raise ValueError(
            f"{name} is the {what} of the prepared token file {str(prepared)!r}: give data.path={str(prepared)!r}"
        )


def _text_file(p: pathlib.Path, name: str, max_tokens: int | None) -> Corpus:
    """One text file, its bytes the tokens, memory-mapped like a token file: a rank holds only the windows
    a batch reads, whatever the file's size. A binary file is refused: read byte by byte it would train on
    whatever its bytes are (a folder's binary files are skipped alike)."""
    size = p.stat().st_size
    if size == 0:
        raise ValueError(f"data file {str(p)!r} is empty")
    if is_binary(p):
        raise ValueError(
            f"{name} is not text (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes), and a file other than a "
            f".bin token file is read as text, byte by byte: give a text file or a folder of them, or a token "
            f"file (hybridpar data prepare --input {str(p)!r} --out DATA.bin, for gzipped JSON Lines or Parquet)"
        )
    n = _cut(size, max_tokens)
    tokens = np.memmap(p, dtype=np.uint8, mode="r")[:n]
    return Corpus(tokens, size, name, lambda: max_id(p, "uint8", n) + 1)


def _cut(total: int, max_tokens: int | None) -> int:
    return total if max_tokens is None else min(total, max_tokens)


def _text_corpus(tokens: np.ndarray, total: int, name: str) -> Corpus:
    """A join's memory map (joined.join_files) as a corpus; its largest byte read through a small buffer."""
    return Corpus(tokens, total, name, lambda: max_id(tokens.filename, "uint8", len(tokens)) + 1)


def corpus_note(corpus: Corpus, max_tokens: int | None) -> str | None:
    """The line a run prints where data.max_tokens cuts the corpus: how much of how much it uses."""
    if max_tokens is None:
        return None
    n = len(corpus.tokens)
    return f"data: {corpus.name}, its first {n:,} of {corpus.total:,} tokens (data.max_tokens={max_tokens:,})"

"""Token files of `hybridpar data prepare`, read in place: `NAME.bin` holds the ids (little-endian uint16
when the vocabulary fits, else uint32), `NAME.idx` the document boundaries (little-endian uint64: the
first token of each document, then the token count, so document i is ids[idx[i]:idx[i+1]] — Megatron's
binary index), and `NAME.json` describes both: format, dtype, token and document counts, vocabulary,
the tokenizer's sha256 and path, the end-of-document id.

Format 1 (before the index) kept the document starts as a JSON list in `NAME.json`; such files still
load. A plain `.bin` without `NAME.json` is a nanoGPT file of uint16 ids.

`TokenFileWriter` writes under temporary names and renames only once everything is written, so an
interrupted `prepare` leaves nothing that training would accept (see `commit`).
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
from typing import Any

import numpy as np

TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}
FORMAT = "hybridpar-tokens/2"
FORMAT_V1 = "hybridpar-tokens/1"  # document starts as a JSON list in the sidecar
INDEX_DTYPE = np.dtype("<u8")
WRITING = "writing"  # the sidecar's state while `prepare` renames its files into place
CHUNK = 1 << 22  # items per read when scanning a file (bounded memory whatever its size)


def sidecar_path(bin_path: str | pathlib.Path) -> pathlib.Path:
    """`corpus.bin` -> `corpus.json`: where `hybridpar data prepare` describes a token file."""
    return pathlib.Path(bin_path).with_suffix(".json")


def index_path(bin_path: str | pathlib.Path) -> pathlib.Path:
    """`corpus.bin` -> `corpus.idx`: the document boundaries of a token file."""
    return pathlib.Path(bin_path).with_suffix(".idx")


def _again(p: pathlib.Path) -> str:
    return f"prepare it again (hybridpar data prepare --out {p})"


def read_sidecar(bin_path: str | pathlib.Path) -> dict[str, Any] | None:
    """The description of a prepared token file (None: a plain nanoGPT uint16 file without one). Raises
    ValueError naming the files when they do not agree: dtype and count against the token file's size,
    document count against the index's size (the index's content: `check_index`)."""
    side, p = sidecar_path(bin_path), pathlib.Path(bin_path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{side} (the description of {p}) cannot be read: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, FORMAT_V1):
        raise ValueError(f"{side} is not a {FORMAT} description of {p}; {_again(p)}")
    if meta.get("state") == WRITING:
        raise ValueError(f"{p} was not completely written (hybridpar data prepare was interrupted); {_again(p)}")
    if meta.get("dtype") not in TOKEN_DTYPES or not _count(meta.get("tokens"), 1):
        raise ValueError(f"{side}: dtype must be one of {', '.join(TOKEN_DTYPES)} and tokens a positive count")
    size, item = p.stat().st_size, np.dtype(TOKEN_DTYPES[meta["dtype"]]).itemsize
    if size != meta["tokens"] * item:
        short = "is shorter than" if size < meta["tokens"] * item else "does not match"
        raise ValueError(
            f"{p} holds {size} bytes, but {side} describes {meta['tokens']} {meta['dtype']} tokens "
            f"({meta['tokens'] * item} bytes): the file {short} its description; {_again(p)}"
        )
    if meta["format"] == FORMAT:
        _check_index_size(p, meta)
    return meta


def _count(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _check_index_size(p: pathlib.Path, meta: dict[str, Any]) -> None:
    idx, side = index_path(p), sidecar_path(p)
    if not _count(meta.get("documents"), 1):
        raise ValueError(f"{side}: documents must be a positive count; {_again(p)}")
    if not idx.is_file():
        raise ValueError(f"{idx} (the document index of {p}) is missing; {_again(p)}")
    want = (meta["documents"] + 1) * INDEX_DTYPE.itemsize
    if (size := idx.stat().st_size) != want:
        raise ValueError(
            f"{idx} holds {size} bytes, but {side} describes {meta['documents']} documents ({want} bytes: "
            f"{meta['documents'] + 1} uint64 boundaries); {_again(p)}"
        )


def document_count(meta: dict[str, Any]) -> int:
    """Documents of a described token file, in either format."""
    return meta["documents"] if meta["format"] == FORMAT else len(meta["documents"])


def check_index(bin_path: str | pathlib.Path, meta: dict[str, Any]) -> None:
    """The document boundaries against the tokens: starting at 0, rising, ending at the token count
    (format 1: the JSON list's starts, below the token count). Reads the index in bounded chunks."""
    p = pathlib.Path(bin_path)
    if meta["format"] == FORMAT_V1:
        starts = meta["documents"]
        ok = isinstance(starts, list) and starts and starts[0] == 0 and all(isinstance(s, int) for s in starts)
        if not ok or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= meta["tokens"]:
            raise ValueError(
                f"{sidecar_path(p)}: the document starts do not fit the {meta['tokens']} tokens; {_again(p)}"
            )
        return
    idx = np.memmap(index_path(p), dtype=INDEX_DTYPE, mode="r")
    prev, where = None, None
    for lo in range(0, len(idx), CHUNK):
        part = np.array(idx[lo : lo + CHUNK + 1])  # one boundary of overlap: each step is checked
        if lo == 0 and part[0] != 0:
            where = "the first boundary is not 0"
        elif np.any(part[1:] <= part[:-1]):
            where = f"the boundaries do not rise (document {lo + int(np.argmax(part[1:] <= part[:-1]))})"
        if where:
            break
        prev = int(part[-1])
    if where is None and prev != meta["tokens"]:
        where = f"the last boundary is {prev}, not the token count {meta['tokens']}"
    del idx
    if where:
        raise ValueError(f"{index_path(p)} does not match its tokens ({p}): {where}; {_again(p)}")


def open_tokens(bin_path: str | pathlib.Path, dtype: str, count: int | None = None) -> np.memmap:
    """The token file's ids, memory-mapped read-only: nothing is read until a window is asked for."""
    mm = np.memmap(bin_path, dtype=np.dtype(TOKEN_DTYPES[dtype]), mode="r")
    return mm if count is None else mm[:count]


def release_pages(ids: np.ndarray) -> None:
    """Take the pages a read of `ids` mapped out of this process's resident set, where `ids` is (a view
    of) a token file's memory map: MADV_DONTNEED, after which they stay in the page cache, shared by the
    ranks and reclaimable, and the next read maps them again. Without it a rank's RSS grows toward the
    file's size as training samples all of it: kernels with large folios map up to 2 MB around each
    window read (measured: 33 windows of 1025 ids mapped 62 MB of a 2 GB file on Linux 6.18)."""
    base = ids
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is not None and hasattr(mmap, "MADV_DONTNEED"):
        base.madvise(mmap.MADV_DONTNEED)


def max_id(bin_path: str | pathlib.Path, dtype: str, count: int) -> int:
    """The largest id among the first `count` of the file, read in chunks through a small buffer (not the
    memory map, whose pages would stay resident). `dtype`: a token file's, or "uint8" for a text file's bytes."""
    dt, top = np.dtype(TOKEN_DTYPES.get(dtype, dtype)), 0
    with open(bin_path, "rb") as f:
        for lo in range(0, count, CHUNK):
            part = np.fromfile(f, dtype=dt, count=min(CHUNK, count - lo))
            top = max(top, int(part.max()))
    return top


class TokenFileWriter:
    """Writes `NAME.bin` and `NAME.idx` as documents come (`add`), then `commit`s them with `NAME.json`.
    Until the commit everything sits under temporary names (`NAME.bin.tmp`, ...); a failure or an
    interrupt removes them (`abort`, or leaving the `with` block by an exception)."""

    def __init__(self, out: str | pathlib.Path, dtype: str) -> None:
        self.out, self.dtype = pathlib.Path(out), np.dtype(TOKEN_DTYPES[dtype])
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = {p: p.with_name(p.name + ".tmp") for p in (self.out, index_path(self.out), sidecar_path(self.out))}
        self._bin = open(self.tmp[self.out], "wb")
        self._idx = open(self.tmp[index_path(self.out)], "wb")
        self.tokens = self.documents = 0
        np.zeros(1, dtype=INDEX_DTYPE).tofile(self._idx)

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: their ids one after another (each document ending in its end-of-document id)
        and each one's length."""
        if not len(lengths):
            return
        ids.astype(self.dtype, copy=False).tofile(self._bin)
        ends = self.tokens + np.cumsum(lengths, dtype=np.uint64)
        ends.astype(INDEX_DTYPE).tofile(self._idx)
        self.tokens, self.documents = int(ends[-1]), self.documents + len(lengths)

    def commit(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Close the files and put them in place. The sidecar is first replaced by one saying `writing`, so
        that between the renames neither an older description nor a bare `.bin` (a nanoGPT file to the
        reader) is taken for the new tokens; the full description, renamed last, completes the set."""
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        meta = {"format": FORMAT, **meta, "tokens": self.tokens, "documents": self.documents}
        side = sidecar_path(self.out)
        self._write_json(side, {"format": FORMAT, "state": WRITING})
        os.replace(self.tmp[self.out], self.out)
        os.replace(self.tmp[index_path(self.out)], index_path(self.out))
        self._write_json(side, meta)
        return meta

    def _write_json(self, path: pathlib.Path, obj: dict[str, Any]) -> None:
        tmp = self.tmp[path]
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def abort(self) -> None:
        for f in (self._bin, self._idx):
            f.close()
        for tmp in self.tmp.values():
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TokenFileWriter":
        return self

    def __exit__(self, kind: type | None, *_: Any) -> None:
        if kind is not None:
            self.abort()

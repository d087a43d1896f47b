"""The documents `hybridpar data` reads, one at a time: each text file is one document; each line of a
JSON Lines file (`*.jsonl`, `*.ndjson`) is one, its text under a key (`--text-key`, default `text`).
Either may be gzip-compressed (`*.gz`). Each row of a Parquet file (`*.parquet`, read with pyarrow, the
`parquet` extra) is one, its text in the column `--text-key`. A folder is its files, sorted; the default
corpus is the Python standard library's source. Nothing is read before it is asked for, so memory holds
one document (one line of JSON Lines, one row group of a Parquet file's text column) at a time whatever
the corpus's size.
"""

from __future__ import annotations

import gzip
import itertools
import json
import pathlib
from collections.abc import Iterator
from typing import IO

from hybridpar.data.joined import BINARY_SNIFF_BYTES, is_binary
from hybridpar.data.sources import _walk_sorted, default_corpus_files

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIX = ".parquet"


def documents(path: str | None, max_bytes: int | None = None, text_key: str = "text") -> Iterator[str]:
    """The corpus at `path` (None: the default one) as texts, read as they are asked for; at most
    `max_bytes` bytes of UTF-8 in all where given. Binary and empty text files are skipped, as in
    training's byte-level corpus (sources.py). ValueError at once if it holds no text at all, and when
    reached for a JSON line that holds no text under `text_key` (naming the file and the line)."""
    if path is None:
        files = default_corpus_files()
    else:
        p = pathlib.Path(path)
        if not p.exists():
            raise ValueError(f"--input {path!r} does not exist")
        files = _walk_sorted(p, frozenset(), None) if p.is_dir() else [p]
    texts = _texts(files, max_bytes, text_key)
    first = next(texts, None)
    if first is None:
        raise ValueError(f"--input {path!r} holds no (non-empty) text{_why_no_text(files)}")
    return itertools.chain([first], texts)


def _why_no_text(files: list[pathlib.Path]) -> str:
    """Why a single plain file gave no text: binary (a prepared token file, most likely), or empty."""
    if len(files) != 1 or files[0].name.endswith((PARQUET_SUFFIX, ".gz") + JSONL_SUFFIXES):
        return ""
    if files[0].stat().st_size == 0:
        return ": the file is empty"
    if not is_binary(files[0]):
        return ""
    hint = f" (train on it as it is: --data.path {str(files[0])!r})" if files[0].suffix == ".bin" else ""
    return (
        f": it is binary (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes); give text files, JSON Lines or "
        f"Parquet{hint}"
    )


def _texts(files: list[pathlib.Path], max_bytes: int | None, text_key: str) -> Iterator[str]:
    used = 0
    for f in files:
        for raw in _raw_documents(f, None if max_bytes is None else max_bytes - used, text_key):
            raw = raw if max_bytes is None else raw[: max_bytes - used]
            if raw:
                used += len(raw)
                yield raw.decode("utf-8", errors="replace")
            if max_bytes is not None and used >= max_bytes:
                return


def _open(f: pathlib.Path) -> IO[bytes]:
    return gzip.open(f, "rb") if f.name.endswith(".gz") else open(f, "rb")


def _raw_documents(f: pathlib.Path, budget: int | None, text_key: str) -> Iterator[bytes]:
    """The documents of one file as UTF-8 bytes (a text file's first `budget` bytes only, where given)."""
    name = f.name[:-3] if f.name.endswith(".gz") else f.name
    if f.name.endswith(PARQUET_SUFFIX):
        yield from _parquet(f, text_key)
        return
    if name.endswith(JSONL_SUFFIXES):
        yield from _jsonl(f, text_key)
        return
    try:
        with _open(f) as fh:
            raw = fh.read() if budget is None else fh.read(max(budget, 0))
    except (OSError, EOFError) as e:  # a damaged .gz
        raise ValueError(f"{f} cannot be read: {e}") from None
    if raw and b"\0" not in raw[:BINARY_SNIFF_BYTES]:
        yield raw


def _jsonl(f: pathlib.Path, text_key: str) -> Iterator[bytes]:
    try:
        with _open(f) as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line).get(text_key)
                except (ValueError, AttributeError):
                    text = None
                if not isinstance(text, str):
                    raise ValueError(
                        f"{f}:{n}: not a JSON object with a string under {text_key!r} (--text-key names the "
                        f"key holding each document's text)"
                    )
                yield text.encode("utf-8", errors="surrogatepass")
    except (OSError, EOFError) as e:  # a damaged .gz
        raise ValueError(f"{f} cannot be read: {e}") from None


def _parquet(f: pathlib.Path, text_key: str) -> Iterator[bytes]:
    """The rows' texts of a Parquet file's column `text_key`, one row group read at a time (its other
    columns never read). ValueError naming the file: not Parquet, no such column, not text, a null row."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{f} is a Parquet file, which needs pyarrow: pip install 'hybridpar[parquet]'") from None
    try:
        pf = pq.ParquetFile(f)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{f} cannot be read as Parquet: {e}") from None
    schema = pf.schema_arrow
    if text_key not in schema.names:
        raise ValueError(
            f"{f} has no column {text_key!r} (its columns: {', '.join(schema.names)}); --text-key names the "
            f"column holding each document's text"
        )
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{f}: column {text_key!r} holds {kind}, not text (--text-key names the text column)")
    row = 0
    with pf:
        for g in range(pf.num_row_groups):
            for text in pf.read_row_group(g, columns=[text_key]).column(0).to_pylist():
                row += 1
                if text is None:
                    raise ValueError(f"{f}: row {row} has no text in column {text_key!r} (null)")
                yield text.encode("utf-8", errors="surrogatepass")

"""Token files of `hybridpar data prepare`, read in place: `NAME.bin` holds the ids (little-endian uint16
when the vocabulary fits, else uint32) and `NAME.json` describes them: format, dtype, token count,
vocabulary, the tokenizer's sha256 and path, the end-of-document id, the document starts. A plain `.bin`
without `NAME.json` is a nanoGPT file of uint16 ids.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}
FORMAT = "hybridpar-tokens/1"
CHUNK = 1 << 22  # items per read when scanning a file (bounded memory whatever its size)


def sidecar_path(bin_path: str | pathlib.Path) -> pathlib.Path:
    """`corpus.bin` -> `corpus.json`: where `hybridpar data prepare` describes a token file."""
    return pathlib.Path(bin_path).with_suffix(".json")


def _again(p: pathlib.Path) -> str:
    return f"prepare it again (hybridpar data prepare --out {p})"


def read_sidecar(bin_path: str | pathlib.Path) -> dict[str, Any] | None:
    """The description of a prepared token file (None: a plain nanoGPT uint16 file without one). Raises
    ValueError naming both files when they do not agree (dtype and count against the file's size)."""
    side, p = sidecar_path(bin_path), pathlib.Path(bin_path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{side} (the description of {p}) cannot be read: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{side} is not a {FORMAT} description of {p}; {_again(p)}")
    if meta.get("dtype") not in TOKEN_DTYPES or not _count(meta.get("tokens"), 1):
        raise ValueError(f"{side}: dtype must be one of {', '.join(TOKEN_DTYPES)} and tokens a positive count")
    size, item = p.stat().st_size, np.dtype(TOKEN_DTYPES[meta["dtype"]]).itemsize
    if size != meta["tokens"] * item:
        short = "is shorter than" if size < meta["tokens"] * item else "does not match"
        raise ValueError(
            f"{p} holds {size} bytes, but {side} describes {meta['tokens']} {meta['dtype']} tokens "
            f"({meta['tokens'] * item} bytes): the file {short} its description; {_again(p)}"
        )
    return meta


def _count(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def open_tokens(bin_path: str | pathlib.Path, dtype: str, count: int | None = None) -> np.memmap:
    """The token file's ids, memory-mapped read-only: nothing is read until a window is asked for."""
    mm = np.memmap(bin_path, dtype=np.dtype(TOKEN_DTYPES[dtype]), mode="r")
    return mm if count is None else mm[:count]


def max_id(bin_path: str | pathlib.Path, dtype: str, count: int) -> int:
    """The largest id among the first `count` of the file, read in chunks through a small buffer (not the
    memory map, whose pages would stay resident)."""
    dt, top = np.dtype(TOKEN_DTYPES[dtype]), 0
    with open(bin_path, "rb") as f:
        for lo in range(0, count, CHUNK):
            part = np.fromfile(f, dtype=dt, count=min(CHUNK, count - lo))
            top = max(top, int(part.max()))
    return top

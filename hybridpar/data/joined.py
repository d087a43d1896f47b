"""Text files joined into one file once per node, memory-mapped by every rank (pure file I/O).

A folder of text files (and the default corpus, the stdlib's ~800 files) is trained on as their bytes
joined with b"\\n". Joined in memory, every rank would hold the whole join (12.6 MB for the default corpus, a
folder's full size for a folder). Here the join is written to a file named by the sha256 of its bytes in
a per-user folder of the system's temporary directory, and each rank maps it read-only like a token file:
the page cache holds one copy per node, and a rank's resident set only the windows a batch reads.

Every rank writes the file itself if it is missing (to a file of its own, then an atomic rename onto the
content's name), so no rank waits on another and none can read a half-written join: two ranks that race
write the same bytes, and the last rename wins. The name is the content's hash, so a changed file never
reads an old join; a join is reused across runs and only re-read (to hash it), never re-written.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import numpy as np

BINARY_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB: the heuristic git and grep use to call a file binary
COPY_CHUNK = 1 << 20


def cache_dir() -> pathlib.Path:
    """This user's folder of joins (private: another user could otherwise plant a join under a name)."""
    d = pathlib.Path(tempfile.gettempdir()) / f"hybridpar-{os.getuid()}-joined"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"{d} (where joined text corpora are kept) must be a folder of this user's only (mode 700): "
            f"remove it, or set TMPDIR to another temporary directory"
        )
    return d


def is_binary(p: pathlib.Path) -> bool:
    """A NUL byte in the file's first BINARY_SNIFF_BYTES: not text."""
    with open(p, "rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def _text_files(files: Iterable[pathlib.Path]) -> list[tuple[pathlib.Path, int]]:
    """(path, size) of each file that is text: non-empty and not binary."""
    return [(p, size) for p in files if (size := p.stat().st_size) and not is_binary(p)]


def _chunks(text: list[tuple[pathlib.Path, int]], n: int) -> Iterator[bytes]:
    """The first `n` bytes of the join, in chunks: each file's bytes (as many as it had when listed), with
    b"\\n" between files."""
    left = n
    for i, (path, size) in enumerate(text):
        if i and left:
            yield b"\n"
            left -= 1
        with open(path, "rb") as f:
            todo = min(size, left)
            while todo > 0:
                chunk = f.read(min(COPY_CHUNK, todo))
                if not chunk:
                    raise ValueError(f"{str(path)!r} shrank while it was read ({size} bytes when listed)")
                yield chunk
                todo -= len(chunk)
                left -= len(chunk)
        if not left:
            return


def _write(out: BinaryIO, chunks: Iterable[bytes]) -> str:
    """Write the chunks; their sha256."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
        out.write(chunk)
    return digest.hexdigest()


def join_files(files: Iterable[pathlib.Path], cap: int | None) -> tuple[np.ndarray | None, int, int]:
    """The text files among `files` joined with b"\\n", cut to the first `cap` bytes (None: all of them),
    as a read-only memory map of the node's one copy (None if there is no text); with the number of text
    files and the size of the whole join."""
    text = _text_files(files)
    total = sum(size for _, size in text) + max(0, len(text) - 1)  # the separators count like any other byte
    n = total if cap is None else min(cap, total)
    if n == 0:
        return None, len(text), total
    digest = hashlib.sha256()
    for chunk in _chunks(text, n):
        digest.update(chunk)
    path = cache_dir() / f"{digest.hexdigest()}.txt"
    if not path.is_file() or path.stat().st_size != n:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                if _write(out, _chunks(text, n)) != path.stem:
                    raise ValueError(f"a text file of {len(text)} changed while the corpus was read: open it again")
            os.replace(tmp, path)  # atomic: a reader sees no join or a whole one
        except BaseException as e:
            pathlib.Path(tmp).unlink(missing_ok=True)
            if isinstance(e, OSError):  # a full or read-only temporary directory
                raise ValueError(
                    f"could not write the join of {len(text)} text files ({n:,} bytes) to {path.parent}: {e}; "
                    f"free space there, or set TMPDIR to a temporary directory with room"
                ) from e
            raise
    return np.memmap(path, dtype=np.uint8, mode="r"), len(text), total

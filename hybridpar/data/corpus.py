"""Language-model data, byte-level by default: deterministic, resumable, independent of the dp size.

Every global training sample is a pure function of (corpus, seq_len, seed, sample index), so any
rank can compute any sample without communication, and resuming at step k yields exactly the
samples an uninterrupted run would have seen. Rank r of a data-parallel group simply asks for its
slice of the step's global batch (``step_samples``); changing the dp size only changes slicing.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sysconfig
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch

BYTE_VOCAB = 256
# A NUL byte in the first 8 KiB is the same heuristic git/grep use to call a file binary.
BINARY_SNIFF_BYTES = 8192
# Directory names never taken into the default corpus: tests are huge, repetitive and full of
# deliberately odd data; site-packages differs between environments and would break determinism.
EXCLUDED_STDLIB_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__"})
# Epoch permutations kept: a step's batch spans at most two epochs, a few more absorb val/eval jitter.
PERM_CACHE_SIZE = 4
SEED_MULTIPLIER = 1_000_003
# Token files of `hybridpar data prepare` (prepare.py): ids as little-endian unsigned integers.
TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}
SIDECAR_FORMAT = "hybridpar-tokens/1"


def encode(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as token ids 0..255."""
    return list(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
    """Bytes back to text with ``errors="replace"``.

    Ids outside 0..255 (a model with vocab_size > 256 can emit them) are rendered as one U+FFFD
    each: they are mapped to byte 0xFF, which is never valid in UTF-8, so it decodes to exactly
    one replacement character and also terminates any partial multi-byte sequence before it.
    """
    raw = bytes(t if 0 <= t < BYTE_VOCAB else 0xFF for t in (int(x) for x in tokens))
    return raw.decode("utf-8", errors="replace")


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


def _read_joined(files: Iterable[pathlib.Path], max_bytes: int) -> tuple[bytes, int]:
    """Join text files with b"\\n" up to ``max_bytes``; returns (data, number of text files used).

    Files that look binary or are empty are skipped. Reading stops as soon as the cap is hit so
    a huge folder (or the whole stdlib) costs only as much I/O as the corpus actually needs.
    """
    parts: list[bytes] = []
    used = 0
    n_text = 0
    for path in files:
        if used >= max_bytes:
            break
        with open(path, "rb") as f:
            head = f.read(BINARY_SNIFF_BYTES)
            if not head or b"\0" in head:
                continue
            n_text += 1
            if parts:  # the separator counts against the cap, like any other byte
                parts.append(b"\n")
                used += 1
            remaining = max_bytes - used
            chunk = head[:remaining] if len(head) >= remaining else head + f.read(remaining - len(head))
        parts.append(chunk)
        used += len(chunk)
    return b"".join(parts)[:max_bytes], n_text


def _bytes_tensor(data: bytes) -> torch.Tensor:
    # bytearray: frombuffer on immutable bytes warns and would alias read-only memory.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_tokens(path: str | None, max_bytes: int) -> torch.Tensor:
    """Load a corpus as a 1-D token tensor, reading at most ``max_bytes`` bytes.

    * ``None``: the default stdlib corpus (``default_corpus_files``), joined with b"\\n" -> uint8.
    * a folder: every non-hidden, non-binary regular file below it, sorted, joined -> uint8.
    * ``*.bin`` with a ``.json`` sidecar (``hybridpar data prepare``): its uint16 or uint32 tokens.
    * ``*.bin``: nanoGPT-style little-endian uint16 tokens -> int32, ``max_bytes // 2`` tokens.
    * any other file: its raw bytes -> uint8.
    Problems raise ValueError naming the path.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if path is None:
        data, _ = _read_joined(default_corpus_files(), max_bytes)
        if not data:
            raise ValueError(f"default corpus (stdlib at {sysconfig.get_paths()['stdlib']}) is empty")
        return _bytes_tensor(data)
    p = pathlib.Path(path)
    if not p.exists():
        raise ValueError(f"data path {path!r} does not exist")
    if p.is_dir():
        data, n_text = _read_joined(_walk_sorted(p, frozenset(), None), max_bytes)
        if n_text == 0:
            raise ValueError(f"data folder {path!r} contains no (non-empty, non-hidden) text files")
        return _bytes_tensor(data)
    if not p.is_file():
        raise ValueError(f"data path {path!r} is neither a regular file nor a folder")
    if p.suffix == ".bin" and (meta := read_sidecar(p)) is not None:
        dtype = np.dtype(TOKEN_DTYPES[meta["dtype"]])
        n = min(meta["tokens"], max_bytes // dtype.itemsize)
        if n == 0:
            raise ValueError(f"max_bytes={max_bytes} reads no {meta['dtype']} token from {path!r}")
        mm = np.memmap(p, dtype=dtype, mode="r")
        return torch.from_numpy(np.asarray(mm[:n], dtype=np.int64 if dtype.itemsize > 2 else np.int32).copy())
    if p.suffix == ".bin":
        size = p.stat().st_size
        if size == 0:
            raise ValueError(f"token file {path!r} is empty")
        if size % 2:
            raise ValueError(f"token file {path!r} has odd size {size} bytes; expected uint16 tokens")
        n = min(size, max_bytes) // 2
        if n == 0:
            raise ValueError(f"max_bytes={max_bytes} reads no uint16 token from {path!r}")
        # memmap so only the capped prefix is paged in, not the whole (possibly huge) file.
        mm = np.memmap(p, dtype=np.dtype("<u2"), mode="r")
        return torch.from_numpy(np.asarray(mm[:n], dtype=np.int32).copy())
    with open(p, "rb") as f:
        data = f.read(max_bytes)
    if not data:
        raise ValueError(f"data file {path!r} is empty")
    return _bytes_tensor(data)


def sidecar_path(bin_path: str | pathlib.Path) -> pathlib.Path:
    """`corpus.bin` -> `corpus.json`: where `hybridpar data prepare` describes a token file."""
    return pathlib.Path(bin_path).with_suffix(".json")


def read_sidecar(bin_path: str | pathlib.Path) -> dict | None:
    """The description of a prepared token file (None: a plain nanoGPT uint16 file without one). Raises
    ValueError, naming both files, when the two do not agree (dtype and count against the file's size)."""
    side, p = sidecar_path(bin_path), pathlib.Path(bin_path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{side} (the description of {p}) cannot be read: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{side} is not a {SIDECAR_FORMAT} description of {p}; prepare the data again")
    if meta.get("dtype") not in TOKEN_DTYPES or not isinstance(meta.get("tokens"), int) or meta["tokens"] < 1:
        raise ValueError(f"{side}: dtype must be one of {', '.join(TOKEN_DTYPES)} and tokens a positive count")
    size, item = p.stat().st_size, np.dtype(TOKEN_DTYPES[meta["dtype"]]).itemsize
    if size != meta["tokens"] * item:
        raise ValueError(
            f"{p} holds {size} bytes, but {side} describes {meta['tokens']} {meta['dtype']} tokens "
            f"({meta['tokens'] * item} bytes): the file and its description do not match; prepare the data again"
        )
    return meta


class TokenData:
    """Training/validation windows over a token stream, addressed by global sample index."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int, val_fraction: float) -> None:
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"train.seq_len must be >= 1, got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.seq_len = seq_len
        self.seed = seed
        self.val_fraction = val_fraction
        # Kept in the narrow source dtype (uint8 for bytes) and widened per batch: 8x less memory.
        self.tokens = tokens
        n = tokens.numel()
        window = seq_len + 1
        n_val = self._n_val(n)
        self.train_len = n - n_val
        self.val_start = self.train_len  # held-out tail is contiguous: no window straddles the split
        self.n_train_windows = max(0, (self.train_len - 1) // seq_len)
        self.n_val_windows = max(0, (n_val - 1) // seq_len)
        if self.n_train_windows < 1 or self.n_val_windows < 1:
            need = self._tokens_needed(window)
            raise ValueError(
                f"corpus has {n} tokens ({self.train_len} train / {n_val} val), but train.seq_len={seq_len} "
                f"with data.val_fraction={val_fraction} needs at least {need} tokens for one training and "
                f"one validation window of {window} tokens; use a larger corpus (data.path / data.max_bytes), "
                f"a smaller train.seq_len or a different data.val_fraction"
            )
        # numpy, not torch: torch's reduction would start OpenMP's thread pool, and a launcher that then
        # forks its workers (launch(start_method="fork") runs this pre-flight) leaves them hanging in it.
        ids = tokens.numpy()
        if int(ids.min()) < 0:
            raise ValueError("tokens must be non-negative ids")
        self.vocab_needed = int(ids.max()) + 1
        self._perms: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._offsets = torch.arange(window, dtype=torch.int64)

    def _n_val(self, n: int) -> int:
        return int(n * self.val_fraction)

    def _tokens_needed(self, window: int) -> int:
        """Smallest corpus size holding one train and one val window (both parts grow monotonically in n)."""

        def ok(n: int) -> bool:
            nv = self._n_val(n)
            return nv >= window and n - nv >= window

        n = max(2 * window, math.ceil(window / self.val_fraction), math.ceil((window - 1) / (1 - self.val_fraction)))
        while n > 2 * window and ok(n - 1):  # float rounding may overshoot by a token or two
            n -= 1
        while not ok(n):
            n += 1
        return n

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            # Reduced mod 2**64 only so huge/negative seeds stay in manual_seed's accepted range.
            g = torch.Generator().manual_seed((self.seed * SEED_MULTIPLIER + epoch) % 2**64)
            perm = torch.randperm(self.n_train_windows, generator=g)
            self._perms[epoch] = perm
            if len(self._perms) > PERM_CACHE_SIZE:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def _gather(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.tokens[starts[:, None] + self._offsets[None, :]].to(torch.int64)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def train_samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global samples ``start .. start+count-1`` as (inputs, targets), each (count, seq_len) int64."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")
        n = self.n_train_windows
        window_ids = torch.empty(count, dtype=torch.int64)
        g = start
        while g < start + count:  # one iteration per epoch touched (usually one, at most two per batch)
            epoch, offset = divmod(g, n)
            take = min(n - offset, start + count - g)
            window_ids[g - start : g - start + take] = self._epoch_perm(epoch)[offset : offset + take]
            g += take
        return self._gather(window_ids * self.seq_len)

    def step_samples(self, step: int, global_batch: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice ``[start, start+count)`` of global batch number ``step`` (0-based)."""
        if step < 0 or global_batch < 1:
            raise ValueError(f"need step >= 0 and global_batch >= 1, got step={step}, global_batch={global_batch}")
        if start < 0 or count < 0 or start + count > global_batch:
            raise ValueError(f"slice [{start}, {start + count}) is outside the global batch of {global_batch}")
        return self.train_samples(step * global_batch + start, count)

    def val_samples(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` non-overlapping windows of the held-out tail (same on every rank)."""
        if not 0 <= count <= self.n_val_windows:
            raise ValueError(
                f"asked for {count} validation windows but only {self.n_val_windows} exist "
                f"(train.seq_len={self.seq_len}, data.val_fraction={self.val_fraction})"
            )
        starts = self.val_start + torch.arange(count, dtype=torch.int64) * self.seq_len
        return self._gather(starts)

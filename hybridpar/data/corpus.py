"""Language-model data, byte-level by default: deterministic, resumable, independent of the dp size.

Every global training sample is a pure function of (corpus, seq_len, seed, sample index), so any
rank can compute any sample without communication, and resuming at step k yields exactly the
samples an uninterrupted run would have seen. Rank r of a data-parallel group simply asks for its
slice of the step's global batch (``step_samples``); changing the dp size only changes slicing.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from hybridpar.data.sources import Corpus, open_corpus
from hybridpar.data.tokenfile import release_pages

BYTE_VOCAB = 256
# Epoch permutations kept: a step's batch spans at most two epochs, a few more absorb val/eval jitter.
PERM_CACHE_SIZE = 4
SEED_MULTIPLIER = 1_000_003


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


class TokenData:
    """Training/validation windows over a token stream, addressed by global sample index.

    ``tokens`` stays as given — a token file's read-only memory map, or bytes — and a batch reads and
    widens only its own windows (``_gather``), so memory does not grow with the corpus. What does is the
    shuffled order of the training windows: 4 bytes per window (int32 below 2**31 windows).
    """

    def __init__(
        self,
        tokens: np.ndarray | torch.Tensor,
        seq_len: int,
        seed: int,
        val_fraction: float,
        vocab: Callable[[], int] | None = None,
    ) -> None:
        ids = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens  # a view either way, never a copy
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"tokens must be a 1-D integer array, got {ids.dtype} of shape {tuple(ids.shape)}")
        if seq_len < 1:
            raise ValueError(f"train.seq_len must be >= 1, got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.seq_len = seq_len
        self.seed = seed
        self.val_fraction = val_fraction
        # Kept in the narrow source dtype (uint8 for bytes, uint16/32 in a token file), widened per batch.
        self.tokens = ids
        n = len(ids)
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
                f"one validation window of {window} tokens; use a larger corpus (data.path / data.max_tokens), "
                f"a smaller train.seq_len or a different data.val_fraction"
            )
        # numpy, not torch: torch's reduction would start OpenMP's thread pool, and a launcher that then
        # forks its workers (launch(start_method="fork") runs this pre-flight) leaves them hanging in it.
        if ids.dtype.kind == "i" and int(ids.min()) < 0:
            raise ValueError("tokens must be non-negative ids")
        self._vocab = vocab or (lambda: int(ids.max()) + 1)
        self._vocab_needed: int | None = None
        self._perms: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._offsets = np.arange(window, dtype=np.int64)
        self.corpus: Corpus | None = None  # what `open` opened

    @classmethod
    def open(cls, path: str | None, max_tokens: int | None, seq_len: int, seed: int, val_fraction: float) -> TokenData:
        """The corpus at ``path`` (``open_corpus``) as training and validation windows."""
        corpus = open_corpus(path, max_tokens)
        data = cls(corpus.tokens, seq_len, seed, val_fraction, corpus.vocab)
        data.corpus = corpus
        return data

    @property
    def vocab_needed(self) -> int:
        """One more than the largest id (a prepared file's vocabulary; else found once, when first asked)."""
        if self._vocab_needed is None:
            self._vocab_needed = self._vocab()
        return self._vocab_needed

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
            perm = perm.to(torch.int32) if self.n_train_windows < 2**31 else perm  # half the memory, same order
            self._perms[epoch] = perm
            if len(self._perms) > PERM_CACHE_SIZE:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def _gather(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # Only these windows are read (a token file's pages come from the page cache) and widened.
        windows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets[None, :]].astype(np.int64))
        release_pages(self.tokens)  # the resident set keeps nothing of the file between batches
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def documents(self, starts: np.ndarray) -> torch.Tensor:
        """The document number of each input position of the windows at ``starts``, counted from each
        window's first (count, seq_len) int64: where data.document_mask keeps attention inside documents.
        Binary search in the index: a few of its pages per window."""
        index = None if self.corpus is None else self.corpus.index
        if index is None:
            name = "the corpus" if self.corpus is None else self.corpus.name
            raise ValueError(f"data.document_mask needs a document index, and {name} has none")
        at = starts[:, None] + self._offsets[None, :-1]  # (count, seq_len) token positions
        doc = np.searchsorted(index, at, side="right").astype(np.int64)
        release_pages(index)
        return torch.from_numpy(doc - doc[:, :1])

    def train_documents(self, start: int, count: int) -> torch.Tensor:
        """``documents`` of global samples ``start .. start+count-1`` (those of ``train_samples``)."""
        return self.documents(self._train_starts(start, count))

    def val_documents(self, count: int) -> torch.Tensor:
        """``documents`` of the first ``count`` validation windows (those of ``val_samples``)."""
        return self.documents(self.val_start + np.arange(count, dtype=np.int64) * self.seq_len)

    def train_samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global samples ``start .. start+count-1`` as (inputs, targets), each (count, seq_len) int64."""
        return self._gather(self._train_starts(start, count))

    def _train_starts(self, start: int, count: int) -> np.ndarray:
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
        return window_ids.numpy() * self.seq_len

    def step_samples(self, step: int, global_batch: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice ``[start, start+count)`` of global batch number ``step`` (0-based)."""
        if step < 0 or global_batch < 1:
            raise ValueError(f"need step >= 0 and global_batch >= 1, got step={step}, global_batch={global_batch}")
        if start < 0 or count < 0 or start + count > global_batch:
            raise ValueError(f"slice [{start}, {start + count}) is outside the global batch of {global_batch}")
        return self.train_samples(step * global_batch + start, count)

    def step_documents(self, step: int, global_batch: int, start: int, count: int) -> torch.Tensor:
        """``documents`` of the samples ``step_samples`` gives for the same arguments."""
        return self.train_documents(step * global_batch + start, count)

    def val_samples(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` non-overlapping windows of the held-out tail (same on every rank)."""
        if not 0 <= count <= self.n_val_windows:
            raise ValueError(
                f"asked for {count} validation windows but only {self.n_val_windows} exist "
                f"(train.seq_len={self.seq_len}, data.val_fraction={self.val_fraction})"
            )
        starts = self.val_start + np.arange(count, dtype=np.int64) * self.seq_len
        return self._gather(starts)

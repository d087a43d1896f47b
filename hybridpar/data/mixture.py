"""Weighted mixtures of corpora: `data.path = "0.7:web.bin,0.3:code.bin"`.

Each global training sample comes from one source, chosen by a pure function of its index: samples go in
blocks of `BLOCK`, and within a block sample i goes to the source furthest below its target share after
i samples (Megatron's blended dataset: `weight * (i + 1) - taken` is largest), so every block holds each
source's share to within one sample, interleaved. Sample g is then (block b, place p): source
`pattern[p]`, and that source's sample `b * per_block[source] + rank[p]` (rank: how many of the block's
earlier places went to the same source), drawn from the source's own shuffled windows (`TokenData`).
Nothing depends on the dp size or on what was read before, so a resume at any step, on any layout,
reads exactly what the uninterrupted run would have.

Validation: the mixture's validation windows interleave the sources' held-out tails by the same pattern
(`val_loss`), and each source's own tail gives its loss alone (`val_sources`, the record's
`val_loss_by_source`).
"""

from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridpar.data.corpus import TokenData
from hybridpar.data.sources import EXAMPLE_MIXTURE as EXAMPLE

BLOCK = 1000  # samples per block of the blend: each source's share is exact to 1/BLOCK of the block
_ITEM = re.compile(r"\s*([^:]+?)\s*:\s*(.+?)\s*")


def parse_mixture(spec: str | None) -> list[tuple[float, str]] | None:
    """`"0.7:a.bin,0.3:b.bin"` -> [(0.7, "a.bin"), (0.3, "b.bin")]; None for one corpus (no spec, an
    existing path, a string without `:`). ValueError naming data.path and the item for a bad mixture."""
    if spec is None or ":" not in spec or pathlib.Path(spec).exists():
        return None
    items: list[tuple[float, str]] = []
    for part in spec.split(","):
        m = _ITEM.fullmatch(part)
        try:
            weight = float(m[1]) if m else math.nan
        except ValueError:
            weight = math.nan
        if m is None or math.isnan(weight):
            raise ValueError(
                f"data.path={spec!r}: {part.strip()!r} is not WEIGHT:PATH (a mixture of token files is written "
                f"{EXAMPLE}; a single corpus is its path alone, which does not exist here)"
            )
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"data.path={spec!r}: the weight of {m[2]!r} is {m[1]}; each weight must be a number > 0")
        if any(m[2] == p for _, p in items):
            raise ValueError(f"data.path={spec!r}: {m[2]!r} is named twice; give each source once, with one weight")
        items.append((weight, m[2]))
    return items


def corpus_paths(spec: str | None) -> list[str | None]:
    """The corpora data.path names: its sources for a mixture, else itself."""
    mix = parse_mixture(spec)
    return [spec] if mix is None else [p for _, p in mix]


def blend_pattern(weights: list[float], block: int = BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source of each place of a block, its rank among the block's places of that source, places per
    source), by Megatron's greedy rule: each place to the source furthest below its share so far."""
    w = np.asarray(weights, dtype=np.float64) / math.fsum(weights)
    taken = np.zeros(len(w), dtype=np.int64)
    source = np.empty(block, dtype=np.int64)
    rank = np.empty(block, dtype=np.int64)
    for i in range(block):
        s = int(np.argmax(w * (i + 1) - taken))  # ties: the first source, so the pattern is one function
        source[i], rank[i] = s, taken[s]
        taken[s] += 1
    return source, rank, taken


class MixtureData:
    """Training and validation windows of several corpora, blended by weight (see the module's doc). The
    same interface as `TokenData`: `step_samples`, `train_samples`, `val_samples`, `vocab_needed`."""

    def __init__(self, sources: list[tuple[str, TokenData]], weights: list[float]) -> None:
        self.names = [n for n, _ in sources]
        self.sources = [d for _, d in sources]
        self.weights = weights
        first = self.sources[0]
        self.seq_len, self.seed, self.val_fraction = first.seq_len, first.seed, first.val_fraction
        self.source, self.rank, self.per_block = blend_pattern(weights)
        for name, w, n in zip(self.names, weights, self.per_block):
            if n == 0:
                raise ValueError(
                    f"data.path: the weight {w} of {name!r} is below 1/{2 * BLOCK} of the total, so it would "
                    f"never be sampled (a block of the blend holds {BLOCK} samples); raise it or leave it out"
                )
        self.n_val_windows = min(self._val_capacity(s) for s in range(len(self.sources)))
        self.corpus = None

    @classmethod
    def open(
        cls, mix: list[tuple[float, str]], max_tokens: int | None, seq_len: int, seed: int, val_fraction: float
    ) -> MixtureData:
        """Each source opened as `TokenData.open` would (its own held-out tail, data.max_tokens each)."""
        sources = [(p, TokenData.open(p, max_tokens, seq_len, seed, val_fraction)) for _, p in mix]
        return cls(sources, [w for w, _ in mix])

    @property
    def vocab_needed(self) -> int:
        return max(d.vocab_needed for d in self.sources)

    def _val_capacity(self, s: int) -> int:
        """Mixed validation windows this source can feed: ones whose source-s share fits its tail."""
        n, per = self.sources[s].n_val_windows, int(self.per_block[s])
        full, rest = divmod(n, per)
        places = np.flatnonzero(self.source == s)
        return full * BLOCK + int(places[rest])  # rest < per: the first window past its tail

    def _locate(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sample indices -> (source, sample within that source)."""
        block, place = np.divmod(index, BLOCK)
        source = self.source[place]
        return source, block * self.per_block[source] + self.rank[place]

    def _blend(self, index: np.ndarray, fetch: Callable[[TokenData, np.ndarray], tuple[torch.Tensor, ...]]) -> tuple:
        """What `fetch(source, samples within it)` gives, (n, seq_len) tensors, put in the order of `index`."""
        source, within = self._locate(index)
        out: list[torch.Tensor] = []
        for s in np.unique(source):
            at = torch.from_numpy(np.flatnonzero(source == s))
            for i, part in enumerate(fetch(self.sources[s], within[at.numpy()])):
                if len(out) <= i:
                    out.append(torch.empty(len(index), self.seq_len, dtype=torch.int64))
                out[i][at] = part
        return tuple(out)

    def train_samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global samples `start .. start+count-1` as (inputs, targets), each (count, seq_len) int64."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")
        return self._blend(np.arange(start, start + count, dtype=np.int64), _train_windows)

    def step_samples(self, step: int, global_batch: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice `[start, start+count)` of global batch number `step` (0-based)."""
        if step < 0 or global_batch < 1 or start < 0 or count < 0 or start + count > global_batch:
            raise ValueError(f"bad slice [{start}, {start + count}) of global batch {step} of {global_batch}")
        return self.train_samples(step * global_batch + start, count)

    def val_samples(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `count` validation windows of the blend (each source's tail in its order)."""
        if not 0 <= count <= self.n_val_windows:
            raise ValueError(
                f"asked for {count} validation windows but the mixture's sources give only {self.n_val_windows} "
                f"(train.seq_len={self.seq_len}, data.val_fraction={self.val_fraction})"
            )
        return self._blend(np.arange(count, dtype=np.int64), _val_windows)

    def step_documents(self, step: int, global_batch: int, start: int, count: int) -> torch.Tensor:
        """Each sample's document numbers (`TokenData.documents`), as `step_samples` gives the samples."""
        index = np.arange(step * global_batch + start, step * global_batch + start + count, dtype=np.int64)
        return self._blend(index, lambda d, w: (_runs(d.train_documents, w),))[0]

    def val_documents(self, count: int) -> torch.Tensor:
        return self._blend(np.arange(count, dtype=np.int64), lambda d, w: (d.val_documents(int(w[-1]) + 1)[w],))[0]

    def val_sources(self, count: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each source's first `count` validation windows alone, by its name in data.path."""
        return {n: d.val_samples(count) for n, d in zip(self.names, self.sources)}


def _runs(read: Callable[[int, int], Any], within: np.ndarray) -> Any:
    """`read(start, count)` of a source's samples at the (rising) indices `within`, one call per run of
    neighbours, concatenated (each part a tensor, or a tuple of them)."""
    parts, lo = [], 0
    for hi in [*(np.flatnonzero(np.diff(within) != 1) + 1).tolist(), len(within)]:
        parts.append(read(int(within[lo]), hi - lo))
        lo = hi
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(p) for p in zip(*parts))


def _train_windows(data: TokenData, within: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return _runs(data.train_samples, within)


def _val_windows(data: TokenData, within: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data.val_samples(int(within[-1]) + 1)
    return x[torch.from_numpy(within)], y[torch.from_numpy(within)]


ValSet = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # inputs, targets, document numbers


def val_sets(data: TokenData | MixtureData, count: int, documents: bool) -> tuple[ValSet, dict[str, ValSet]]:
    """The run's validation set and, for a mixture, each source's alone (by its name), each with its
    windows' document numbers where `documents` (data.document_mask)."""

    def one(d: TokenData | MixtureData) -> ValSet:
        return (*d.val_samples(count), d.val_documents(count) if documents else None)

    by_source = {n: one(d) for n, d in zip(data.names, data.sources)} if isinstance(data, MixtureData) else {}
    return one(data), by_source


def open_data(
    path: str | None, max_tokens: int | None, seq_len: int, seed: int, val_fraction: float
) -> TokenData | MixtureData:
    """The corpus data.path names, a mixture where it is one (`parse_mixture`)."""
    mix = parse_mixture(path)
    if mix is None:
        return TokenData.open(path, max_tokens, seq_len, seed, val_fraction)
    return MixtureData.open(mix, max_tokens, seq_len, seed, val_fraction)

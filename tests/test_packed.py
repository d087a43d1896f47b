"""ZeRO's packed checkpoint slices (resilience/packed.py), without processes: every rank's slices of a
tensor packed as training saves them, then cut out for other (dp, tp) layouts, ZeRO or none, and whole —
through DCP files in one process as export and serving read them. The multi-rank resume chain is in
tests/test_zero.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybridpar.dataparallel.zero import Slice, slice_of
from hybridpar.resilience import packed
from hybridpar.resilience.checkpoint import Where, _region

FULL = torch.arange(6 * 10 * 3, dtype=torch.float32).reshape(6, 10, 3)  # (rows, cols, 3)


def _topo(dp: int, tp: int, dp_rank: int, tp_rank: int) -> SimpleNamespace:
    return SimpleNamespace(dp_rank=dp_rank, tp_rank=tp_rank, dims=SimpleNamespace(tp=tp, dp=dp))


def _columns(shape: torch.Size, dp: int) -> Slice:
    """The cut of checkpoints written before ZeRO cut rows only: torch.chunk's along the columns (where tp
    sharded the rows)."""
    chunk = -(-shape[1] // dp)
    offsets = tuple(min(shape[1], r * chunk) for r in range(dp))
    return Slice(1, offsets, tuple(min(shape[1], o + chunk) - o for o in offsets))


def _local(dp: int, tp: int, r: int, t: int, zero: bool, tp_dim: int = 1, old: bool = False) -> tuple:
    """Rank (dp r, tp t)'s piece of FULL as training holds it: the tp shard (of dim `tp_dim`), cut by
    ZeRO's rule (`old`: by the earlier rule's column cut)."""
    shard = FULL.chunk(tp, dim=tp_dim)[t]
    s = _columns(shard.shape, dp) if old else slice_of(shard.shape, tp_dim, dp)
    where = Where(tp_dim, s if zero else None)
    piece = shard.narrow(s.dim, s.offsets[r], s.sizes[r]) if zero else shard
    return piece, where, _topo(dp, tp, r, t)


def _saved(dp: int, tp: int, tp_dim: int = 1, old: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    flats, index = {}, {}
    for r in range(dp):
        for t in range(tp):
            piece, where, topo = _local(dp, tp, r, t, True, tp_dim, old)
            f, i = packed.pack([("w", piece, _region(piece, where, topo))], f"rank{r * tp + t}")
            flats.update(f)
            index.update(i)
    return flats, index


# dp 4 leaves empty slices (6 rows; 3 per tp shard); tp shards the columns, or the rows as the dp cut does;
# the last: rows tp-sharded, columns dp-cut, as checkpoints were written before the row cut.
@pytest.mark.parametrize("saved", [(4, 1, 1, False), (2, 2, 1, False), (3, 1, 1, False), (2, 2, 0, False),
                                   (4, 2, 0, False), (3, 2, 0, True)])  # fmt: skip
@pytest.mark.parametrize("read_as", [(1, 1, False, 1), (3, 1, True, 1), (2, 2, True, 1), (1, 2, False, 1),
                                     (4, 2, True, 1), (3, 2, True, 0), (1, 2, False, 0)])  # fmt: skip
def test_slices_are_cut_for_any_other_layout(saved: tuple, read_as: tuple) -> None:
    flats, index = _saved(*saved)
    asked: list[str] = []

    def read(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        asked.append(name)
        assert flats[name].numel() == numel and flats[name].dtype == dtype
        return flats[name]

    dp, tp, zero, tp_dim = read_as
    for r in range(dp):
        for t in range(tp):
            want, where, topo = _local(dp, tp, r, t, zero, tp_dim)
            got = torch.full_like(want, float("nan"))
            asked.clear()
            packed.unpack(index, {"w": [(got, _region(got, where, topo))]}, read)
            assert torch.equal(got, want), (saved, read_as, r, t)
            assert len(asked) == len(set(asked)) <= saved[0] * saved[1]  # each flat tensor read at most once


def test_a_piece_saved_by_tp_replicas_is_read_once() -> None:
    """Checkpoints written before tp replicas wrote a replicated tensor's slices once hold each slice twice
    (tp ranks 0 and 1): they load all the same, each element once."""
    flats, index = {}, {}
    for r in range(2):
        for t in range(2):  # FULL replicated over tp 2 (no tp_dim), cut over dp 2
            where = Where(None, slice_of(FULL.shape, None, 2))
            piece = FULL.narrow(0, where.zero.offsets[r], where.zero.sizes[r])
            f, i = packed.pack([("w", piece, _region(piece, where, _topo(2, 2, r, t)))], f"rank{r * 2 + t}")
            flats.update(f)
            index.update(i)
    got = torch.full_like(FULL, float("nan"))
    packed.unpack(index, {"w": [(got, packed.whole(got))]}, lambda n, k, d: flats[n])
    assert torch.equal(got, FULL)


def test_a_missing_piece_is_named() -> None:
    flats, index = _saved(2, 1)
    index.pop("zero/rank1/float32")
    got = torch.empty_like(FULL)
    with pytest.raises(ValueError, match=r"^w: the checkpoint's packed slices cover 90 of 180 elements"):
        packed.unpack(index, {"w": [(got, packed.whole(got))]}, lambda n, k, d: flats[n])
    with pytest.raises(ValueError, match=r"w: the checkpoint holds shape \[6, 10, 3\], this model \[6, 10\]"):
        packed.unpack(index, {"w": [(got[:, :, 0], packed.whole(got[:, :, 0]))]}, lambda n, k, d: flats[n])


def test_whole_tensors_through_dcp_files(tmp_path: Path) -> None:
    """The flat tensors and an ordinary entry in one DCP checkpoint, read whole (export, serving)."""
    flats, index = _saved(2, 2)
    dcp.save({**flats, "norm": torch.ones(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / packed.INDEX).write_text(json.dumps(index))
    state = {"w": torch.empty_like(FULL), "norm": torch.zeros(3)}
    packed.load_whole(state, tmp_path)
    assert torch.equal(state["w"], FULL) and torch.equal(state["norm"], torch.ones(3))
    assert packed.read_index(tmp_path / "none") == {}  # a checkpoint without ZeRO slices


@pytest.mark.parametrize(
    "text, expect",
    [
        ("{", "is not valid JSON"),
        ("[]", "expected an object of flat tensors, got list"),
        (
            '{"f": {"dtype": "torch.float32", "numel": 4, "pieces": [{"key": "w", "shape": [8], '
            '"offsets": [0], "sizes": [8], "at": 0}]}}',
            "entry 'f' is not a flat tensor's index",
        ),
        ('{"f": {"dtype": "os.system", "numel": 4, "pieces": []}}', "entry 'f' is not a flat tensor's index"),
    ],
)
def test_a_bad_index_is_refused_naming_the_file(tmp_path: Path, text: str, expect: str) -> None:
    (tmp_path / packed.INDEX).write_text(text)
    with pytest.raises(ValueError, match=rf"{packed.INDEX}.*{expect}"):
        packed.read_index(tmp_path)

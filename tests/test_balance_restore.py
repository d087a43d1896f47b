"""A restart keeps its balance (balance/restore.py, pure): the checkpoint's layout is taken where the mesh
and batch it was made for still hold, and otherwise the run says why it starts from the configured one."""

from __future__ import annotations

import pytest

from hybridpar.balance.repartition import Layout
from hybridpar.balance.restore import recorded_layout, restored_layout


def R(*sizes: int) -> tuple[range, ...]:
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return tuple(out)


UNIFORM = Layout.uniform(R(4, 4), [6, 6])
MOVED = Layout((R(6, 2), R(4, 4)), (8, 4))
MESH = dict(pp=2, dp=2, virtual_stages=1, global_batch=12, microbatches=2)


def _saved(layout: Layout, **mesh: int) -> dict:
    m = {"pp": 2, "dp": 2, "virtual_stages": 1, **mesh}
    return {"step": 14, "balance_layout": recorded_layout(layout, m["pp"], m["dp"], m["virtual_stages"])}


def test_the_recorded_layout_is_taken() -> None:
    r = restored_layout(_saved(MOVED), UNIFORM, **MESH)
    assert r.layout == MOVED and "[[6, 2], [4, 4]]" in r.reason and "[8, 4]" in r.reason
    assert r.to_record()["source"] == "checkpoint" and r.to_record()["layout"] == MOVED.to_record()


@pytest.mark.parametrize(
    "saved, mesh, why",
    [
        (None, {}, "not resumed"),
        ({"step": 3}, {}, "records no balanced layout"),
        ({"step": 3, "balance_layout": {"parts": 1}}, {}, "unreadable"),
        (_saved(MOVED, pp=4), {}, "it was for pp=4, this run has pp=2"),
        (_saved(MOVED), {"dp": 1}, "it was for dp=2, this run has dp=1"),
        (_saved(MOVED), {"global_batch": 16}, "sum to 12, train.global_batch=16"),
        (_saved(MOVED), {"microbatches": 5}, "share 4 is below train.microbatches=5"),
        (_saved(UNIFORM), {}, "is the configured one"),
    ],
)
def test_a_layout_that_does_not_apply_is_left(saved: dict | None, mesh: dict, why: str) -> None:
    r = restored_layout(saved, UNIFORM, **{**MESH, **mesh})
    assert r.layout is None and why in r.reason and r.to_record()["source"] == "configured"


def test_zero3_leaves_a_layout_whose_replicas_differ() -> None:
    """ZeRO-3 cuts each layer among the replicas' ranks of one stage: a per-replica layout recorded at
    another zero level is left, a shared one taken."""
    r = restored_layout(_saved(MOVED), UNIFORM, **MESH, shared_only=True)
    assert r.layout is None and "needs one partition for all" in r.reason
    shared = Layout.uniform(R(6, 2), [8, 4])
    assert restored_layout(_saved(shared), UNIFORM, **MESH, shared_only=True).layout == shared


def test_another_layer_count_is_left() -> None:
    r = restored_layout(_saved(MOVED), Layout.uniform(R(5, 5), [6, 6]), **MESH)
    assert r.layout is None and "covers 8 layers, this model has 10" in r.reason
